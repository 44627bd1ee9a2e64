#!/usr/bin/env bash
# Run scripts/gpu_checks.py on a GPU machine whose Python lacks some of our packages.
#   scripts/gpu_checks.sh [OUT_DIR] [gpu_checks.py flags...]     (OUT_DIR default: $OUT or /tmp/gpu_checks)
# Wheels in .whl/ (e.g. megatron-core for that machine's Python, fetched elsewhere with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME==VERSION`)
# are installed into /tmp/site without an index, ahead of the interpreter's own packages. A .pth file
# in the interpreter's site-packages does the same for subprocesses that reset PYTHONPATH
# (tests/megatron_parity.py's `run` does): meant for a throwaway GPU machine. pytest must be
# importable (the checks are pytest files); pytest-xdist is used when present.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT_DIR="${1:-${OUT:-/tmp/gpu_checks}}"
shift || true

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_checks: installing .whl/*.whl failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  purelib="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [[ -w "$purelib" ]]; then
    # an `import` line in a .pth runs at startup: /tmp/site goes first, so carried wheels win over the image's
    echo 'import sys; sys.path.insert(0, "/tmp/site")' >"$purelib/00_gpu_checks_site.pth"
  else
    echo "gpu_checks: $purelib is not writable; subprocesses that reset PYTHONPATH will not see /tmp/site" >&2
  fi
fi

command -v nvidia-smi >/dev/null && nvidia-smi -L
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec "$PY" scripts/gpu_checks.py --out "$OUT_DIR" "$@"
