#!/usr/bin/env bash
# The prepared GPU check as one command (see scripts/gpu_check.py and docs/gpu.md).
#
#   bash scripts/gpu_check.sh --fetch-wheels [--python-version 3.12]
#       here, with internet: megatron-core and every wheel it and this package need beyond
#       torch (numpy, packaging, ...) for the GPU machine's Python (default: this python3's),
#       manylinux x86_64, into .whl/ (git-ignored; $BYTESCALE_WHEELS to put them elsewhere)
#   bash scripts/gpu_check.sh OUT_DIR [ARGS]
#       on the GPU machine (no internet): unless megatron.core imports already, installs the
#       wheels of .whl/ into .site/ ($BYTESCALE_SITE) with pip, or without pip by unzipping
#       them, then runs the check (<= 8 min) and writes OUT_DIR/gpu_check.jsonl as it goes.
# Extra ARGS go to scripts/gpu_check.py (e.g. --sections a,b or --small). $PYTHON picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
WHEELS="${BYTESCALE_WHEELS:-$PWD/.whl}"
SITE="${BYTESCALE_SITE:-$PWD/.site}"
if [ "${1:-}" = "--fetch-wheels" ]; then
  shift
  exec "$PY" scripts/fetch_wheels.py --dest "$WHEELS" "$@"
fi
OUT="${1:?usage: bash scripts/gpu_check.sh OUT_DIR [gpu_check.py args] | --fetch-wheels [--python-version X.Y]}"
shift
mkdir -p "$OUT"
if ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no megatron.core and no $WHEELS/*.whl: run" \
    "'bash scripts/gpu_check.sh --fetch-wheels --python-version X.Y' where pip can download" >&2; exit 2; }
  mkdir -p "$SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl
  else  # no pip: a wheel is a zip whose top level is what site-packages holds
    for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE"; done
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE without pip"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null || true
# the check budgets 7 minutes for its sections; the outer limit only guards against a hang
exec timeout --signal=INT --kill-after=20 480 "$PY" scripts/gpu_check.py --out "$OUT/gpu_check.jsonl" "$@"
