#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs megatron_bytescale with its test extras into it.
# Sourced by scripts/demo.sh and scripts/test.sh so that both work on a fresh machine.
#
# Torch: a torch the machine already has is never hidden. scripts/detect_torch.py asks the
# bootstrap interpreter ($PYTHON, default python3):
#   * a base interpreter (system Python, NGC container, conda env) with a torch that fits the
#     machine: the venv is made with --system-site-packages, so that torch (a CUDA build, say)
#     is the one the venv imports;
#   * an activated virtual environment with such a torch: it is reused as is
#     (BYTESCALE_VENV=<its prefix>), nothing is created;
#   * no torch: the CPU wheel torch==2.13.0 is installed into a plain venv (a bare
#     `pip install torch` would download a multi-GB CUDA build);
#   * a CPU-only torch on a machine with NVIDIA GPUs: refused, with what to do.
# The torch in use is printed either way. BYTESCALE_VENV=<dir> picks the venv's place.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY_BOOT="${PYTHON:-python3}"

if [ -z "${BYTESCALE_VENV:-}" ] && [ ! -x "$REPO_ROOT/.venv/bin/python" ]; then
  decision="$("$PY_BOOT" "$REPO_ROOT/scripts/detect_torch.py" 2>/dev/null || echo none)"
  case "$decision" in
    reuse\ *)
      BYTESCALE_VENV="$("$PY_BOOT" -c 'import sys; print(sys.prefix)')"
      echo "[setup] reusing the active environment $BYTESCALE_VENV: ${decision#reuse }" ;;
    system\ *)
      echo "[setup] creating $REPO_ROOT/.venv on top of $PY_BOOT: ${decision#system }"
      "$PY_BOOT" -m venv --system-site-packages "$REPO_ROOT/.venv" ;;
    mismatch\ *)
      echo "[setup] $PY_BOOT has ${decision#mismatch }. Install a CUDA build of torch for it" \
           "(see pytorch.org), or set PYTHON to an interpreter that has one." >&2
      exit 2 ;;
  esac
fi
VENV="${BYTESCALE_VENV:-$REPO_ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY_BOOT" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.bytescale-installed"
if [ ! -f "$STAMP" ] || [ "$REPO_ROOT/setup.py" -nt "$STAMP" ]; then
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing torch==2.13.0 (CPU wheel)"
    "$PY" -m pip install -q "torch==2.13.0"
  fi
  echo "[setup] installing megatron_bytescale[test] (editable)"
  "$PY" -m pip install -q -e "$REPO_ROOT[test]"
  touch "$STAMP"
  echo "[setup] $("$PY" "$REPO_ROOT/scripts/detect_torch.py" | cut -d' ' -f2-)"
fi
export PATH="$VENV/bin:$PATH"
