"""A schedule made by another system (per group, per rank, sequence ids in run order) becomes a
StepPlan costed like ByteScale's own: rings, orders and barriers checked by hand."""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.estimate import estimate_plan
from megatron_bytescale.planner.schedulers.external import plan_from_rank_schedules
from planner_cases import small_cost_model


def _runs(plan):
    """rank -> [(order, ring, seqs)] as the plan lists them."""
    return {r.rank: [(mb.order, mb.ring, mb.seqs) for mb in r.micro_batches] for r in plan.ranks}


def test_rings_orders_and_barriers_by_hand():
    # 4 ranks, capacity 100. Group 0: seq 0 (300 tokens) on ranks 0-3 as a ring of 4.
    # Group 1: seq 1 (150) on ranks 0,1 then seq 4 (10) on rank 0; seq 2 (90) on rank 2;
    # seq 3 (80) on rank 3 then seq 5 (5) on rank 3.
    lengths = [300, 150, 90, 80, 10, 5]
    groups = [[[0], [0], [0], [0]],
              [[1, 4], [1], [2], [3, 5]]]
    plan = plan_from_rank_schedules(lengths, groups, scheduler="external", hdp_size=4,
                                    capacity=100, cost_model=small_cost_model())
    plan.validate()
    runs = _runs(plan)
    assert runs[0] == [(0, (0, 1, 2, 3), (0,)), (1, (0, 1), (1,)), (2, (0,), (4,))]
    assert runs[1] == [(0, (0, 1, 2, 3), (0,)), (1, (0, 1), (1,))]
    assert runs[2] == [(0, (0, 1, 2, 3), (0,)), (3, (2,), (2,))]
    assert runs[3] == [(0, (0, 1, 2, 3), (0,)), (4, (3,), (3,)), (5, (3,), (5,))]
    assert plan.meta["barrier_after_orders"] == [0]  # after group 0; none after the last
    assert plan.meta["num_groups"] == 2
    assert plan.scheduler == "external"
    # every sequence once, all its tokens: the ring of 4 holds 300 tokens in 4 zigzag shares
    assert sum(p.num_tokens for r in plan.ranks for mb in r.micro_batches if mb.seqs == (0,)
               for p in mb.pieces) == 300
    # the estimate is the estimator's on the same plan (the barrier included)
    again = estimate_plan(plan, small_cost_model())
    assert plan.estimate.step_time_s == pytest.approx(again.step_time_s)
    assert plan.estimate.extra["num_barriers"] == 1


def test_a_barrier_makes_the_step_longer_than_without_it():
    lengths = [100, 100, 100, 100]
    cost = small_cost_model()
    # group 0: rank 0 runs two, rank 1 one; group 1: rank 1 runs one more
    split = plan_from_rank_schedules(lengths, [[[0, 1], [2]], [[], [3]]], scheduler="x",
                                     hdp_size=2, capacity=100, cost_model=cost)
    one = plan_from_rank_schedules(lengths, [[[0, 1], [2, 3]]], scheduler="x", hdp_size=2,
                                   capacity=100, cost_model=cost)
    t = one.estimate.rank_time_s[0] / 2  # one sequence of 100 tokens on one rank
    assert one.estimate.step_time_s == pytest.approx(2 * t)
    assert split.estimate.step_time_s == pytest.approx(3 * t)  # rank 1 waits for rank 0


def test_the_order_follows_every_rank_when_ranks_list_rings_in_different_places():
    # rank 0: a then ring b; rank 1: ring b then c. b must come after a and before c.
    plan = plan_from_rank_schedules([50, 150, 50], [[[0, 1], [1, 2]]], scheduler="x",
                                    hdp_size=2, capacity=100, cost_model=small_cost_model())
    plan.validate()
    order = {mb.seqs[0]: mb.order for r in plan.ranks for mb in r.micro_batches}
    assert order[0] < order[1] < order[2]


@pytest.mark.parametrize("groups, message", [
    ([[[0, 1], [1, 0]]], r"contradict each other for sequences \[0, 1\]"),
    ([[[0], [1]], [[0], []]], "sequence 0 runs in two groups"),
    ([[[0], []]], r"1 sequence\(s\) never run \(ids \[1\]\)"),
    ([[[0, 0], [1]]], "rank 0 lists a sequence twice"),
    ([[[0], [1], [2]]], "group 0 lists 3 ranks; there are 2 HDP ranks"),
    ([[[0], [7]]], "rank 1 runs unknown sequence 7"),
])
def test_schedules_that_lose_repeat_or_deadlock_are_refused(groups, message):
    with pytest.raises(ValueError, match=message):
        plan_from_rank_schedules([10, 20], groups, scheduler="x", hdp_size=2, capacity=100,
                                 cost_model=small_cost_model())
