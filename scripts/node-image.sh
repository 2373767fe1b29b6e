#!/usr/bin/env bash
# The handoff image for scripts/k8s-node.sh, without Docker or a registry (issue 22): the
# Dockerfile's runtime layout (/app with package.json, dist/, bin/, the native addon and the
# production node_modules; `node dist/handoff.js` from /app), made from this checkout's build
# and this machine's node and python3 (the engines' preStop hook), with the libraries `ldd`
# lists. No NIXL: transfer agents do not run in it.
#
#   scripts/node-image.sh OUT.tar [NAME]     NAME default docker.io/library/handoff:test
#
# Then `scripts/k8s-node.sh import OUT.tar`, and the chart with image.repository=handoff,
# image.tag=test, image.pullPolicy=Never.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: node-image.sh OUT.tar [NAME]}
name=${2:-docker.io/library/handoff:test}
say() { echo "node-image: $*" >&2; }
die() { say "error: $*"; exit 1; }
cd "$root"
[ -f dist/handoff.js ] || die "no dist/: npm run build"
[ -f native/build/Release/handoff_native.node ] || die "no native addon: npm run build:native"
python=$(command -v python3.11 >/dev/null && readlink -f /usr/bin/python3.11 || true)
[ -x "${python:-}" ] || die "no /usr/bin/python3.11 (Debian's python3)"

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# copy_bin PATH: the binary and every library it links, at the same paths.
copy_bin() {
  cp -L --parents "$1" "$dir"
  for lib in $(ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
    cp -L --parents "$lib" "$dir"
  done
}
node=$(readlink -f "$(command -v node)")
copy_bin "$node"
[ "$node" = /usr/bin/node ] || { mkdir -p "$dir/usr/bin"; ln -s "$node" "$dir/usr/bin/node"; }
copy_bin "$python"
ln -sf "$(basename "$python")" "$dir/usr/bin/python3"
# The standard library, without what a hook never loads.
tar -C / --exclude='__pycache__' --exclude='usr/lib/python3.11/test' --exclude='usr/lib/python3.11/idlelib' \
  --exclude='usr/lib/python3.11/tkinter' --exclude='usr/lib/python3.11/ensurepip' --exclude='usr/lib/python3.11/lib2to3' \
  --exclude='usr/lib/python3.11/config-3.11-x86_64-linux-gnu' -cf - usr/lib/python3.11 | tar -C "$dir" -xf -
# python3's extension modules link a few more libraries.
for so in "$dir"/usr/lib/python3.11/lib-dynload/*.so; do
  for lib in $(ldd "$so" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}'); do
    [ -e "$dir$lib" ] || cp -L --parents "$lib" "$dir"
  done
done

app="$dir/app"
mkdir -p "$app/native/build/Release" "$dir/tmp"
chmod 1777 "$dir/tmp"
cp package.json "$app/"
cp -r dist bin "$app/"
cp native/build/Release/handoff_native.node "$app/native/build/Release/"
# The production dependencies only (npm prune --omit=dev in the Dockerfile).
npm ls --omit=dev --all --parseable 2>/dev/null | tail -n +2 | while read -r pkg; do
  rel=${pkg#"$root"/}
  [ -e "$app/$rel" ] && continue
  mkdir -p "$app/$(dirname "$rel")"
  cp -a "$pkg" "$app/$rel"
done
python3 "$root/scripts/oci-image.py" --dir "$dir" --name "$name" --out "$out" --workdir /app \
  --entrypoint '["node", "dist/handoff.js"]' --cmd '["router"]' --env NODE_ENV=production --user 10001:10001
