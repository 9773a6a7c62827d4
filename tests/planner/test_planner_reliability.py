"""Bad input to ``bytescale plan`` and the planner API: a clear error and exit 2, never a hang,
an unbounded read, a traceback or a silent acceptance (one test per defect found by probing)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_bytescale.data.lengths import LengthsFileError, read_lengths
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.offload import ring_size_without_offload
from megatron_bytescale.planner.presets import model_spec, preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.pow2 import pow2_ring_size
from megatron_bytescale.tools.plan_cmd import main

REPO = Path(__file__).resolve().parents[2]
HUGE = "99999999999999999999999"


def plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(capsys, argv, match):
    code, _, err = plan_cli(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bytescale plan: error:"), err
    assert match in lines[0], lines[0]


@pytest.fixture
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in np.random.default_rng(0).integers(100, 5000, 200)))
    return path


# ----------------------------------------------------------------------------- no endless loop
def test_align_above_capacity_is_refused_not_looped(capsys, lengths_file):
    start = time.perf_counter()
    assert_refused(capsys, [str(lengths_file), "--align", "1025", "--capacity", "1024",
                            "--hdp-size", "32"], "align (1025) must be <= capacity (1024)")
    assert time.perf_counter() - start < 30


def test_ring_size_searches_are_bounded():
    cm = preset_cost_model("llama-7b")
    for search in (lambda: ring_size_without_offload(5000, capacity=1024, cost_model=cm,
                                                     layers=32, align=1025),
                   lambda: pow2_ring_size(5000, 1024, 1025)):
        with pytest.raises(ValueError, match="fits no ring.*align \\(1025\\)"):
            search()
    # the bound is exact: just below it, the searches still find the ring
    assert ring_size_without_offload(5000, capacity=1024, cost_model=cm, layers=32, align=1024) == 5
    assert pow2_ring_size(5000, 1024, 1024) == 8


def test_the_background_planner_does_not_hang_on_that_config():
    import torch

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator

    class OneRank:
        rank, size, group, device = 0, 1, None, torch.device("cpu")

    def planner(lengths):
        return make_plan(lengths, scheduler="balance", hdp_size=32, capacity=1024, align=1025,
                         cost_model=preset_cost_model("llama-7b"))

    iterator = HDPDataIterator([[[1] * 3000, [2] * 10]], planner=planner, hdp=OneRank(),
                               plan_timeout_s=60)
    with pytest.raises(ValueError, match="align \\(1025\\) must be <= capacity"):
        next(iterator)
    iterator.close()


# ----------------------------------------------------------------------------- bounded reads
def test_an_endless_input_is_refused_quickly(capsys):
    start = time.perf_counter()
    assert_refused(capsys, ["/dev/zero"], "is a device; give a regular file")
    assert time.perf_counter() - start < 10


def test_an_oversized_lengths_file_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    from megatron_bytescale.data import lengths as lengths_module

    monkeypatch.setattr(lengths_module, "MAX_FILE_BYTES", 1000)
    path = tmp_path / "big.txt"
    path.write_text("4096\n" * 1000)
    with pytest.raises(LengthsFileError, match="larger than"):
        read_lengths(path)


# ----------------------------------------------------------------------------- exit 2, not a traceback
@pytest.mark.parametrize("content", [f"{HUGE}\n", f"[{HUGE}]"])
def test_an_absurd_length_is_an_error_naming_it(capsys, tmp_path, content):
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    assert_refused(capsys, [str(path)], f"length {HUGE} is longer than the 1099511627776")
    with pytest.raises(ValueError, match="at most 1099511627776"):
        make_plan([int(HUGE)], scheduler="balance", hdp_size=8, capacity=1024,
                  cost_model=preset_cost_model("llama-7b"))


def _write_index(prefix: Path, lengths: list[int]) -> bytes:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for n in lengths:
        builder.add_document(torch.zeros(n, dtype=torch.int32), [n])
    builder.finalize(str(prefix) + ".idx")
    return (prefix.parent / (prefix.name + ".idx")).read_bytes()


def test_a_truncated_index_is_an_error_naming_it(capsys, tmp_path):
    data = _write_index(tmp_path / "good", [300, 5000, 20])
    bad = tmp_path / "cut.idx"
    bad.write_bytes(data[:20])
    assert_refused(capsys, [str(bad)], f"'{bad}' is not a readable Megatron index file")


def test_a_negative_length_in_an_index_is_an_error_not_a_dropped_document(capsys, tmp_path):
    data = bytearray(_write_index(tmp_path / "good", [300, 5000, 20]))
    # header: 9 magic + 8 version + 1 dtype + 8 sequence count + 8 document count, then int32s
    data[34 + 4:34 + 8] = struct.pack("<i", -5)
    bad = tmp_path / "neg.idx"
    bad.write_bytes(bytes(data))
    assert_refused(capsys, [str(bad)], "sequence 1 has a negative length (-5)")


@pytest.mark.parametrize("edit, match", [
    (lambda d: {}, "lacks the fields ['num_layers', 'alpha1'"),
    (lambda d: {k: v for k, v in d.items() if k != "gamma"}, "lacks the fields ['gamma']"),
    (lambda d: dict(d, num_layers=True), "num_layers (True) must be an integer >= 1"),
    (lambda d: dict(d, alpha1=1e308), "alpha1 (1e+308) is out of range"),
    (lambda d: dict(d, p2p_bandwidth_inter=1e-300), "is out of range"),
])
def test_bad_cost_models_are_errors_naming_the_file_and_field(capsys, tmp_path, lengths_file,
                                                              edit, match):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(edit(preset_cost_model("llama-7b").to_dict())))
    assert_refused(capsys, [str(lengths_file), "--cost-model", str(path)], match)
    assert_refused(capsys, [str(lengths_file), "--cost-model", str(path)], f"'{path}'")


def test_a_binary_cost_model_names_the_file(capsys, tmp_path, lengths_file):
    path = tmp_path / "cm.bin"
    path.write_bytes(bytes(range(256)))
    assert_refused(capsys, [str(lengths_file), "--cost-model", str(path)],
                   f"cost model file '{path}' is not text")


# ----------------------------------------------------------------------------- no silent acceptance
def test_an_empty_lengths_file_is_an_error(capsys, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("# nothing here\n\n")
    assert_refused(capsys, [str(path)], "holds no sequences")


def test_pp_size_zero_is_refused(capsys, lengths_file):
    assert_refused(capsys, [str(lengths_file), "--pp-size", "0"], "argument --pp-size: 0 must be >= 1")


def test_a_tp_size_megatron_would_refuse_is_refused(capsys, lengths_file):
    assert_refused(capsys, [str(lengths_file), "--tensor-model-parallel-size", "3"],
                   "tensor_parallel_size (3) must divide the attention heads (32)")
    assert model_spec("llama-7b", tensor_parallel_size=16).tensor_parallel_size == 16  # 8 KV x2


# ----------------------------------------------------------------------------- right messages
def test_a_json_object_is_reported_as_json(capsys, tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text('{"lengths": [1, 2]}')
    assert_refused(capsys, [str(path)], "expected a JSON list of lengths")


def test_plot_reports_the_path_it_wrote(capsys, tmp_path, lengths_file):
    code, out, err = plan_cli(capsys, str(lengths_file), "--hdp-size", "8", "--capacity", "2048",
                              "--plot", str(tmp_path / "chart"))
    assert code == 0, err
    written = tmp_path / "chart.png"
    assert written.is_file() and f"wrote Gantt chart to {written}\n" in out


def test_cost_model_errors_in_the_python_api_are_value_errors():
    with pytest.raises(ValueError, match="lacks the fields"):
        CostModel.from_dict({"num_layers": 2})


def test_bytescale_plan_never_prints_a_traceback(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{HUGE}\n")
    run = subprocess.run([sys.executable, "-m", "megatron_bytescale.cli", "plan", str(bad)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr


def test_no_error_message_points_to_an_issue_or_a_later_version():
    """Refusals say what is unsupported and what to do, not "a later issue" / "not yet"."""
    import ast
    import re

    bad = re.compile(r"later issue|not yet|\byet\b|\bissue \d", re.I)
    found = []
    for path in sorted((REPO / "megatron_bytescale").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = " ".join(c.value for c in ast.walk(node.exc)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                if bad.search(text):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text[:80]}")
    assert not found, found


def test_ctrl_c_in_any_subcommand_is_one_line(monkeypatch, capsys):
    from megatron_bytescale import cli
    from megatron_bytescale.tools import plan_cmd

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cmd, "main", interrupted)
    assert cli.main(["plan"]) == 130
    assert capsys.readouterr().err == "bytescale plan: interrupted (SIGINT)\n"
