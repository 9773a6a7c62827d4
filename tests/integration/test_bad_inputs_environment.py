"""Bad values of the environment variables the package reads, as one table (docs/testing.md,
"Bad input"): each row sets variables, calls the place that reads them, and checks for one
line naming the variable and its value, not a bare ``int()`` traceback on every rank.

Where each variable is read (and therefore which entry point a row calls):

* ``bytescale profile``: ``WORLD_SIZE`` decides worker or launcher; a worker reads ``RANK``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``MASTER_PORT`` (checked in ``main`` before any
  torch import); its ``OMP_NUM_THREADS`` row is in tests/integration/test_bad_inputs_launchers.py.
* ``bytescale demo``: ``OMP_NUM_THREADS`` (its workers' threads), checked by the launcher.
* the Megatron-LM hooks: ``LOCAL_WORLD_SIZE`` gives the node map unless
  ``--bytescale-ranks-per-node`` is given (refused in ``validate_args``, before training);
  ``RANK`` only picks who prints a refusal (Megatron parses ``args.rank`` itself).
* the demo worker's heartbeat: ``MASTER_ADDR`` / ``MASTER_PORT`` (torchrun sets them).
"""

from __future__ import annotations

import pytest

from megatron_bytescale.env import env_int
from megatron_bytescale.runtime.liveness import Heartbeat
from megatron_bytescale.tools import profile_cmd

BIG = "9" * 30
PROFILE_CASES = [
    # (case, variables, fragment)
    ("world-size-word", {"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer from 1 to 16,777,216"),
    ("world-size-empty", {"WORLD_SIZE": ""}, "WORLD_SIZE='' must be an integer from 1"),
    ("world-size-negative", {"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2' must be an integer from 1"),
    ("world-size-zero", {"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be an integer from 1"),
    ("world-size-huge", {"WORLD_SIZE": BIG}, f"WORLD_SIZE='{BIG}' must be an integer from 1"),
    ("world-size-float", {"WORLD_SIZE": "1e3"}, "WORLD_SIZE='1e3' must be an integer from 1"),
    ("rank-word", {"WORLD_SIZE": "2", "RANK": "x"}, "RANK='x' must be an integer from 0 to 1;"),
    ("rank-past-world", {"WORLD_SIZE": "2", "RANK": "2"}, "RANK='2' must be an integer from 0 to 1;"),
    ("rank-empty", {"WORLD_SIZE": "2", "RANK": ""}, "RANK='' must be an integer from 0 to 1;"),
    ("local-rank-negative", {"WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' must be an integer from 0"),
    ("local-rank-past-node", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"},
     "LOCAL_RANK='2' must be an integer from 0 to 1;"),
    ("local-world-zero", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' must be an integer from 1 to 2;"),
    ("local-world-huge", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": BIG}, "LOCAL_WORLD_SIZE='9999"),
    ("master-port-huge", {"WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be an integer from 1 to 65,535"),
    ("master-port-word", {"WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http' must be an integer from 1"),
]
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")


@pytest.fixture
def clean_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("case, variables, fragment", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_profile_refuses_a_bad_torchrun_variable_before_any_worker(clean_env, capsys, case, variables, fragment):
    def refuse(*_args, **_kwargs):
        raise AssertionError("bytescale profile got past its checks")

    clean_env.setattr(profile_cmd, "launch", refuse)
    clean_env.setattr(profile_cmd, "run_worker", refuse)
    for name, value in variables.items():
        clean_env.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        profile_cmd.main(["--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("bytescale profile: error: the environment variable "), err
    assert fragment in line, line
    assert "unset WORLD_SIZE" in line and "Traceback" not in err


def test_profile_accepts_what_torchrun_sets(clean_env):
    """The valid case of the same rows: a worker with torchrun's variables gets to run_worker."""
    ran = []
    clean_env.setattr(profile_cmd, "run_worker", lambda args, lengths: ran.append(lengths) or 0)
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_PORT": "29500"}.items():
        clean_env.setenv(name, value)
    assert profile_cmd.main(["--nproc-per-node", "2"]) == 0 and len(ran) == 1


HEARTBEAT_CASES = [
    ("master-addr-unset", {"MASTER_PORT": "29500"}, "MASTER_ADDR is unset"),
    ("master-addr-empty", {"MASTER_ADDR": " ", "MASTER_PORT": "29500"}, "MASTER_ADDR is empty"),
    ("master-port-unset", {"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is unset"),
    ("master-port-zero", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}, "MASTER_PORT='0' must be an integer from 1"),
]


@pytest.mark.parametrize("case, variables, fragment", HEARTBEAT_CASES, ids=[c[0] for c in HEARTBEAT_CASES])
def test_the_heartbeat_names_a_bad_rendezvous_variable(clean_env, case, variables, fragment):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")) as info:
        Heartbeat.from_env(rank=0, world_size=1)
    assert "start the job with torchrun" in str(info.value)


HOOK_CASES = [
    ("local-world-word", "x", "LOCAL_WORLD_SIZE='x' must be an integer from 1"),
    ("local-world-empty", "", "LOCAL_WORLD_SIZE='' must be an integer from 1"),
    ("local-world-negative", "-8", "LOCAL_WORLD_SIZE='-8' must be an integer from 1"),
    ("local-world-huge", BIG, "LOCAL_WORLD_SIZE='9999"),
]


@pytest.mark.parametrize("case, value, fragment", HOOK_CASES, ids=[c[0] for c in HOOK_CASES])
def test_megatron_lm_refuses_a_bad_local_world_size_before_training(clean_env, case, value, fragment):
    from megatron_bytescale.integration import megatron_lm

    from .test_megatron_lm_hooks import megatron_namespace, tiny_model_args

    clean_env.setenv("LOCAL_WORLD_SIZE", value)
    args = megatron_namespace("--bytescale-hdp", mock_data=True, **tiny_model_args())
    reasons = megatron_lm.hdp_refusals(args)
    assert len(reasons) == 1 and fragment in reasons[0], reasons
    assert "--bytescale-ranks-per-node" in reasons[0]
    # the flag gives the node map: the variable is not read, so not refused
    args = megatron_namespace("--bytescale-hdp", "--bytescale-ranks-per-node", "2", mock_data=True,
                              **tiny_model_args())
    assert megatron_lm.hdp_refusals(args) == []


def test_a_bad_rank_only_makes_every_process_print_the_refusal(clean_env, capsys):
    """``RANK`` picks who reports a refusal when Megatron has not parsed ``args.rank``; a value
    that is no rank must not turn the one-line refusal into a traceback."""
    from megatron_bytescale.integration import megatron_lm

    from .test_megatron_lm_hooks import megatron_namespace

    for value, prints in [("abc", True), ("", True), ("0", True), ("3", False)]:
        clean_env.setenv("RANK", value)
        args = megatron_namespace("--bytescale-capacity", "128", rank=None)
        with pytest.raises(SystemExit) as info:
            megatron_lm.check_args(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and ("given without --bytescale-hdp" in err) == prints, (value, err)
        assert "Traceback" not in err


OMP_CASES = [("omp-word", "abc"), ("omp-zero", "0"), ("omp-negative", "-4"), ("omp-huge", BIG)]


@pytest.mark.parametrize("case, value", OMP_CASES, ids=[c[0] for c in OMP_CASES])
def test_the_demo_refuses_a_bad_omp_num_threads_before_its_workers(clean_env, capsys, tmp_path, case, value):
    """libgomp only prints "Invalid value for environment variable OMP_NUM_THREADS" in every
    worker and runs on; the demo launcher says which value and what to do, like profile's."""
    from megatron_bytescale.tools import demo_cmd

    def refuse(*_args, **_kwargs):
        raise AssertionError("bytescale demo got past its checks")

    clean_env.setattr(demo_cmd, "run_demo_job", refuse)
    clean_env.setenv("OMP_NUM_THREADS", value)
    assert demo_cmd.main(["--out", str(tmp_path / "out")]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line == (f"bytescale demo: error: the environment variable OMP_NUM_THREADS={value!r} "
                    "must be a number of threads >= 1 (or unset)")


@pytest.mark.parametrize("raw", ["7", " 7 ", "0007"])
def test_env_int_reads_plain_decimals(raw):
    assert env_int("X", low=0, high=10, environ={"X": raw}) == 7
    assert env_int("X", low=0, high=10, default=3, environ={}) == 3


def test_table_size():
    """The counts docs/testing.md quotes for this file."""
    assert (len(PROFILE_CASES), len(HEARTBEAT_CASES), len(HOOK_CASES), len(OMP_CASES)) == (15, 4, 4, 4)
