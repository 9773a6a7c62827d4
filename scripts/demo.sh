#!/usr/bin/env bash
# The main job, on a fresh machine: sets up ./.venv, then runs the ByteScale demo.
# Extra arguments go to `bytescale demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"
exec bytescale demo "$@"
