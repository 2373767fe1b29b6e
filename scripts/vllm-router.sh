#!/usr/bin/env bash
# vLLM Router (PyPI `vllm-router`, a Rust binary in a wheel), the anchor `handoff bench
# overhead` compares the router with (issue 23): installed in .cache/vllm-router/venv. The
# benches run it when it is there. A second run with it present is instant. The last line on
# stdout is the binary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/vllm-versions
. "$root/scripts/vllm-versions"
venv="$root/.cache/vllm-router/venv"
bin="$venv/bin/vllm-router"
say() { echo "vllm-router: $*" >&2; }
if [ -x "$bin" ] && "$venv/bin/python" -m pip show vllm-router 2>/dev/null | grep -qx "Version: $VLLM_ROUTER_VERSION"; then
  say "$VLLM_ROUTER_VERSION: cached in $venv"
else
  t0=$(date +%s)
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "vllm-router==$VLLM_ROUTER_VERSION" >&2
  say "$VLLM_ROUTER_VERSION: installed in $(( $(date +%s) - t0 ))s"
fi
"$bin" --help >/dev/null
echo "$bin"
