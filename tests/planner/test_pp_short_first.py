"""PP-Balance's short-first variant, by hand: which micro-batch each pipeline starts with.

``short_first`` moves every pipeline's shortest single-rank micro-batch to the front (for a
pipeline in a ring: the shortest one after its last ring), so that 1F1B's later stages start
sooner, and gives up (None) when some ring member has no single-rank micro-batch after its last
ring (moving one from before would change the ring's local index on that member only).
"""

from __future__ import annotations

from megatron_bytescale.planner.schedulers._common import Placement
from megatron_bytescale.planner.schedulers.pp_balance import short_first
from megatron_bytescale.planner.sharding import Unit


def _case(rows):
    """rows: (ring, time) in plan order; sequence k is row k."""
    placements = [Placement(ring=ring, seqs=(k,)) for k, (ring, _) in enumerate(rows)]
    units = [Unit(seqs=(k,), lengths=(100,), ring_size=len(ring), time=t) for k, (ring, t) in enumerate(rows)]
    return placements, units


def test_each_pipeline_starts_with_its_shortest_micro_batch_after_its_last_ring():
    rows = [((4,), 1.0),     # 0  rank 4 has no ring: its shortest anywhere (first in the plan)
            ((0, 1), 9.0),   # 1  ring of ranks 0 and 1
            ((0,), 5.0),     # 2
            ((1,), 3.0),     # 3  rank 1's shortest (tied with 10: the earlier one)
            ((0,), 2.0),     # 4  rank 0's shortest (tied with 11: the earlier one)
            ((2,), 0.5),     # 5  shorter, but before rank 2's ring: not movable
            ((2, 3), 9.0),   # 6  ring of ranks 2 and 3
            ((2,), 7.0),     # 7  rank 2's only one after its ring
            ((3,), 1.0),     # 8  rank 3's shortest (tied with 9: the earlier one)
            ((3,), 1.0),     # 9
            ((1,), 3.0),     # 10
            ((0,), 2.0),     # 11
            ((4,), 9.0)]     # 12
    placements, units = _case(rows)
    moved = short_first(placements, units)
    assert [p.seqs[0] for p in moved] == [0, 3, 4, 7, 8, 1, 2, 5, 6, 9, 10, 11, 12]


def test_when_every_pipeline_is_in_a_ring():
    placements, units = _case([((0, 1), 9.0), ((0,), 2.0), ((1,), 1.0), ((1,), 0.5)])
    assert [p.seqs[0] for p in short_first(placements, units)] == [1, 3, 0, 2]


def test_a_ring_member_without_a_micro_batch_after_its_ring_gives_up():
    placements, units = _case([((0,), 1.0), ((0, 1), 9.0), ((1,), 1.0)])
    assert short_first(placements, units) is None


def test_without_rings_there_is_nothing_to_move_ahead_of():
    placements, units = _case([((0,), 2.0), ((1,), 1.0), ((0,), 1.0)])
    assert short_first(placements, units) is None
