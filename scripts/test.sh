#!/usr/bin/env bash
# The whole test suite, on a fresh machine: sets up ./.venv, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/planner -x`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"
exec python -m pytest -q "${@:-tests}"
