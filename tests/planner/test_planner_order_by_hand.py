"""The execution-order simulation (``order.simulate``) timed by hand: 1F1B, durations, barriers."""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.order import simulate
from megatron_bytescale.planner.plan import PlanBuilder


def _one_pipeline(pp_size: int, meta=None):
    b = PlanBuilder(hdp_size=1, capacity=100, lengths={0: 4, 1: 4})
    b.add([0], [0])
    b.add([0], [1])
    return b.build(scheduler="hand", pp_size=pp_size, meta=meta)


def _two_pipelines(pp_size: int, meta=None):
    """Order 0 on rank 0, order 1 on rank 1 (a barrier between them cannot deadlock 1F1B)."""
    b = PlanBuilder(hdp_size=2, capacity=100, lengths={0: 4, 1: 4})
    b.add([0], [0])
    b.add([1], [1])
    return b.build(scheduler="hand", pp_size=pp_size, meta=meta)


def test_without_durations_it_is_a_pure_deadlock_check():
    for pp in (1, 2):
        sim = simulate(_one_pipeline(pp))
        assert sim.rank_finish_s.tolist() == [0.0] and sim.node_times == {}  # nothing recorded
        # with a barrier, PP runs the general dependency graph (the other walks have none)
        sim = simulate(_two_pipelines(pp, {"barrier_after_orders": [0]}))
        assert sim.rank_finish_s.tolist() == [0.0, 0.0] and sim.node_times == {}
    # an order missing from the durations weighs nothing there too: order 1 (3 s a stage: F 1,
    # B 2) starts at once, its barrier's order 0 being free
    fenced = _two_pipelines(2, {"barrier_after_orders": [0]})
    assert simulate(fenced, {1: 3.0}).rank_finish_s.tolist() == pytest.approx([0.0, 6.0])


def test_one_stage_runs_each_micro_batch_as_one_op_by_hand():
    """Without PP a micro-batch is one op of its whole time, recorded by order (not split into a
    forward and a backward, whose two products need not add up to it in floats)."""
    for record in (False, True):
        sim = simulate(_one_pipeline(1), {0: 0.1, 1: 0.7}, record=record)
        assert sim.rank_finish_s.tolist() == [0.1 + 0.7]  # exactly: one addition
    assert sim.node_times == {0: (0.0, 0.1), 1: (0.1, 0.1 + 0.7)}


def test_the_general_graph_by_hand_with_a_barrier_and_a_record():
    """PP 2 with a barrier after order 0 runs the general dependency graph. Order 0 (4 s a
    stage) on rank 0, order 1 (8 s) on rank 1, forward 1/4 of it: F = 1, 2; B = 3, 6. Order 1
    starts after the barrier, when order 0 is done on every stage:
      rank 0: s0 F0 [0,1]  s1 F0 [1,2]  s1 B0 [2,5]  s0 B0 [5,8]  (barrier at 8)
      rank 1: s0 F1 [8,10]  s1 F1 [10,12]  s1 B1 [12,18]  s0 B1 [18,24]"""
    fenced = _two_pipelines(2, {"barrier_after_orders": [0]})
    sim = simulate(fenced, {0: 4.0, 1: 8.0}, forward_fraction=0.25, record=True)
    expected = {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 1): (2, 5), (0, "B", 0): (5, 8),
        (1, "F", 0): (8, 10), (1, "F", 1): (10, 12), (1, "B", 1): (12, 18), (1, "B", 0): (18, 24),
    }
    ops = {k: v for k, v in sim.node_times.items() if k[0] != "barrier"}
    assert ops.keys() == expected.keys()
    for node, (start, end) in expected.items():
        assert ops[node] == pytest.approx((start, end)), node
    assert sim.rank_finish_s.tolist() == pytest.approx([8.0, 24.0])


def test_1f1b_on_two_stages_by_hand():
    """Micro-batches of 3 s and 6 s per stage, forward 1/3 of it: F = 1, 2; B = 2, 4.

    stage 0 runs F0 F1 B0 B1 (one warm-up forward), stage 1 runs F0 B0 F1 B1:
      s0 F0 [0,1]   s1 F0 [1,2]   s1 B0 [2,4]   s0 F1 [1,3]
      s1 F1 [4,6] (after its B0)   s0 B0 [4,6] (after s1's B0)
      s1 B1 [6,10]  s0 B1 [10,14]
    """
    sim = simulate(_one_pipeline(2), {0: 3.0, 1: 6.0}, forward_fraction=1 / 3, record=True)
    expected = {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 1): (2, 4), (1, "F", 0): (1, 3),
        (1, "F", 1): (4, 6), (0, "B", 0): (4, 6), (1, "B", 1): (6, 10), (1, "B", 0): (10, 14),
    }
    assert sim.node_times.keys() == expected.keys()
    for node, (start, end) in expected.items():
        assert sim.node_times[node] == pytest.approx((start, end)), node
    assert sim.rank_finish_s.tolist() == pytest.approx([14.0])


def test_barrier_with_pipelines_by_hand():
    """Two pipelines of 2 stages, one 3 s micro-batch each (F 1, B 2): alone each takes
    1 + 1 + 2 + 2 = 6 s. A barrier after order 0 makes rank 1's order 1 wait for all of it."""
    b = PlanBuilder(hdp_size=2, capacity=100, lengths={0: 4, 1: 4})
    b.add([0], [0])
    b.add([1], [1])
    free = b.build(scheduler="hand", pp_size=2)
    fenced = b.build(scheduler="hand", pp_size=2, meta={"barrier_after_orders": [0]})
    durations = {0: 3.0, 1: 3.0}
    assert simulate(free, durations).rank_finish_s.tolist() == pytest.approx([6.0, 6.0])
    assert simulate(fenced, durations).rank_finish_s.tolist() == pytest.approx([6.0, 12.0])
    # the same without PP: 3 s each, the barrier serialises them
    b1 = PlanBuilder(hdp_size=2, capacity=100, lengths={0: 4, 1: 4})
    b1.add([0], [0])
    b1.add([1], [1])
    plan = b1.build(scheduler="hand", meta={"barrier_after_orders": [0]})
    assert simulate(plan, durations).rank_finish_s.tolist() == pytest.approx([3.0, 6.0])
