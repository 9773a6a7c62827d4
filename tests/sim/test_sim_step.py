"""The simulator's step model against hand-computed timelines (exact), and its step-level terms."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.plan import PlanBuilder
from megatron_bytescale.sim import StepOverheads, simulate_step


def cost_model(**changes) -> CostModel:
    """Round numbers so every time below is hand-computable."""
    values = dict(
        name="hand", num_layers=2, alpha1=1e-3, beta1=1e-2, gamma=0.0, alpha2=1.0,
        d2h_bandwidth=1e9, h2d_bandwidth=1e9, kv_bytes_per_token=1.0, dkv_bytes_per_token=2.0,
        p2p_bandwidth_intra=1000.0, p2p_bandwidth_inter=100.0, p2p_latency_s=0.0,
        ranks_per_node=2, attention_forward_fraction=0.25, forward_fraction=1.0 / 3.0,
    )
    values.update(changes)
    return CostModel(**values)


def two_rank_plan(*, local: bool = True):
    """Ring (0, 1) carrying an 8-token sequence, then (optionally) a 4-token local pack on rank 0."""
    builder = PlanBuilder(hdp_size=2, capacity=8, lengths={0: 8, 1: 4})
    builder.add([0, 1], [0])
    if local:
        builder.add([0], [1])
    else:
        builder.lengths.pop(1)
    return builder.build(scheduler="hand", layers_per_stage=2)


def test_two_ranks_one_ring_exact():
    """Ring of 2, s = 8 (zigzag chunk 2, no padding: each member holds 4 tokens), 2 layers.

    Per layer and member: linear = beta1 * 4 = 0.04; attention = alpha1 * 64 / 2 = 0.032, of
    which one ring step's forward is 0.032 * 0.25 / 2 = 0.004 and backward 0.012. The forward
    KV block is 4 tokens * 1 byte / 1000 B/s = 0.004 s, the backward KV + dKV block 0.012 s:
    communication exactly equal to compute, fully hidden. So 2 * (0.04 + 0.032) = 0.144 s.
    Rank 0 then runs a local pack of 4: 2 * (0.04 + 0.016) = 0.112 s.
    Step terms: ZeRO-1 over 2 ranks of 1,000 parameters: (1/2) * 1000 * (4 + 2) bytes at the
    NVLink rate (both ranks on one node) = 3 s; the optimizer updates 500 parameters at 1 ms
    = 0.5 s; planning 0.25 s is waited for (no lookahead).
    """
    overheads = StepOverheads(params_per_rank=1000, optimizer_s_per_param=1e-3)
    r = simulate_step(two_rank_plan(), cost_model(), overheads=overheads, plan_s=0.25)
    assert r.rank_busy_s.tolist() == pytest.approx([0.256, 0.144], rel=1e-12)
    assert r.rank_finish_s.tolist() == pytest.approx([0.256, 0.144], rel=1e-12)
    assert r.micro_batch_phase_s == pytest.approx(0.256, rel=1e-12)
    assert r.grad_reduce_s == pytest.approx(3.0, rel=1e-12)
    assert r.optimizer_s == pytest.approx(0.5, rel=1e-12)
    assert r.data_wait_s == pytest.approx(0.25, rel=1e-12)
    assert r.step_time_s == pytest.approx(0.256 + 3.0 + 0.5 + 0.25, rel=1e-12)
    assert r.breakdown["compute"] == pytest.approx(2 * 0.144 + 0.112, rel=1e-12)
    assert r.breakdown["exposed_comm"] == pytest.approx(0.0, abs=1e-15)
    assert r.breakdown["idle"] == pytest.approx(2 * 0.256 - 0.4, rel=1e-12)
    assert r.breakdown["comm"] == pytest.approx(2 * 2 * (0.004 + 0.012), rel=1e-12)
    assert r.lower_bound_s == pytest.approx(0.2, rel=1e-12)
    assert r.tokens == 12 and r.num_gpus == 2
    assert r.tokens_per_s == pytest.approx(12 / r.step_time_s)
    assert r.ring_sizes == {1: 1, 2: 1} and r.micro_batch_counts == (2, 1)
    # the gradient reduction crosses the network when the ranks are on different nodes
    apart = simulate_step(two_rank_plan(), cost_model(ranks_per_node=1), overheads=overheads)
    assert apart.grad_reduce_s == pytest.approx(30.0, rel=1e-12)


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0, 3.0])
def test_overlap_hidden_below_compute_exposed_by_the_difference_above(factor):
    """Slowing the link by ``factor`` around the break-even point of the plan above: while
    communication is at most the ring step's compute it costs nothing; above it the step is
    longer by exactly (comm - compute) per ring step, forward and backward, per layer."""
    plan = two_rank_plan(local=False)
    base = simulate_step(plan, cost_model(p2p_bandwidth_intra=1e12)).micro_batch_phase_s
    assert base == pytest.approx(0.144, rel=1e-9)
    r = simulate_step(plan, cost_model(p2p_bandwidth_intra=1000.0 / factor))
    m_f, m_b = 0.004 * factor, 0.012 * factor
    exposed = 2 * (max(0.0, m_f - 0.004) + max(0.0, m_b - 0.012))  # 2 layers, D - 1 = 1 step
    assert r.micro_batch_phase_s == pytest.approx(0.144 + exposed, rel=1e-12)
    assert r.breakdown["exposed_comm"] == pytest.approx(2 * exposed, rel=1e-12, abs=1e-15)
    assert r.breakdown["compute"] == pytest.approx(2 * 0.144, rel=1e-12)
    if factor <= 1.0:
        assert r.micro_batch_phase_s == pytest.approx(base, rel=1e-12)


def test_pipeline_matches_a_hand_drawn_1f1b_timeline():
    """PP = 2. Pipeline 0 runs three micro-batches, pipeline 1 one; every micro-batch takes 3 s
    per stage (2 layers x gamma 1.5), forward 1 s and backward 2 s (forward fraction 1/3).

    Pipeline 0 (F/B of micro-batch i on stage s, [start, end]):
        s0: F0[0,1] F1[1,2] B0[4,6] F2[6,7] B1[7,9] B2[10,12]
        s1: F0[1,2] B0[2,4] F1[4,5] B1[5,7] F2[7,8] B2[8,10]
    so it ends at 12 = 3 x 3 s of work + (pp - 1) x (F + B) of bubble. Pipeline 1:
        s0: F0[0,1] B0[4,6];  s1: F0[1,2] B0[2,4]   -> 6.
    """
    cm = cost_model(alpha1=0.0, beta1=0.0, gamma=1.5, num_layers=4)
    builder = PlanBuilder(hdp_size=2, capacity=8, lengths={i: 4 for i in range(4)})
    for rank, seq in ((0, 0), (1, 3), (0, 1), (0, 2)):
        builder.add([rank], [seq])
    plan = builder.build(scheduler="hand", pp_size=2, layers_per_stage=2)
    r = simulate_step(plan, cm, tensor_parallel_size=4)
    assert r.rank_finish_s.tolist() == pytest.approx([12.0, 6.0], rel=1e-12)
    assert r.rank_busy_s.tolist() == pytest.approx([9.0, 3.0], rel=1e-12)
    assert r.micro_batch_phase_s == pytest.approx(12.0, rel=1e-12)
    # GPU-seconds over 2 pipelines x 2 stages: 24 of work, 48 - 24 idle (bubbles and the short pipeline)
    assert r.breakdown["compute"] == pytest.approx(24.0, rel=1e-12)
    assert r.breakdown["idle"] == pytest.approx(24.0, rel=1e-12)
    assert r.num_gpus == 2 * 2 * 4


def test_ring_waits_for_its_slowest_member():
    """Rank 1 first runs a 4-token pack (0.112 s), so the ring starts at 0.112 on both; rank 0
    idles until then."""
    builder = PlanBuilder(hdp_size=2, capacity=8, lengths={0: 8, 1: 4})
    builder.add([1], [1])
    builder.add([0, 1], [0])
    r = simulate_step(builder.build(scheduler="hand", layers_per_stage=2), cost_model())
    assert r.rank_finish_s.tolist() == pytest.approx([0.256, 0.256], rel=1e-12)
    assert r.rank_busy_s.tolist() == pytest.approx([0.144, 0.256], rel=1e-12)
    assert r.breakdown["idle"] == pytest.approx(0.112, rel=1e-12)


def test_lookahead_hides_planning_up_to_the_step():
    plan = two_rank_plan()
    cm = cost_model()
    short = simulate_step(plan, cm, plan_s=0.1, lookahead=True)
    assert short.data_wait_s == 0.0 and short.step_time_s == pytest.approx(0.256)
    long = simulate_step(plan, cm, plan_s=0.5, lookahead=True)
    assert long.data_wait_s == pytest.approx(0.5 - 0.256) and long.step_time_s == pytest.approx(0.5)
    fixed = simulate_step(plan, cm, plan_s=0.5, overheads=StepOverheads(plan_s=0.05, load_s=0.1))
    assert fixed.data_wait_s == pytest.approx(0.15) and fixed.plan_s == 0.05


def test_all_reduce_versus_zero1_volume():
    cm = cost_model(ranks_per_node=1, p2p_latency_s=1e-3)
    ar = StepOverheads(params_per_rank=1e6, distributed_optimizer=False, optimizer_s_per_param=1e-9)
    z1 = StepOverheads(params_per_rank=1e6, optimizer_s_per_param=1e-9)
    n = 8
    assert ar.grad_reduce_s(n, cm) == pytest.approx(2 * 7 / 8 * 1e6 * 4 / 100 + 14e-3)
    assert z1.grad_reduce_s(n, cm) == pytest.approx(7 / 8 * 1e6 * 6 / 100 + 14e-3)
    assert ar.optimizer_s(n) == pytest.approx(1e-3) and z1.optimizer_s(n) == pytest.approx(1e-3 / 8)
    assert ar.grad_reduce_s(1, cm) == 0.0


@pytest.mark.parametrize("field, value", [("params_per_rank", -1), ("load_s", float("nan")), ("plan_s", -0.5)])
def test_bad_overheads_are_named(field, value):
    with pytest.raises(ValueError, match=rf"{field} \({value!r}\) must be a finite number >= 0"):
        StepOverheads(**{field: value})


def test_ring_time_terms_sum_to_the_ring_time():
    cm = cost_model(ring_step_overhead_s=0.01, p2p_latency_s=1e-3, d2h_bandwidth=1.0, h2d_bandwidth=1.0)
    sp, sp2 = np.array([8.0, 64.0, 300.0]), np.array([64.0, 2048.0, 30000.0])
    d, r = np.array([1, 2, 5]), np.array([0.0, 0.5, 1.0])
    terms = cm.ring_time_terms(sp, sp2, d, layers=3, offload_ratio=r, intra_node=[True, True, False])
    total = cm.ring_time_from_sums(sp, sp2, d, layers=3, offload_ratio=r, intra_node=[True, True, False])
    assert np.allclose(terms.total, total, rtol=1e-14)
    assert terms.exposed_comm[0] == 0 and terms.step_overhead[0] == 0 and terms.comm[0] == 0
    assert terms.step_overhead[2] == pytest.approx(3 * 4 * 0.01)
    assert terms.exposed_offload[2] > 0  # 1 B/s of PCIe cannot hide a full offload


def test_simulator_imports_no_torch():
    code = ("import sys, megatron_bytescale.sim, megatron_bytescale.sim.plots\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'matplotlib')]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_fast_timeline_equals_the_dependency_graph_with_barriers():
    """The PP = 1 fast path of the estimate and :func:`order.simulate` time every rank alike,
    barriers (pow2) included: a rank with nothing after a barrier does not wait for it."""
    from megatron_bytescale.planner.estimate import simulate_plan
    from megatron_bytescale.planner.order import simulate
    from megatron_bytescale.planner.schedulers import make_plan

    cm = cost_model(alpha1=1e-6, beta1=1e-4, gamma=1e-4, ranks_per_node=4)
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(40):
        n, cap = int(rng.choice([2, 3, 4, 6, 8])), int(rng.integers(16, 96))
        lengths = [int(x) for x in rng.integers(1, cap * n, size=int(rng.integers(1, 20)))]
        for scheduler in ("pow2", "balance", "naive", "static"):
            try:
                plan = make_plan(lengths, scheduler=scheduler, hdp_size=n, capacity=cap, cost_model=cm,
                                 overlong="truncate")
            except ValueError:
                continue
            costs, fast = simulate_plan(plan, cm)
            graph = simulate(plan, dict(zip(costs.orders.tolist(), costs.seconds.tolist())))
            np.testing.assert_allclose(fast.rank_finish_s, graph.rank_finish_s, rtol=1e-12, atol=0)
            checked += 1
    assert checked > 100
