#!/usr/bin/env bash
# The prepared GPU check as one command (see scripts/gpu_check.py and docs/gpu.md).
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with internet: megatron-core for the GPU
#                                              # machine's Python 3.12 into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh OUT_DIR [ARGS]   # on the GPU machine (no internet): installs the
#                                              # wheels of .whl/ into .site/ unless megatron.core
#                                              # imports already, then runs the check (<= 8 min)
#                                              # and writes OUT_DIR/gpu_check.jsonl as it goes
# Extra ARGS go to scripts/gpu_check.py (e.g. --sections a,b).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MEGATRON_CORE="${MEGATRON_CORE:-megatron-core==0.16.1}"
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$MEGATRON_CORE"
fi
OUT="${1:?usage: bash scripts/gpu_check.sh OUT_DIR [gpu_check.py args] | --fetch-wheels}"
shift
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no megatron.core and no .whl/*.whl: run" \
    "'bash scripts/gpu_check.sh --fetch-wheels' where pip can download" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target .site .whl/*.whl
  export PYTHONPATH="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null || true
# the check budgets 7 minutes for its sections; the outer limit only guards against a hang
exec timeout --signal=INT --kill-after=20 480 "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.jsonl" "$@"
