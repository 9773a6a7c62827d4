"""Lookahead in the step simulator, with gradient reduction and optimizer time in the step.

With lookahead the next step's data and plan are prepared on the CPU while this step trains,
so only the part of ``load_s + plan_s`` longer than the whole busy step (micro-batches,
gradient reduction, optimizer) is waited for; without it all of it is. Cases with zero
reduction and optimizer time cannot tell "hidden behind the micro-batches" from "hidden behind
the whole step", so every case here has both, each a sizeable part of the step, and plan
times placed on both sides of every boundary. The reduction and optimizer times are checked
against the formulas written out here (ZeRO-1 over the network; Adam on 1/N of the params).
"""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.sim.overheads import StepOverheads
from megatron_bytescale.sim.step import simulate_step

HDP = 8  # two nodes of 4: the reduction runs at the network rate
PARAMS = 2e6
OPT_S = 1e-7  # seconds per parameter


def toy_cost_model() -> CostModel:
    """Tens to thousands of tokens per rank; 4 ranks per node."""
    return CostModel(name="toy", num_layers=8, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0,
                     beta2=0.0, d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0,
                     dkv_bytes_per_token=128.0, p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8,
                     p2p_latency_s=1e-6, ranks_per_node=4)


@pytest.fixture(scope="module")
def setup():
    cm = toy_cost_model()
    lengths = [900, 700, 300, 250, 200, 120, 100, 80, 60, 40, 30, 20] * 2
    plan = make_plan(lengths, scheduler="balance", hdp_size=HDP, capacity=512, cost_model=cm)
    overheads = StepOverheads(params_per_rank=PARAMS, optimizer_s_per_param=OPT_S, load_s=0.0)
    base = simulate_step(plan, cm, overheads=overheads, plan_s=0.0, lookahead=False)
    return cm, plan, base


def test_reduction_and_optimizer_follow_their_formulas(setup):
    cm, _, base = setup
    share = (HDP - 1) / HDP
    reduce_s = share * PARAMS * (4.0 + 2.0) / cm.p2p_bandwidth_inter + 2 * (HDP - 1) * cm.p2p_latency_s
    assert base.grad_reduce_s == pytest.approx(reduce_s, rel=1e-12)
    assert base.optimizer_s == pytest.approx(PARAMS / HDP * OPT_S, rel=1e-12)
    assert base.micro_batch_phase_s > 0
    # both terms are a real part of the step, or the cases below could not tell them apart
    assert base.grad_reduce_s + base.optimizer_s > 0.2 * base.micro_batch_phase_s


@pytest.mark.parametrize("load_share", [0.0, 0.4])
@pytest.mark.parametrize("where", [0.5, 0.999, 1.001, 1.02, 1.5, 3.0])
def test_lookahead_hides_data_and_plan_behind_the_whole_busy_step(setup, where, load_share):
    """``where`` places load + plan as a point between the micro-batch phase (0) and the end of
    the busy step (1), and beyond it."""
    cm, plan, base = setup
    phase, tail = base.micro_batch_phase_s, base.grad_reduce_s + base.optimizer_s
    busy = phase + tail
    total = phase + where * tail if where <= 1 else where * busy
    load_s, plan_s = load_share * total, (1 - load_share) * total
    overheads = StepOverheads(params_per_rank=PARAMS, optimizer_s_per_param=OPT_S, load_s=load_s)
    ahead = simulate_step(plan, cm, overheads=overheads, plan_s=plan_s, lookahead=True)
    inline = simulate_step(plan, cm, overheads=overheads, plan_s=plan_s, lookahead=False)
    want_wait = max(0.0, load_s + plan_s - busy)
    assert ahead.data_wait_s == pytest.approx(want_wait, rel=1e-9, abs=1e-15)
    assert ahead.step_time_s == pytest.approx(busy + want_wait, rel=1e-9)
    assert inline.data_wait_s == pytest.approx(load_s + plan_s, rel=1e-9)
    assert inline.step_time_s == pytest.approx(busy + load_s + plan_s, rel=1e-9)
    # the rest of the step is the same with and without lookahead
    for field in ("micro_batch_phase_s", "grad_reduce_s", "optimizer_s"):
        assert getattr(ahead, field) == getattr(inline, field) == getattr(base, field)


def test_a_fixed_plan_time_in_the_overheads_wins_and_is_hidden_the_same_way(setup):
    cm, plan, base = setup
    busy = base.micro_batch_phase_s + base.grad_reduce_s + base.optimizer_s
    overheads = StepOverheads(params_per_rank=PARAMS, optimizer_s_per_param=OPT_S,
                              load_s=0.25 * busy, plan_s=busy)
    ahead = simulate_step(plan, cm, overheads=overheads, plan_s=123.0, lookahead=True)
    assert ahead.plan_s == busy
    assert ahead.data_wait_s == pytest.approx(0.25 * busy, rel=1e-9)
