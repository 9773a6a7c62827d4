"""``bytescale demo`` stops cleanly: bad input is refused by the launcher (exit 2, one line),
a signal to the demo alone stops torchrun and every worker, and a worker that stops answering
ends the job after the HDP group timeout with a message naming its rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bytescale.tools.demo_settings import DemoSettings

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--ffn-hidden-size", "64", "--bytescale-capacity", "64",
        "--micro-batches-per-rank", "2", "--ranks", "2"]


def demo(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_bytescale.cli", "demo", *argv],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def assert_refused(run: subprocess.CompletedProcess, match: str) -> None:
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "torchrun" not in run.stderr, run.stderr
    assert match in run.stderr, run.stderr


# ----------------------------------------------------------------------------- the launcher checks
def test_bad_input_is_refused_before_any_worker_starts(tmp_path):
    """One demo launch per case costs ~2 s (no torchrun); every case below used to start the
    workers and fail inside them, or print a traceback."""
    bad_jsonl = tmp_path / "numbers.jsonl"
    bad_jsonl.write_text('{"text": "a fine document"}\n{"text": 12345}\n{"text": null}\n')
    empty_cm = tmp_path / "cm.json"
    empty_cm.write_text("{}")
    binary_cm = tmp_path / "cm.bin"
    binary_cm.write_bytes(bytes(range(256)))
    out = ["--out", str(tmp_path / "out")]
    cases = [
        (["--out", "/proc/nope/x"], "--out /proc/nope/x: cannot create"),
        (["--data", ",", *out], "--data ',' names no dataset"),
        (["--data", str(bad_jsonl), *out], f"{bad_jsonl}:2: the 'text' field is a number"),
        (["--bytescale-cost-model", str(empty_cm), *out], "lacks the fields"),
        (["--bytescale-cost-model", str(binary_cm), *out], f"'{binary_cm}' is not text"),
        (["--data", str(tmp_path / "nope"), *out], "is neither a built-in dataset"),
    ]
    for argv, match in cases:
        assert_refused(demo(*TINY, "--steps", "1", *argv), match)


def test_jsonl_text_must_be_a_string(tmp_path):
    from megatron_bytescale.data.corpus import jsonl_documents

    path = tmp_path / "null.jsonl"
    path.write_text('{"text": null}\n')
    with pytest.raises(ValueError, match=":1: the 'text' field is null"):
        next(jsonl_documents(path))


def test_truncated_indexed_dataset_names_the_file(tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_bytescale.integration.indexed_tokens import indexed_documents

    prefix = tmp_path / "data"
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for n in (300, 900, 50):
        builder.add_document(torch.arange(n, dtype=torch.int32), [n])
    builder.finalize(str(prefix) + ".idx")
    assert sum(len(d) for d in indexed_documents(prefix, repeat=False)) == 1250
    data = (tmp_path / "data.bin").read_bytes()
    (tmp_path / "data.bin").write_bytes(data[:1000])
    with pytest.raises(ValueError, match=f"{prefix}.bin is truncated: 1000 bytes, its index "
                                         "describes 5000"):
        next(indexed_documents(prefix))


# ----------------------------------------------------------------------------- signals
def _processes_of(settings_path: Path) -> dict[int, str]:
    """pid -> command line of every process started for this demo run (torchrun, workers)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(settings_path) in cmdline:
            found[int(entry.name)] = cmdline
    return found


def _workers(settings_path: Path) -> dict[int, int]:
    """rank -> pid of the demo's workers."""
    ranks = {}
    for pid, cmdline in _processes_of(settings_path).items():
        if "demo_worker" not in cmdline or "torch.distributed.run" in cmdline:
            continue
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


def _start(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_bytescale.cli", "demo", *TINY, "--steps", "500",
         "--modes", "balance", "--out", str(out), *argv],
        stdout=open(tmp_path / "stdout", "w"), stderr=open(tmp_path / "stderr", "w"), env=env,
        cwd=REPO,
    )  # fmt: skip
    return proc, (out / "settings.json").resolve()


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _cleanup(settings: Path) -> None:
    for pid in _processes_of(settings):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.one_lane(reason="torchrun's and the launcher's signal handling, the same with any megatron-core")
@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGTERM, 128 + signal.SIGTERM, "stopped by SIGTERM"),
    (signal.SIGINT, 128 + signal.SIGINT, "interrupted (SIGINT)"),
])
def test_a_signal_to_the_demo_alone_stops_torchrun_and_every_worker(tmp_path, sig, code, said):
    proc, settings = _start(tmp_path)
    try:
        _wait_for(lambda: len(_workers(settings)) == 2 or proc.poll() is not None, 120,
                  "the workers to start")
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(2)
        before = len((tmp_path / "stderr").read_text())
        proc.send_signal(sig)
        assert proc.wait(timeout=90) == code
        _wait_for(lambda: not _processes_of(settings), 10, "torchrun and the workers to exit")
        err = (tmp_path / "stderr").read_text()
        assert f"bytescale demo: {said}" in err and "bytescale demo: \n" not in err, err[-3000:]
        # one clean line: the workers' and torchrun's tracebacks of the interrupted calls (5 of
        # them, 269 lines with two ranks) are not relayed once the signal arrived
        after = err[before:].strip().splitlines()
        assert after and after[-1].startswith(f"bytescale demo: {said}") and len(after) <= 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        proc.kill()
        _cleanup(settings)


@pytest.mark.one_lane(reason="torchrun's and the launcher's stopped-worker watchdog, the same with any megatron-core")
def test_a_stopped_worker_ends_the_job_naming_its_rank(tmp_path):
    from megatron_bytescale.planner.cost_model import CostModel

    cost_model = tmp_path / "cost_model.json"  # no calibration: no long wait before training
    CostModel(num_layers=1, alpha1=1e-9, beta1=1e-6, gamma=1e-4, alpha2=1e3, d2h_bandwidth=1e10,
              h2d_bandwidth=1e10, kv_bytes_per_token=64.0, p2p_bandwidth_intra=1e9,
              p2p_bandwidth_inter=1e9).save(cost_model)
    # 24 s: short, yet longer than the start-up skew of two workers on a loaded machine (the
    # timeout also bounds the rendezvous)
    proc, settings = _start(tmp_path, "--distributed-timeout-minutes", "0.4",
                            "--bytescale-cost-model", str(cost_model))
    stopped = None
    try:
        _wait_for(lambda: "[  1/" in (tmp_path / "stdout").read_text() or proc.poll() is not None,
                  180, "the first training step")
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        stopped = _workers(settings)[1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        assert proc.wait(timeout=150) != 0
        waited = time.monotonic() - start
        err = (tmp_path / "stderr").read_text()
        assert "bytescale demo: rank 1 did not answer within 24 s" in err, err[-4000:]
        assert err.count("did not answer") == 1  # said once, by the lowest live rank
        assert waited < 150, waited  # 24 s and torchrun's 30 s shutdown, not gloo's 30 minutes
    finally:
        if stopped is not None:
            for s in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(stopped, s)
                except ProcessLookupError:
                    pass
        proc.kill()
        _cleanup(settings)
