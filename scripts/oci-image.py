#!/usr/bin/env python3
"""An OCI image archive from a directory, with no registry and no Docker (issue 22).

    scripts/oci-image.py --dir ROOTFS --name docker.io/library/handoff:test --out image.tar \
        [--entrypoint '["node","dist/handoff.js"]'] [--cmd '["router"]'] [--workdir /app] \
        [--env K=V ...] [--user 10001:10001]

The archive (an OCI image layout in a tar: oci-layout, index.json, blobs/sha256/...) holds one
uncompressed layer, the directory's tree owned by root, and is what
`ctr -n k8s.io images import` takes; the index names the image, so the kubelet finds it under
that name with imagePullPolicy Never. Files keep their modes; times are zero, so the same tree
gives the same image.
"""
import argparse
import hashlib
import io
import json
import os
import sys
import tarfile


def layer(root: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                info = tar.gettarinfo(path, arcname=os.path.relpath(path, root))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = 0
                if info.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--name", required=True, help="e.g. docker.io/library/handoff:test")
    p.add_argument("--out", required=True)
    p.add_argument("--entrypoint", default=None, help="JSON list")
    p.add_argument("--cmd", default=None, help="JSON list")
    p.add_argument("--workdir", default="/")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--user", default="")
    a = p.parse_args()
    if not os.path.isdir(a.dir):
        print(f"oci-image: {a.dir} is not a directory", file=sys.stderr)
        return 2
    data = layer(a.dir)
    diff_id = "sha256:" + hashlib.sha256(data).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *a.env],
            "WorkingDir": a.workdir,
            **({"Entrypoint": json.loads(a.entrypoint)} if a.entrypoint else {}),
            **({"Cmd": json.loads(a.cmd)} if a.cmd else {}),
            **({"User": a.user} if a.user else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "scripts/oci-image.py"}],
    }
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        layer_digest = blob(tar, data)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(data)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest_bytes),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": a.name, "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1]},
                }
            ],
        }
        for name, body in (("oci-layout", {"imageLayoutVersion": "1.0.0"}), ("index.json", index)):
            raw = json.dumps(body).encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    os.replace(tmp, a.out)
    print(f"oci-image: {a.name}: {len(data) / 1e6:.1f} MB layer -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
