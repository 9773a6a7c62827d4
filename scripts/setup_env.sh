#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs megatron_bytescale with its test extras into it.
# Sourced by scripts/demo.sh and scripts/test.sh so that both work on a fresh machine.
# Torch: an importable torch (a user's CUDA build, say) is kept; otherwise the CPU wheel
# torch==2.13.0 is installed, because a bare `pip install torch` downloads a multi-GB CUDA build.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BYTESCALE_VENV:-$REPO_ROOT/.venv}"
PY_BOOT="${PYTHON:-python3}"

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
fi
export PATH="$VENV/bin:$PATH"
