#!/usr/bin/env bash
# The test suite on a fresh machine, as CI runs it: two lanes, each in a venv of its own.
#
#   bash scripts/test.sh            both lanes (what .ci/run runs):
#     1. the whole suite on $PYTHON (default python3; on 3.10-3.11 that is megatron-core 0.16.1
#        and the Megatron-LM core_v0.16.1 tree), in ./.venv;
#     2. every test marked `megatron` (all that import megatron, the Megatron-LM patch tests
#        included; see megatron_bytescale/testing/lanes.py) on Python 3.12 with megatron-core
#        0.19.x and the core_v0.19.0 tree, in ./.venv312 (the first run downloads ~3 GB).
#   bash scripts/test.sh ARGS...    lane 1 only, ARGS to pytest (e.g. tests/planner -x)
#   BYTESCALE_LANE=0.19 bash scripts/test.sh [ARGS...]   lane 2 only (default: -m megatron)
#
# Each lane ends with its 25 slowest tests (--durations), to keep CI's time in view.
# Python 3.12 is $PYTHON312, else python3.12 on PATH, else pyenv's newest 3.12.x. Without one,
# lane 2 is skipped with a message, or fails where BYTESCALE_REQUIRE_MEGATRON_LM=1 (CI).
# When $PYTHON is itself 3.12+, lane 1 already runs everything on 0.19.x and lane 2 is skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning}"

find_python312() {  # the first candidate that really is a Python 3.12 (pyenv shims may not run)
  local root cand
  root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
  for cand in ${PYTHON312:+"$PYTHON312"} "$(command -v python3.12 || true)" \
              $(ls -d "$root"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -rV); do
    if [[ -n "$cand" ]] && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
        >/dev/null 2>&1; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}

lane1() {  # the whole suite (or ARGS) on $PYTHON
  ( source scripts/setup_env.sh && python -m pytest -q --durations=25 "${@:-tests}" )
}

lane2() {  # the Megatron tests (or ARGS) on Python 3.12 / megatron-core 0.19.x
  local py312
  if ! py312="$(find_python312)"; then
    if [[ "${BYTESCALE_REQUIRE_MEGATRON_LM:-0}" == 1 ]]; then
      echo "[test] no Python 3.12 for the megatron-core 0.19 lane (set PYTHON312)" >&2
      return 1
    fi
    echo "[test] megatron-core 0.19 lane skipped: no Python 3.12 found (set PYTHON312)"
    return 0
  fi
  echo "[test] lane 2: megatron tests on $py312 (megatron-core 0.19.x, core_v0.19.0)"
  ( export PYTHON="$py312" BYTESCALE_VENV="${BYTESCALE_VENV312:-$PWD/.venv312}"
    source scripts/setup_env.sh
    if [[ $# -eq 0 ]]; then set -- -m megatron tests; fi
    python -m pytest -q --durations=25 "$@" )
}

if [[ "${BYTESCALE_LANE:-}" == "0.19" ]]; then
  lane2 "$@"
  exit
fi
if [[ $# -gt 0 ]]; then
  lane1 "$@"
  exit
fi
boot="$("${PYTHON:-python3}" -c 'import sys; print(int(sys.version_info >= (3, 12)))')"
echo "[test] lane 1: the whole suite on ${PYTHON:-python3}"
( source scripts/setup_env.sh )  # lane 1's venv first: both lanes' installs write the same egg-info
# Lane 2's venv (on a fresh machine a ~3 GB download and about 8 minutes) is built while lane 1's
# tests run, in a session of its own so that an interrupted run takes the installer down with it.
setup_pid=""
if [[ "$boot" != 1 ]] && py312="$(find_python312)"; then
  setup_log="$(mktemp -t bytescale-lane2-setup.XXXXXX)"
  echo "[test] building lane 2's venv in the background (log: $setup_log)"
  PYTHON="$py312" BYTESCALE_VENV="${BYTESCALE_VENV312:-$PWD/.venv312}" \
    setsid --wait bash -c 'source scripts/setup_env.sh' >"$setup_log" 2>&1 &
  setup_pid=$!
  trap '[[ -n "$setup_pid" ]] && kill -- -"$setup_pid" 2>/dev/null; true' EXIT
fi
status=0
lane1 tests || status=$?
if [[ "$boot" == 1 ]]; then
  echo "[test] lane 2 skipped: ${PYTHON:-python3} is Python 3.12+, lane 1 ran everything on megatron-core 0.19.x"
else
  if [[ -n "$setup_pid" ]]; then
    setup_status=0
    wait "$setup_pid" || setup_status=$?
    setup_pid=""
    sed 's/^/[test] lane 2 setup: /' "$setup_log"
    rm -f "$setup_log"
    if [[ "$setup_status" != 0 ]]; then
      echo "[test] lane 2's venv could not be built (exit $setup_status); its output is above" >&2
      exit 1
    fi
  fi
  lane2 tests -m megatron || status=$?
fi
exit "$status"
