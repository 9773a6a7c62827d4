"""``bytescale profile`` end to end on CPU: two gloo ranks measure a small megatron-core GPT, write
a cost model, and ``bytescale plan --cost-model`` plans with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_bytescale.planner.cost_model import CostModel

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "256"]


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "megatron_bytescale.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_profile_writes_a_cost_model_that_plan_reads(tmp_path):
    out, report = tmp_path / "cm.json", tmp_path / "report.json"
    done = _run(["profile", *MODEL, "--lengths", "32,64,128,256", "--repeats", "1",
                 "--nproc-per-node", "2", "--out", str(out), "--report", str(report)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cm = CostModel.load(out)
    assert cm.num_layers == 2 and cm.name == "profiled-cpu"
    assert cm.alpha2 > 0 and cm.d2h_bandwidth > 0 and cm.p2p_latency_s > 0  # measured over 2 ranks
    data = json.loads(report.read_text())
    assert [n for n, _ in data["samples"]["time"]] == [32, 64, 128, 256]
    assert data["samples"]["hdp_size"] == 2
    assert "R^2" in done.stdout and "cost model:" in done.stdout
    assert "4/4 lengths" in done.stderr  # the progress display
    plan = _run(["plan", "--cost-model", str(out), "--synthetic", "byted", "--global-tokens", "20000",
                 "--hdp-size", "4", "--capacity", "256", "--context-length", "1024", "--quiet"])
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "profiled-cpu" in plan.stdout


@pytest.mark.parametrize("bad, message", [
    (["--lengths", "32,64"], "at least 3 distinct lengths"),
    (["--lengths", "32,x,64"], "comma-separated integers"),
    (["--lengths", "32,64,4096"], "--max-position-embeddings"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_input_is_refused_before_any_process_starts(bad, message):
    done = _run(["profile", *MODEL, *bad], timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_profile_measures_a_moe_layer_and_its_all_to_all(tmp_path):
    """--num-experts builds megatron-core's MoE layer (timed in T(s)); --expert-model-parallel-size
    2 times the all-to-all over the two ranks and fits the dispatch terms into the cost model."""
    out, report = tmp_path / "cm.json", tmp_path / "report.json"
    done = _run(["profile", *MODEL, "--lengths", "32,64,128", "--repeats", "1", "--nproc-per-node", "2",
                 "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                 "--out", str(out), "--report", str(report)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2-layer MoE (4 experts, top-2, EP 2) GPT on 2 HDP rank(s)" in done.stderr
    cm = CostModel.load(out)
    assert cm.expert_parallel_size == 2
    assert cm.moe_a2a_bytes_per_token == 4 * 2 * 32 * 4 * (2 - 1) / 2  # 4 all-to-alls, top-2, h 32, fp32
    assert cm.moe_dispatch_s_per_token + cm.moe_dispatch_s > 0
    data = json.loads(report.read_text())
    assert [n for n, _ in data["samples"]["moe_all_to_all"]] == [256, 512, 1024, 2048, 4096]
    assert all(t > 0 for _, t in data["samples"]["moe_all_to_all"])
    assert "MoE all-to-all over 2 ranks" in done.stdout


@pytest.mark.parametrize("bad, message", [
    (["--expert-model-parallel-size", "2"], "needs a MoE model: give --num-experts"),
    (["--num-experts", "4", "--expert-model-parallel-size", "3"], "must divide --num-experts (4)"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk (5) must be from 1 to"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--nproc-per-node", "2"],
     "must divide the 2 HDP ranks"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size (2) needs a MoE model"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size (0) must be >= 1"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "3"],
     "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 = 3 and --tensor-model-parallel-size 2 "
     "do not divide one another"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2",
      "--nproc-per-node", "2"], "= 4 GPUs of an expert group must divide the 2 processes"),
])
def test_bad_moe_flags_are_refused_before_any_process_starts(bad, message):
    done = _run(["profile", *MODEL, *bad], timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_profile_times_the_all_to_all_inside_a_tp_group_with_etp_1(tmp_path):
    """TP 2 x ETP 1 x EP 2 on 2 processes (one HDP rank): the EP group is the two TP ranks (one
    GPU apart, not in one HDP group), which the all-to-all is timed over; an expert group inside
    a TP group needs no slot rule, so the cost model plans with ep_size 1."""
    out, report = tmp_path / "cm.json", tmp_path / "report.json"
    done = _run(["profile", *MODEL, "--lengths", "32,64,128", "--repeats", "1", "--nproc-per-node", "2",
                 "--tensor-model-parallel-size", "2", "--num-experts", "4", "--moe-router-topk", "2",
                 "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                 "--out", str(out), "--report", str(report)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2-layer MoE (4 experts, top-2, EP 2, ETP 1) GPT on 1 HDP rank(s)" in done.stderr
    cm = CostModel.load(out)
    assert (cm.expert_parallel_size, cm.expert_lockstep_size, cm.plan_ep_size) == (2, 1, 1)
    assert cm.moe_a2a_bytes_per_token == 4 * 2 * 32 * 4 * (2 - 1) / 2 / 2  # a rank sends its s / TP
    data = json.loads(report.read_text())
    assert (data["samples"]["expert_tensor_parallel_size"], data["samples"]["expert_lockstep_size"]) == (1, 1)
    assert all(t > 0 for _, t in data["samples"]["moe_all_to_all"])
    assert "MoE all-to-all over 2 ranks (1 GPU(s) apart)" in done.stdout
