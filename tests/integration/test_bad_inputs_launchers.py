"""Bad input to the launchers (``bytescale demo``, ``bytescale profile``) and to the datasets
they read (Megatron ``.idx``/``.bin``, jsonl corpora), as one table: each row once ended as a
traceback in every worker, a hang, unbounded memory, training on garbage or a message that
named nothing; now the launcher refuses it in one line before any worker starts.

Everything runs in-process: ``main(argv)`` with the worker launch replaced by a failure, so a
row that slipped through would fail instead of starting torchrun (docs/testing.md, "Bad input").
"""

from __future__ import annotations

import gc
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_bytescale.tools import demo_cmd, profile_cmd

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--ffn-hidden-size", "64", "--bytescale-capacity", "64",
        "--micro-batches-per-rank", "2", "--ranks", "2", "--steps", "1", "--no-plot"]
LENGTHS_OFFSET = 34  # .idx: header 9, version 8, dtype code 1, sequence count 8, document count 8


def _indexed(prefix: Path, docs: list[np.ndarray]) -> Path:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc.astype(np.int32)), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return prefix


def _patch_idx(prefix: Path, offset: int, data: bytes) -> None:
    path = Path(str(prefix) + ".idx")
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _datasets(tmp: Path) -> dict[str, str]:
    """Every file a row names, by key."""
    good = [np.arange(300) % 256, np.arange(500) % 256, np.arange(200) % 256]
    made = {}
    made["negative"] = _indexed(tmp / "negative", [np.array([5, -3, 7] * 50), *good])
    made["huge_id"] = _indexed(tmp / "huge_id", [np.array([5, 2**31 - 1] * 100), *good])
    n = len(good)
    pointers = LENGTHS_OFFSET + 4 * n  # the int64 sequence pointers follow the int32 lengths
    made["dtype"] = _indexed(tmp / "dtype", good)
    _patch_idx(made["dtype"], 17, bytes([8]))  # int32 (code 4) -> uint16 (code 8)
    made["overlap"] = _indexed(tmp / "overlap", good)
    _patch_idx(made["overlap"], pointers + 8, struct.pack("<q", 1000))  # sequence 1 starts inside 0
    made["pointer"] = _indexed(tmp / "pointer", good)
    _patch_idx(made["pointer"], pointers + 8, struct.pack("<q", -8))
    made["empty_bin"] = _indexed(tmp / "empty_bin", good)
    Path(str(made["empty_bin"]) + ".bin").write_bytes(b"")
    (tmp / "binary.jsonl").write_bytes(b'{"text": "ok"}\n' + bytes(range(128, 256)) + b"\n")
    (tmp / "nested.jsonl").write_text('{"text": ' + "[" * 5000 + "]" * 5000 + "}\n")
    os.mkfifo(tmp / "fifo.jsonl")
    return {k: str(v) for k, v in made.items()} | {
        "binary.jsonl": str(tmp / "binary.jsonl"), "nested.jsonl": str(tmp / "nested.jsonl"),
        "fifo.jsonl": str(tmp / "fifo.jsonl"), "out": str(tmp / "out"),
    }


# (case id, argv with {key} placeholders, fragment of the error line)
DEMO_CASES = [
    # tracebacks in every worker
    ("align-1e9", ["--bytescale-align", "1000000000"], "--bytescale-align (1000000000)"),
    ("lr-nan", ["--lr", "nan"], "--lr (nan) must be a finite number > 0"),
    ("lr-negative", ["--lr", "-1"], "--lr (-1.0) must be a finite number > 0"),
    ("capacity-1", ["--bytescale-capacity", "1"], "--bytescale-capacity (1) must be at least 32"),
    ("timeout-1e300", ["--distributed-timeout-minutes", "1e300"],
     "--distributed-timeout-minutes (1e+300) must be > 0 and at most 10080"),
    ("index-negative-token-id", ["--data", "{negative}"], "sequence 0 holds the negative token id -3"),
    ("index-token-id-2^31-1", ["--data", "{huge_id}"], "token id 2,147,483,647 is beyond the 262,144 embedding rows"),
    ("index-empty-bin", ["--data", "{empty_bin}"], "empty_bin.bin is truncated: 0 bytes, its index describes 4000"),
    # a hang: open() of a FIFO waits for a writer
    ("jsonl-fifo", ["--data", "{fifo.jsonl}"], "is a FIFO (named pipe); give a regular file"),
    ("cost-model-fifo", ["--bytescale-cost-model", "{fifo.jsonl}"], "is a FIFO (named pipe); give a regular file"),
    # unbounded memory in the launcher
    ("micro-batches-1e8", ["--micro-batches-per-rank", "100000000"],
     "= 12,800,000,000 tokens: more than the 16,777,216 a CPU demo holds"),
    # silent accepts
    ("index-dtype-code-changed", ["--data", "{dtype}"],
     "sequence 1 starts at byte 1200 of the .bin, but with 2-byte uint16 tokens the sequences before it end at byte 600"),
    ("index-overlapping-pointer", ["--data", "{overlap}"],
     "sequence 1 starts at byte 1000 of the .bin, but with 4-byte int32 tokens the sequences before it end at byte 1200"),
    ("out-empty", ["--out", ""], "--out is empty"),
    # messages that named nothing
    ("seed-negative", ["--seed", "-1"], "--seed (-1) must be from 0 to 4294967295"),
    ("index-corrupt-pointer", ["--data", "{pointer}"], "sequence 1 starts at byte -8 of the .bin"),
    ("jsonl-binary", ["--data", "{binary.jsonl}"], "binary.jsonl:2: not UTF-8 text (byte 0 of the line)"),
    ("jsonl-nested", ["--data", "{nested.jsonl}"], "nested.jsonl:1 is not valid JSON here: it nests 5,001 levels"),
]


@pytest.fixture
def no_workers(monkeypatch):
    """A row that is not refused would reach the launch: fail there instead of starting torchrun."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("the launcher got past its checks and would start workers")

    monkeypatch.setattr(demo_cmd, "run_demo_job", refuse)
    monkeypatch.setattr(profile_cmd, "launch", refuse)
    monkeypatch.setattr(profile_cmd, "run_worker", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _datasets(tmp_path_factory.mktemp("bad_inputs"))


@pytest.mark.parametrize("case, argv, fragment", DEMO_CASES, ids=[c[0] for c in DEMO_CASES])
def test_demo_refuses_bad_input_in_one_line(files, no_workers, capsys, monkeypatch, case, argv, fragment):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    args = [files[a[1:-1]] if a.startswith("{") else a for a in argv]
    if "--out" not in args:
        args += ["--out", files["out"]]
    code = demo_cmd.main([*TINY, *args])  # a flag given twice: the last one counts
    if case.startswith("index-"):
        gc.collect()  # a half-built megatron-core dataset would complain here
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("bytescale demo: error:"), err
    assert fragment in lines[0], lines[0]
    assert not unraisable, [str(u.exc_value) for u in unraisable]  # megatron-core's "Exception ignored in __del__"


PROFILE_CASES = [
    ("num-layers-0", ["--num-layers", "0"], "--num-layers (0) must be >= 1"),
    ("vocab-size-0", ["--vocab-size", "0"], "--vocab-size (0) must be >= 1"),
    ("tp-3-heads", ["--tensor-model-parallel-size", "3", "--nproc-per-node", "2"],
     "--num-attention-heads (8) and --num-query-groups (8) must divide by --tensor-model-parallel-size (3)"),
    ("tp-3-two-processes", ["--tensor-model-parallel-size", "3", "--nproc-per-node", "2",
                            "--num-attention-heads", "6", "--hidden-size", "132"],
     "--tensor-model-parallel-size (3) must divide the 2 processes"),
    ("nproc-negative", ["--nproc-per-node", "-1"], "--nproc-per-node (-1) must be from 1 to 1024"),
    ("nproc-0", ["--nproc-per-node", "0"], "--nproc-per-node (0) must be from 1 to 1024"),  # was: silently 2
    ("omp-threads-env", [], "OMP_NUM_THREADS='abc' must be a number of threads >= 1"),  # each rank: int('abc')
]


@pytest.mark.parametrize("case, argv, fragment", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_profile_refuses_bad_flags_before_launching(no_workers, capsys, monkeypatch, case, argv, fragment):
    if case == "omp-threads-env":
        monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    with pytest.raises(SystemExit) as info:
        profile_cmd.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.strip().splitlines()[-1] == f"bytescale profile: error: {fragment}" or fragment in err, err
    assert "Traceback" not in err


def test_demo_settings_check_align_against_the_default_capacity():
    """Without --bytescale-capacity the flag check above cannot see the conflict; the demo's
    own settings (checked in the launcher) do."""
    from megatron_bytescale.tools.demo_settings import DemoSettings

    with pytest.raises(ValueError, match=r"--bytescale-align \(1000000000\) must be from 1 to --bytescale-capacity \(512\)"):
        DemoSettings(align=10**9)


def test_demo_results_are_printed_when_the_output_directory_fails(tmp_path, capsys, monkeypatch):
    """The launcher writes --out after every worker is done; a failure there loses nothing."""
    results = {"settings": {}, "calibration": {"cost_model": {"name": "c"}}, "datasets": {}}

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    assert not demo_cmd.save_results(results, tmp_path)
    out, err = capsys.readouterr()
    assert json.loads(out[:out.index("}\n{") + 2]) == results
    assert f"could not write the results JSON to '{tmp_path / 'results.json'}' (No space left on device)" in err
    assert f"could not write the cost model JSON to '{tmp_path / 'cost_model.json'}'" in err
    assert list(tmp_path.iterdir()) == []


def test_a_worker_that_cannot_hand_over_prints_the_results(tmp_path, capsys, monkeypatch):
    """Rank 0 writes after the last collective; if even the hand-over file fails, the results
    go to stdout and the rank says where they could not go (no traceback)."""
    from megatron_bytescale.tools.demo_process import RESULTS_ENV
    from megatron_bytescale.tools.demo_settings import DemoSettings
    from megatron_bytescale.tools.demo_worker import hand_over_results

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(RESULTS_ENV, str(blocker / "results.json"))
    results = {"calibration": {"cost_model": {"name": "c"}}, "datasets": {"d": {}}}
    assert not hand_over_results(results, DemoSettings(out_dir=str(tmp_path / "out")))
    out, err = capsys.readouterr()
    assert json.loads(out) == results
    assert f"could not write the results JSON to '{blocker / 'results.json'}'" in err


def test_table_size():
    """The counts docs/testing.md quotes for this file."""
    assert (len(DEMO_CASES), len(PROFILE_CASES)) == (18, 7)
