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
#
# megatron-core: the one that fits the interpreter (setup.py pins it by python_version, and
# integration/compat.py refuses any other): 0.16.1 on Python 3.10-3.11 (Megatron-LM
# core_v0.16.1), 0.19.x on Python 3.12+ (Megatron-LM core_v0.19.0). Printed either way. There
# is no CPU wheel of torch for 3.12 here: without a usable torch, 3.12 gets the registry's
# torch==2.13.0 (with its CUDA libraries, ~3 GB; it runs on the CPU too).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY_BOOT="${PYTHON:-python3}"
PY_VERSION="$("$PY_BOOT" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
    || { echo "[setup] cannot run $PY_BOOT" >&2; exit 2; }
case "$PY_VERSION" in
  3.10|3.11) MEGATRON_FOR_PY="megatron-core 0.16.1 (Megatron-LM core_v0.16.1)" ;;
  3.1[2-9]) MEGATRON_FOR_PY="megatron-core 0.19.x (Megatron-LM core_v0.19.0)" ;;
  *) echo "[setup] $PY_BOOT is Python $PY_VERSION; megatron_bytescale needs Python 3.10-3.11" \
          "(megatron-core 0.16.1) or 3.12+ (megatron-core 0.19.x). Set PYTHON to one." >&2
     exit 2 ;;
esac
echo "[setup] Python $PY_VERSION ($PY_BOOT): $MEGATRON_FOR_PY"

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
    case "$PY_VERSION" in
      3.10|3.11) echo "[setup] installing torch==2.13.0 (CPU wheel)" ;;
      *) echo "[setup] installing torch==2.13.0 from the registry (no CPU wheel for Python" \
              "$PY_VERSION: about 3 GB with its CUDA libraries; it runs on the CPU)" ;;
    esac
    "$PY" -m pip install -q "torch==2.13.0"  # never a bare `torch`: that is whatever is newest
  fi
  echo "[setup] installing megatron_bytescale[test] (editable) with $MEGATRON_FOR_PY"
  "$PY" -m pip install -q -e "$REPO_ROOT[test]"
  touch "$STAMP"
  echo "[setup] $("$PY" "$REPO_ROOT/scripts/detect_torch.py" | cut -d' ' -f2-)"
fi
echo "[setup] $("$PY" -c 'from importlib.metadata import version as v; print("megatron-core", v("megatron-core"), "and torch", v("torch"))' 2>/dev/null || echo "megatron-core: not installed")" \
     "in $VENV"
export PATH="$VENV/bin:$PATH"
