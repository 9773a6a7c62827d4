"""`bytescale plan/simulate --seq-split`: the balance plan splits where it pays; refusals are one line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_bytescale.tools import plan_cmd, simulate_cmd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planner"))
from planner_cases import small_cost_model  # noqa: E402


@pytest.fixture()
def inputs(tmp_path):
    rng = np.random.default_rng(3)  # one batch whose long rings split (tests/planner/test_seq_split_plan.py)
    lengths = np.concatenate([rng.integers(10, 300, int(rng.integers(10, 40))),
                              rng.integers(600, 3000, int(rng.integers(1, 4)))])
    (tmp_path / "len.txt").write_text("\n".join(map(str, lengths.tolist())) + "\n")
    small_cost_model(num_layers=16).save(tmp_path / "cm.json")
    return [str(tmp_path / "len.txt"), "--cost-model", str(tmp_path / "cm.json"), "--hdp-size", "8",
            "--capacity", "512", "--pp-size", "4", "--quiet"]


def _column(out: str, row: str, name: str) -> str:
    lines = out.splitlines()
    header = next(l for l in lines if l.startswith(("scheduler", "context")))
    cols = [c for c in header.split("  ") if c.strip()]
    values = next(l for l in lines if l.split()[:2] == row.split()).split()
    return values[[c.strip() for c in cols].index(name)]


def test_plan_and_simulate_with_seq_split_are_faster_here(inputs, tmp_path, capsys):
    assert simulate_cmd.main(inputs + ["--variants", "static,balance"]) == 0
    before = float(_column(capsys.readouterr().out, "- balance", "step (s)"))
    assert simulate_cmd.main(inputs + ["--variants", "static,balance", "--seq-split"]) == 0
    out = capsys.readouterr().out
    assert "PP 4, sequence split (balance)" in out.splitlines()[0]
    after = float(_column(out, "- balance", "step (s)"))
    assert after < before
    assert float(_column(out, "- static", "step (s)")) == pytest.approx(0.18, abs=0.01)  # static unchanged
    out_json = tmp_path / "plan.json"
    assert plan_cmd.main(inputs + ["--no-offload", "--seq-split", "--json", str(out_json), "--validate"]) == 0
    from megatron_bytescale.planner.plan import StepPlan

    plan = StepPlan.from_json(out_json.read_text()).validate()
    assert any(mb.chunk for rp in plan.ranks for mb in rp.micro_batches)


@pytest.mark.parametrize("extra, needle", [
    (["--vpp-size", "2"], "--seq-split cannot apply with 2 virtual stages"),
    (["--pp-size", "1"], "--seq-split cannot apply with pipeline size 1"),
    (["--scheduler", "naive"], "--seq-split cannot apply with scheduler 'naive' (use balance)"),
])
def test_seq_split_refusals_are_one_line(inputs, extra, needle, capsys):
    assert plan_cmd.main(inputs + ["--seq-split"] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
