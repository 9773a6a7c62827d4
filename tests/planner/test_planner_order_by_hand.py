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


def test_without_durations_it_is_a_pure_deadlock_check():
    for pp in (1, 2):
        sim = simulate(_one_pipeline(pp))
        assert sim.rank_finish_s.tolist() == [0.0] and sim.node_times == {}  # nothing recorded


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
