"""Deadlock check (D5) by simulation, and the event-driven estimate on hand-made plans."""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.estimate import estimate_plan
from megatron_bytescale.planner.order import check_deadlock_free, pipeline_ops, simulate
from megatron_bytescale.planner.plan import (
    PlanBuilder,
    PlanError,
    RankPlan,
    Sequence,
    StepPlan,
    build_ring_micro_batches,
)
from planner_cases import small_cost_model


def _raw_plan(per_rank: list[list[tuple[int, tuple[int, ...], int]]], lengths: dict[int, int],
              pp_size: int = 1) -> StepPlan:
    """A plan from explicit per-rank lists of (order, ring, seq); no validation (bad orders allowed)."""
    ranks = []
    for r, items in enumerate(per_rank):
        mbs = []
        for order, ring, seq in items:
            mbs.append(build_ring_micro_batches(order=order, ring=ring, seqs=[seq], lengths=lengths)[r])
        ranks.append(RankPlan(rank=r, micro_batches=tuple(mbs)))
    return StepPlan(hdp_size=len(per_rank), capacity=10**6, pp_size=pp_size, scheduler="hand",
                    sequences=tuple(Sequence(id=i, length=n) for i, n in lengths.items()),
                    ranks=tuple(ranks), layers_per_stage=1)


def test_pipeline_ops_1f1b():
    assert pipeline_ops(3, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert pipeline_ops(3, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert pipeline_ops(1, 4, 0) == [("F", 0), ("B", 0)]  # fewer micro-batches than stages
    assert pipeline_ops(0, 4, 0) == []


def test_rings_crossing_in_opposite_order_deadlock():
    # rank 0 runs ring A then ring B, rank 1 runs B then A: each waits for the other forever
    lengths = {0: 4, 1: 4}
    plan = _raw_plan([[(0, (0, 1), 0), (1, (0, 1), 1)], [(1, (0, 1), 1), (0, (0, 1), 0)]], lengths)
    with pytest.raises(PlanError, match=r"deadlock: ranks \[0, 1\].*rank 0 waits at order 0"):
        check_deadlock_free(plan)


def test_three_rank_cycle_deadlocks_and_names_only_stuck_ranks():
    # rings (0,1), (1,2), (2,0) in a cyclic order; rank 3 has a local micro-batch and finishes
    lengths = {0: 4, 1: 4, 2: 4, 3: 2}
    plan = _raw_plan([
        [(0, (0, 1), 0), (2, (2, 0), 2)],
        [(1, (1, 2), 1), (0, (0, 1), 0)],
        [(2, (2, 0), 2), (1, (1, 2), 1)],
        [(3, (3,), 3)],
    ], lengths)
    with pytest.raises(PlanError, match=r"ranks \[0, 1, 2\]"):
        check_deadlock_free(plan)


def test_pp_ring_at_different_local_indices_deadlocks():
    """Ring A at index 0 on both pipelines; ring B at index 1 on pipeline 0 but index 2 on
    pipeline 1 (behind a local micro-batch Z). With 2 stages, stage 0 of pipeline 0 runs
    F(A) F(B) B(A) ... while pipeline 1 runs F(A) F(Z) B(A) F(B): F(B) and B(A) cross."""
    lengths = {0: 4, 1: 4, 2: 4}
    per_rank = [[(0, (0, 1), 0), (2, (0, 1), 1)], [(0, (0, 1), 0), (1, (1,), 2), (2, (0, 1), 1)]]
    plan = _raw_plan(per_rank, lengths, pp_size=2)
    with pytest.raises(PlanError, match="deadlock"):
        check_deadlock_free(plan)
    with pytest.raises(PlanError, match="same local index"):
        plan.validate()
    # the same lists without pipelining run fine (orders ascend on every rank)
    check_deadlock_free(_raw_plan(per_rank, lengths, pp_size=1))


def test_pp_aligned_rings_with_different_counts_are_fine():
    lengths = {i: 4 for i in range(6)}
    b = PlanBuilder(hdp_size=3, capacity=100, lengths=lengths)
    b.add((0, 1), [0])
    b.add((2,), [1])
    b.add((2,), [2])
    b.add((0, 1, 2), [3])  # index 1 on ranks 0, 1 ... but index 2 on rank 2
    plan = b.build(scheduler="hand", pp_size=3)
    with pytest.raises(PlanError):
        plan.validate()
    b = PlanBuilder(hdp_size=3, capacity=100, lengths=lengths)
    b.add((0, 1), [0])
    b.add((2,), [1])
    b.add((0, 1, 2), [3])
    b.add((2,), [2])
    b.add((0,), [4])
    b.add((0,), [5])
    plan = b.build(scheduler="hand", pp_size=3).validate()
    check_deadlock_free(plan)


# --------------------------------------------------------------------------- estimate
def linear_model(**changes):
    """T(s) = 1e-3 * s per layer, free links: times are easy to compute by hand."""
    values = dict(num_layers=1, alpha1=0.0, beta1=1e-3, gamma=0.0, p2p_bandwidth_inter=1e30,
                  p2p_bandwidth_intra=1e30, p2p_latency_s=0.0)
    return small_cost_model(**{**values, **changes})


def test_estimate_ring_waits_for_all_members():
    # rank 0: local 1000 tokens (1 s); rank 1: local 3000 (3 s); then a ring (0, 1) of 4000 (2 s each)
    lengths = {0: 1000, 1: 3000, 2: 4000}
    b = PlanBuilder(hdp_size=3, capacity=10**6, lengths=lengths)
    b.add((0,), [0])
    b.add((1,), [1])
    b.add((0, 1), [2])
    plan = b.build(scheduler="hand")
    est = estimate_plan(plan, linear_model())
    assert est.rank_time_s == pytest.approx((5.0, 5.0, 0.0))
    assert est.step_time_s == pytest.approx(5.0)
    x = est.extra
    assert x["lower_bound_s"] == pytest.approx((1 + 3 + 2 * 2) / 3)
    assert x["balance_ratio"] == pytest.approx(5.0 / (8 / 3))
    assert x["num_rings"] == 1 and x["ring_size_histogram"] == {"1": 2, "2": 1}
    assert x["micro_batch_counts"] == [2, 2, 0]
    # 4000 tokens on 2 ranks: 4 parts of 1000, no padding; 1 layer, 1 hop, K+V (64 B) forward,
    # K+V and dK+dV (64 + 128 B) backward per token: 256 * 4000
    assert est.p2p_bytes == 1_024_000
    # the generic simulation agrees with the fast path
    sim = simulate(plan, {0: 1.0, 1: 3.0, 2: 2.0})
    assert list(sim.rank_finish_s) == pytest.approx([5.0, 5.0, 0.0])


def test_estimate_honours_barriers():
    lengths = {0: 1000, 1: 3000, 2: 1000}
    b = PlanBuilder(hdp_size=2, capacity=10**6, lengths=lengths)
    b.add((0,), [0])
    b.add((1,), [1])
    b.add((0,), [2])
    free = b.build(scheduler="hand")
    barrier = b.build(scheduler="hand", meta={"barrier_after_orders": [1]})
    assert estimate_plan(free, linear_model()).step_time_s == pytest.approx(3.0)
    # rank 0's second micro-batch waits for rank 1's 3 s one
    assert estimate_plan(barrier, linear_model()).rank_time_s == pytest.approx((4.0, 3.0))
    sim = simulate(barrier, {0: 1.0, 1: 3.0, 2: 1.0})
    assert list(sim.rank_finish_s) == pytest.approx([4.0, 3.0])


def test_estimate_pp_1f1b_makespan():
    """One pipeline, m equal micro-batches of stage time t: (m + p - 1) * t."""
    m, p = 5, 4
    lengths = {i: 1000 for i in range(m)}
    b = PlanBuilder(hdp_size=1, capacity=10**6, lengths=lengths)
    for i in range(m):
        b.add((0,), [i])
    plan = b.build(scheduler="hand", pp_size=p, layers_per_stage=1)
    est = estimate_plan(plan, linear_model(num_layers=p))
    assert est.step_time_s == pytest.approx((m + p - 1) * 1.0)
    assert est.extra["lower_bound_s"] == pytest.approx(m * 1.0)


def test_estimate_of_empty_plan():
    plan = PlanBuilder(hdp_size=3, capacity=10, lengths={}).build(scheduler="hand")
    est = estimate_plan(plan, linear_model())
    assert est.step_time_s == 0.0 and est.p2p_bytes == 0 and est.extra["num_micro_batches"] == 0
