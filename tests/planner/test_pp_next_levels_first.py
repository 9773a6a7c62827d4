"""PP-Balance's next-levels-first variant, by hand, and as a candidate of ``balance``.

``next_levels_first(placements, lead)`` moves every pipeline's micro-batches at local positions
``1 .. lead`` before the one at position 0, shortest level (position ``lead``) first, so their
backwards fill the 1F1B window of the longest micro-batch (``planner.pipeline_floor.idle_floor``),
and gives up (None) when a ring would land at different local indices on its members.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.pipeline_floor import idle_floor, simulate_schedule
from megatron_bytescale.planner.presets import toy_cost_model
from megatron_bytescale.planner.schedulers import balance as balance_module
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers._common import Placement
from megatron_bytescale.planner.schedulers.pp_balance import local_indices, next_levels_first
from planner_cases import lists_by_rank


def _placements(rings):
    """Sequence k is row k."""
    return [Placement(ring=ring, seqs=(k,)) for k, ring in enumerate(rings)]


def test_positions_one_to_lead_go_first_shortest_level_first_and_rings_stay_aligned():
    rings = [(0, 1, 2),  # 0  position 0 everywhere: the widest ring
             (0, 1),     # 1  position 1
             (2,),       # 2  position 1
             (0,),       # 3  position 2
             (1,),       # 4
             (2,),       # 5
             (0, 1, 2),  # 6  position 3: stays
             (2,),       # 7  position 4: stays
             (3,),       # 8  rank 3, no ring, two micro-batches: position 1 before 0
             (3,)]       # 9
    lifted = next_levels_first(_placements(rings), 2)
    assert lists_by_rank(lifted) == {0: [3, 1, 0, 6], 1: [4, 1, 0, 6], 2: [5, 2, 0, 6, 7], 3: [9, 8]}
    # rings at one local index on all their members, as before
    for p in lifted:
        if len(p.ring) > 1:
            assert len({lists_by_rank(lifted)[r].index(p.seqs[0]) for r in p.ring}) == 1


def test_a_ring_that_would_split_gives_up():
    # rank 0 has three micro-batches, rank 1 two: the ring at position 1 would go to index 1 on
    # rank 0 (after position 2) and to index 0 on rank 1
    rings = [(0,), (1,), (0, 1), (0,)]
    assert next_levels_first(_placements(rings), 2) is None
    assert lists_by_rank(next_levels_first(_placements(rings), 1)) == {0: [2, 0, 3], 1: [2, 1]}


def test_nothing_to_move_unaligned_input_or_no_lead_gives_up():
    assert next_levels_first(_placements([(0,), (1,), (2, 3)]), 3) is None  # one micro-batch each
    assert next_levels_first(_placements([(0,), (0, 1), (1,)]), 1) is None  # ring not aligned
    assert next_levels_first(_placements([(0,), (0,)]), 0) is None
    assert next_levels_first([], 2) is None


def test_two_micro_batches_swap_at_lead_one():
    assert lists_by_rank(next_levels_first(_placements([(0,), (1,), (0,), (1,)]), 1)) == {0: [2, 0], 1: [3, 1]}
    assert lists_by_rank(next_levels_first(_placements([(0, 1), (0, 1)]), 1)) == {0: [1, 0], 1: [1, 0]}


def test_local_indices_count_what_each_rings_members_ran_before_it():
    assert local_indices(_placements([(0, 1), (0,), (2,), (1, 2), (0, 1, 2)])) == [0, 1, 0, 1, 2]
    assert local_indices(_placements([(0,), (0, 1)])) is None  # rank 0 at 1, rank 1 at 0
    assert local_indices(_placements([(1,), (0, 1)])) is None  # the first member agrees, not the rest
    assert local_indices([]) == []
    assert local_indices(_placements([(5,), (3,), (3, 5), (5, 3)])) == [0, 0, 1, 2]  # members in any order


def test_local_indices_agree_with_counting_slot_by_slot():
    """Seeded random lists of rings and singles on 6 pipelines, about half of them aligned:
    the vectorised count equals counting each member's micro-batches in list order."""
    import random

    def counted(rings):
        count, out = {}, []
        for ring in rings:
            i = count.get(ring[0], 0)
            if any(count.get(r, 0) != i for r in ring):
                return None
            count.update(dict.fromkeys(ring, i + 1))
            out.append(i)
        return out

    rng = random.Random(0)
    aligned = 0
    for _ in range(300):
        rings = [tuple(rng.sample(range(6), rng.choice((1, 1, 2, 3)))) for _ in range(rng.randint(1, 7))]
        want = counted(rings)
        aligned += want is not None
        assert local_indices(_placements(rings)) == want, rings
    assert 50 < aligned < 250


def test_the_window_it_fills_is_the_one_the_floor_counts():
    """One pipeline, PP 4, a long micro-batch first and three shorter levels: moved before it,
    their backwards fill its window and the pipeline meets its floor."""
    seconds = {0: 10.0, 1: 3.0, 2: 2.0, 3: 1.0}
    lifted = [p.seqs[0] for p in next_levels_first(_placements([(0,), (0,), (0,), (0,)]), 3)]
    assert lifted == [3, 2, 1, 0]
    before = simulate_schedule([[0, 1, 2, 3]], seconds, pp=4, forward_fraction=1 / 3).rank_finish_s[0]
    after = simulate_schedule([lifted], seconds, pp=4, forward_fraction=1 / 3).rank_finish_s[0]
    floor = sum(seconds.values()) + idle_floor(list(seconds.values()), 4, 1 / 3)
    assert (before, after) == (pytest.approx(44.0), pytest.approx(42.0))
    assert after == pytest.approx(floor)


@pytest.mark.parametrize("dataset, seed, tokens, hdp, pp", [("byted", 0, 120_000, 8, 4), ("github", 1, 60_000, 8, 2)])
def test_balance_keeps_it_where_it_is_faster_and_is_never_slower_for_it(dataset, seed, tokens, hdp, pp, monkeypatch):
    lengths = synthetic_lengths(dataset, tokens, seed=seed, max_length=16_384)
    kw = dict(scheduler="balance", hdp_size=hdp, capacity=2_048, cost_model=toy_cost_model(), pp_size=pp,
              context_length=16_384, offload=False)
    plan = make_plan(lengths, **kw)
    assert plan.meta["assignment"].endswith("+next-levels-first"), plan.meta["assignment"]
    plan.validate()
    monkeypatch.setattr(balance_module, "next_levels_first", lambda placements, lead: None)
    without = make_plan(lengths, **kw)
    assert not without.meta["assignment"].endswith("+next-levels-first")
    assert plan.estimate.step_time_s < without.estimate.step_time_s


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_balance_lifts_the_next_pp_minus_one_levels(pp, monkeypatch):
    """The lead is PP - 1: the backwards of that many micro-batches fit the window."""
    leads = []

    def recorded(placements, lead):
        leads.append(lead)
        return next_levels_first(placements, lead)

    monkeypatch.setattr(balance_module, "next_levels_first", recorded)
    lengths = synthetic_lengths("github", 40_000, seed=2, max_length=8_192)
    make_plan(lengths, scheduler="balance", hdp_size=4, capacity=2_048, cost_model=toy_cost_model(),
              pp_size=pp, context_length=8_192, offload=False)
    assert leads and set(leads) == {pp - 1}
