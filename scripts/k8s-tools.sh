#!/usr/bin/env bash
# Real Kubernetes binaries for the discovery and chart tests (issue 11), with no download
# outside the package registries:
#   etcd            Debian's etcd-server package (installed with apt-get when missing, as root)
#   kube-apiserver  built from the k8s.io/kubernetes module source through the Go module proxy
#   kubectl         built from the same tree (Debian's kubectl 1.20 lacks --subresource)
#   helm            helm.sh/helm/v3 through the Go module proxy
#   kubelet, kube-controller-manager, kube-scheduler, kube-proxy (with --node): the rest of a
#                   single-node cluster (scripts/k8s-node.sh), from the same tree
# The binaries land in .cache/k8s/<KUBE_VERSION>/; a second run with them present is instant.
# Progress goes to stderr; the last line on stdout is that folder.
#
#   scripts/k8s-tools.sh            everything above
#   scripts/k8s-tools.sh --no-helm  skip helm
#   scripts/k8s-tools.sh --node     also the node's binaries
#
# `go install k8s.io/kubernetes/cmd/kube-apiserver@vX` refuses: the module's go.mod replaces
# its 31 staging modules (k8s.io/api, k8s.io/apiserver, ...) with ./staging paths, which the
# module zip does not contain. So: copy the downloaded module, drop go.work, and point each
# staging module at its published v0.<minor>.<patch> tag instead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/k8s-versions
. "$root/scripts/k8s-versions"
want_helm=1
want_node=0
for arg in "$@"; do
  case "$arg" in
    --no-helm) want_helm=0 ;;
    --node) want_node=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "k8s-tools: unknown argument $arg" >&2; exit 2 ;;
  esac
done

say() { echo "k8s-tools: $*" >&2; }
die() { say "error: $*"; exit 1; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

out="$root/.cache/k8s/$KUBE_VERSION"
work="$root/.cache/k8s/src"
mkdir -p "$out" "$work"

# --- etcd --------------------------------------------------------------------------------
if command -v etcd >/dev/null 2>&1; then
  say "etcd: $(etcd --version 2>/dev/null | head -n 1)"
else
  [ "$(id -u)" = 0 ] || die "etcd not found and not root: apt-get install etcd-server"
  say "etcd: installing Debian's etcd-server"
  t0=$(date +%s)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server >/dev/null) \
    || die "apt-get install etcd-server failed"
  # The package enables a system etcd on 2379; the tests start their own on free ports.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now etcd >/dev/null 2>&1 || true; fi
  say "etcd: installed in $(elapsed "$t0")"
fi

# --- Go ----------------------------------------------------------------------------------
go=$(command -v go || true)
[ -n "$go" ] || go=/usr/local/go/bin/go
[ -x "$go" ] || die "go not found (PATH or /usr/local/go/bin/go)"
# Go keeps its module and build caches under $HOME; CI may run with a bare environment.
if [ -z "${HOME:-}" ]; then HOME=$(getent passwd "$(id -u)" | cut -d: -f6); export HOME; fi
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-p=2 -mod=mod"
# have BIN VERSION ARGS...: BIN exists and its version output names VERSION (else rebuilt).
have() { [ -x "$out/$1" ] && "$out/$1" "${@:3}" 2>/dev/null | grep -qF -- "$2"; }

# --- Kubernetes binaries -----------------------------------------------------------------
# kube-apiserver and kubectl always; with --node the rest of a single-node cluster.
cmds="kube-apiserver kubectl"
[ "$want_node" = 1 ] && cmds+=" kubelet kube-controller-manager kube-scheduler kube-proxy"
missing=""
for cmd in $cmds; do
  if [ "$cmd" = kubectl ]; then have kubectl "$KUBE_VERSION" version --client || missing+=" $cmd"
  else have "$cmd" "$KUBE_VERSION" --version || missing+=" $cmd"; fi
done
if [ -z "$missing" ]; then
  say "$cmds $KUBE_VERSION: cached in $out"
else
  staging=v0.${KUBE_VERSION#v1.}
  src="$work/kubernetes-$KUBE_VERSION"
  if [ ! -f "$src/.prepared" ]; then
    t0=$(date +%s)
    say "kubernetes $KUBE_VERSION: downloading the module source (go mod download)"
    dir=$(cd "$work" && GOFLAGS= "$go" mod download -json "k8s.io/kubernetes@$KUBE_VERSION" \
      | sed -nE 's/^[[:space:]]*"Dir": "(.*)",?$/\1/p')
    [ -n "$dir" ] && [ -d "$dir" ] || die "go mod download k8s.io/kubernetes@$KUBE_VERSION gave no Dir"
    rm -rf "$src"
    mkdir -p "$work"
    cp -r "$dir" "$src"
    chmod -R u+w "$src"   # the module cache is read-only
    rm -f "$src/go.work" "$src/go.work.sum"
    # Every `k8s.io/X => ./staging/...` replace becomes a require of the published tag.
    mods=$(cd "$src" && "$go" mod edit -json | sed -nE 's/^[[:space:]]*"Path": "(k8s\.io\/[^"]+)"$/\1/p' | sort -u)
    edits=()
    for m in $mods; do
      if grep -qE "^[[:space:]]*$m => \./staging/" "$src/go.mod"; then
        edits+=("-dropreplace=$m" "-require=$m@$staging")
      fi
    done
    [ ${#edits[@]} -gt 0 ] || die "no staging replace directives found in $src/go.mod"
    (cd "$src" && "$go" mod edit "${edits[@]}")
    say "kubernetes $KUBE_VERSION: $(( ${#edits[@]} / 2 )) staging modules now require $staging ($(elapsed "$t0"))"
    touch "$src/.prepared"
  fi
  # The version the binaries report: hack/lib/version.sh sets these same variables.
  pkgs="k8s.io/component-base/version k8s.io/client-go/pkg/version"
  minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
  ldflags="-s -w"
  for p in $pkgs; do
    ldflags+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  for cmd in $missing; do
    t0=$(date +%s)
    # Measured on 2 shared cores: kube-apiserver 5-8 min and kubectl 1.5 min from empty Go
    # caches, about 10 s with Go's build cache warm; with it warm, kubelet 103 s,
    # kube-controller-manager 51 s, kube-proxy 16 s, kube-scheduler 8 s.
    say "$cmd $KUBE_VERSION: go build (minutes the first time)"
    (cd "$src" && nice -n 19 "$go" build -trimpath -ldflags "$ldflags" -o "$out/$cmd.tmp" "./cmd/$cmd") \
      || die "go build ./cmd/$cmd failed"
    mv "$out/$cmd.tmp" "$out/$cmd"
    say "$cmd $KUBE_VERSION: built in $(elapsed "$t0")"
  done
  have kube-apiserver "$KUBE_VERSION" --version || die "kube-apiserver --version does not say $KUBE_VERSION"
fi

# --- helm --------------------------------------------------------------------------------
if [ "$want_helm" = 1 ]; then
  # `helm version` alone would not show the Kubernetes version it assumes: a stamp does.
  if have helm "$HELM_VERSION" version && [ -f "$out/helm.kube-minor" ]; then
    say "helm $HELM_VERSION: cached in $out"
  else
    t0=$(date +%s)
    say "helm $HELM_VERSION: go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    # The Kubernetes version `helm template` and `helm lint` assume (.Capabilities.KubeVersion)
    # is set at link time, as helm's Makefile does, from the client-go it builds with
    # (v0.X.Y is Kubernetes 1.X); left alone it says 1.20.
    gomod=$(cd "$work" && GOFLAGS= "$go" mod download -json "helm.sh/helm/v3@$HELM_VERSION" \
      | sed -nE 's/^[[:space:]]*"GoMod": "(.*)",?$/\1/p')
    kminor=$(sed -nE 's/^[[:space:]]*k8s\.io\/client-go v0\.([0-9]+)\..*/\1/p' "$gomod" | head -n 1)
    [ -n "$kminor" ] || die "cannot tell which client-go helm $HELM_VERSION uses ($gomod)"
    hl="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
      hl+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$kminor"
    done
    tmpbin=$(mktemp -d)
    trap 'rm -rf "$tmpbin"' EXIT
    (cd "$work" && GOBIN="$tmpbin" GOFLAGS="-p=2" nice -n 19 "$go" install -trimpath -ldflags "$hl" \
      "helm.sh/helm/v3/cmd/helm@$HELM_VERSION") || die "go install helm failed"
    mv "$tmpbin/helm" "$out/helm"
    echo "$kminor" >"$out/helm.kube-minor"
    have helm "$HELM_VERSION" version || die "helm version does not say $HELM_VERSION"
    say "helm $HELM_VERSION: built in $(elapsed "$t0")"
  fi
fi

echo "$out"
