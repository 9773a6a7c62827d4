"""PP-Balance with the longest rings on pipelines of their own (``planner/schedulers/pp_isolate.py``
and ``pp_balance(isolated=...)``), on hand-made units whose times are worked out in the
docstrings (``planner_cases.LINEAR_CM``: a sequence of L tokens on a
ring of D takes ``2 D ceil(L / 2D) / D`` ms per member, a single L ms), and on seeded batches
where the candidate wins."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.pp_balance import local_indices, pp_balance
from megatron_bytescale.planner.schedulers.pp_isolate import LAYER_FRACTIONS, dominant_rings, isolated_runs
from megatron_bytescale.planner.sharding import Unit
from megatron_bytescale.planner.topology import Topology
from planner_cases import linear_ctx as ctx, linear_unit as unit, lists_by_rank, small_cost_model


def timed(seq: int, seconds: float, ring: int = 1) -> Unit:
    return Unit(seqs=(seq,), lengths=(1,), ring_size=ring, min_ring_size=ring, time=seconds)


def test_a_ring_is_isolated_while_its_floor_passes_the_mean_of_the_others():
    """8 pipelines, PP 2. Ring A (4 members, 3 s, 12 rank-s), ring B (2 members, 0.4 s, 0.8),
    four singles of 1 s (4). A: 4 pipelines left, they would carry (0.8 + 4) / 4 = 1.2 s on
    average, below A's 2 x 3 = 6 s: isolated. B: 2 left would carry (4.8 - 0.8) / 2 = 2 s,
    above B's 0.8 s: not isolated, and the walk stops."""
    a, b = timed(0, 3.0, ring=4), timed(1, 0.4, ring=2)
    singles = [timed(2 + k, 1.0) for k in range(4)]
    assert dominant_rings([a, b, *singles], 8, 2) == [a]
    # at PP 4 B's floor is 1.6 s, still under 2 s; at PP 6, 2.4 s: isolated
    assert dominant_rings([a, b, *singles], 8, 4) == [a]
    assert dominant_rings([a, b, *singles], 8, 6) == [a, b]
    assert dominant_rings([a, b, *singles], 8, 1) == []  # no pipeline, no 1F1B floor


def test_rings_of_one_time_go_widest_first_and_a_tie_with_the_mean_isolates():
    """10 pipelines, PP 2. Rings A (3 members) and B (4 members) of 1 s, two singles of 1 s: B,
    the wider, first (6 left would carry (3 + 2) / 6 s), then A (3 left, 2 / 3 s). A ring whose
    floor equals the mean is isolated: 2 x 1 s against 4 s over 2 pipelines. One pipeline left
    over is enough for the singles."""
    a, b = timed(0, 1.0, ring=3), timed(1, 1.0, ring=4)
    assert dominant_rings([a, b, timed(2, 1.0), timed(3, 1.0)], 10, 2) == [b, a]
    c = timed(0, 1.0, ring=2)
    assert dominant_rings([c, timed(1, 2.0), timed(2, 2.0)], 4, 2) == [c]
    assert dominant_rings([c, timed(1, 2.0), timed(2, 2.0 + 1e-9)], 4, 2) == []
    assert dominant_rings([timed(0, 3.0, ring=4), timed(1, 0.5)], 5, 2) == [timed(0, 3.0, ring=4)]
    assert dominant_rings([timed(0, 3.0, ring=5)], 5, 2) == []  # no pipeline left for the others


def test_no_ring_is_isolated_where_the_others_could_not_hold_the_widest_left():
    """6 pipelines: isolating A (4 members) leaves 2, and ring B needs 3."""
    a, b = timed(0, 3.0, ring=4), timed(1, 0.5, ring=3)
    assert dominant_rings([a, b, timed(2, 0.1)], 6, 2) == []
    # on 7 pipelines 3 are left, enough for B; B itself would then leave none for the single
    assert dominant_rings([a, b, timed(2, 0.1)], 7, 2) == [a]


UNITS = [unit(0, 8000, ring=4), unit(1, 1200, ring=2), unit(3, 500), unit(4, 300), unit(2, 400, ring=2),
         unit(5, 150), unit(6, 100), unit(7, 50)]
"""A: ring of 4, 2.0 s; B: ring of 2, 0.6 s; C (seq 2): ring of 2, 0.2 s; singles 0.5, 0.3,
0.15, 0.1, 0.05 s."""


def test_the_isolated_ring_runs_after_one_layer_and_the_rest_below():
    """A isolated on pipelines 4-7, layer cap 0.5 s. The layer: rings of at most 0.5 s, longest
    first, while they fit the 4 ranks left of the block (C on 4, 5; B, 0.6 s, is over the cap),
    then the longest singles of at most 0.5 s, one per rank (0.5 on 6, 0.3 on 7). Then B by
    count groups on 0-3 (0, 1) and the runs on 0-3 only (delta 0, one bucket): max 0.6, targets
    2 and 3; pipeline 2 takes 0.15, 0.1 and 0.05 (0.3, under 0.6), so 3 takes none."""
    placements = pp_balance(sorted(UNITS, key=lambda u: -u.time), ctx(8), 8, delta=0.0, num_buckets=1,
                            isolated=[UNITS[0]], layer_cap=0.5)
    assert lists_by_rank(placements) == {0: [1], 1: [1], 2: [5, 6, 7], 4: [2, 0], 5: [2, 0], 6: [3, 0], 7: [4, 0]}
    assert local_indices(placements) is not None  # A at index 1 on all its members (D5)
    assert sorted(p.seqs[0] for p in placements) == list(range(8))


def test_two_isolated_rings_each_get_a_layer_and_a_unit_at_the_cap_joins_one():
    """A and A' (seq 10), rings of 4 at 2 s, on 8-11 and 4-7; cap 0.2 s. A's layer: C (0.2 s,
    at the cap) on 8, 9, then the longest singles of at most 0.2 s, 0.15 and 0.1, on 10, 11.
    A''s layer: no ring is left under the cap, so the next singles, 0.05, 0.04, 0.03, 0.02, on
    4-7. Then B on 0, 1 and the singles left, 0.5 and 0.3, by the runs on 2 and 3 (max 0.6:
    2 takes 0.5, 0.3 would pass; 3 takes 0.3). Ratios go with the units."""
    extra = [unit(10, 8000, ring=4, ratio=0.25), unit(8, 40), unit(9, 30), unit(11, 20)]
    units = sorted(UNITS + extra, key=lambda u: -u.time)
    placements = pp_balance(units, ctx(12), 12, delta=0.0, num_buckets=1, isolated=[UNITS[0], extra[0]],
                            layer_cap=0.2)
    assert lists_by_rank(placements) == {0: [1], 1: [1], 2: [3], 3: [4], 8: [2, 0], 9: [2, 0], 10: [5, 0],
                                         11: [6, 0], 4: [7, 10], 5: [8, 10], 6: [9, 10], 7: [11, 10]}
    assert {p.seqs[0]: p.offload_ratio for p in placements}[10] == 0.25
    assert local_indices(placements) is not None


def test_each_block_takes_the_next_singles():
    """Three isolated rings of 2 (1 s each) on 6-7, 4-5 and 2-3, cap 0.5 s and no other ring:
    the singles, longest first, cover the blocks two by two in that order."""
    rings = [unit(k, 2000, ring=2) for k in range(3)]
    singles = [unit(3 + k, length) for k, length in enumerate((500, 400, 300, 200, 100, 50))]
    placements = pp_balance(rings + singles, ctx(8), 8, delta=0.0, num_buckets=1, isolated=rings, layer_cap=0.5)
    assert lists_by_rank(placements) == {6: [3, 0], 7: [4, 0], 4: [5, 1], 5: [6, 1], 2: [7, 2], 3: [8, 2]}


def test_a_layer_the_units_under_the_cap_cannot_cover_is_left_out():
    """Cap 0.125 s: no ring is that short and only two singles (0.1, 0.05) are, for four ranks:
    A runs alone, and everything else goes to pipelines 0-3 (B and C by count groups: B on 0, 1,
    C on the ranks that ran none, 2, 3; then the runs: max 0.6, targets 2, 3 at 0.2: 2 takes 0.5
    (0.7, and 0.3 would pass 0.6), 3 takes 0.3 (0.5; + 0.15 would pass). Max 0.7: targets 3
    (0.5), 0, 1 (0.6); 3 takes 0.15 (0.65, + 0.1 would pass 0.7), 0 takes 0.1 (0.7), 1 takes
    0.05.)"""
    placements = pp_balance(sorted(UNITS, key=lambda u: -u.time), ctx(8), 8, delta=0.0, num_buckets=1,
                            isolated=[UNITS[0]], layer_cap=0.125)
    assert lists_by_rank(placements) == {0: [1, 6], 1: [1, 7], 2: [2, 3], 3: [2, 4, 5], 4: [0], 5: [0], 6: [0], 7: [0]}


def test_the_layer_cap_walks_towards_the_slower_side():
    """A fake estimate: the isolated pipelines finish at 10 + the layer's work, the others at
    12 - 2 x that work. The walk starts at a quarter of A's 2 s (0.5 s: layer C, 0.5, 0.3, work
    1.2: 11.2 against 9.6, the isolated side is slower) and moves down: 0.25 s (C, 0.15, 0.1,
    work 0.65: 10.65 and 10.7, faster), then 0.125 s (no layer: 12, slower) and stops. Three
    plans timed; the 0.25 s layer wins."""
    work = {u.seqs: u.work for u in UNITS}
    calls = []

    def finish_times(placements, stop_above=None):
        layer = sum(work[p.seqs] for p in placements if p.ring[0] >= 4 and p.seqs != (0,))
        calls.append((round(layer, 6), stop_above))
        out = np.full(8, 12.0 - 2 * layer)
        out[4:] = 10.0 + layer
        return out

    placements, _ = isolated_runs(sorted(UNITS, key=lambda u: -u.time), ctx(8), 8, [UNITS[0]], finish_times,
                               delta=0.0, num_buckets=1)
    # the first timed to the end (its slower side sets the direction), the others against the best
    assert [(w, s if s is None else round(s, 6)) for w, s in calls] == [(1.2, None), (0.65, 11.2), (0.0, 10.7)]
    assert lists_by_rank(placements)[6] == [5, 0] and lists_by_rank(placements)[7] == [6, 0]
    assert LAYER_FRACTIONS[2] == 1 / 4  # the walk's start, as the docstring says


def test_the_walk_goes_up_when_the_other_pipelines_finish_last():
    """The same with the others slower (12 - layer against 10 + layer / 4): 0.5 s (work 1.2:
    10.3 against 10.8, the others are slower) moves up: 0.75 s (B, then C: work 1.6, 10.4 on
    both sides, faster), then 1 s (the same layer, not faster) stops the walk and 0.75 s wins."""
    work = {u.seqs: u.work for u in UNITS}
    calls = []

    def finish_times(placements, stop_above=None):
        layer = sum(work[p.seqs] for p in placements if p.ring[0] >= 4 and p.seqs != (0,))
        calls.append(round(layer, 6))
        out = np.full(8, 12.0 - layer)
        out[4:] = 10.0 + layer / 4
        return out

    placements, _ = isolated_runs(sorted(UNITS, key=lambda u: -u.time), ctx(8), 8, [UNITS[0]], finish_times,
                               delta=0.0, num_buckets=1)
    assert calls == [1.2, 1.6, 1.6]
    assert lists_by_rank(placements)[4] == [1, 0] and lists_by_rank(placements)[6] == [2, 0]


def test_the_walk_goes_down_on_a_tie_and_stops_at_either_end_of_the_caps():
    """Both sides finishing together counts as the isolated side being last: the walk goes to
    shorter layers (each faster here) and stops at the shortest cap, 1/16. When every plan is
    faster than the last and the others finish last, it goes up to the longest, 1/2, and
    stops there."""
    work = {u.seqs: u.work for u in UNITS}
    layers = []

    def tie(placements, stop_above=None):
        layer = sum(work[p.seqs] for p in placements if p.ring[0] >= 4 and p.seqs != (0,))
        layers.append(round(layer, 6))
        return np.full(8, 10.0 + layer)

    units = sorted(UNITS, key=lambda u: -u.time)
    placements, _ = isolated_runs(units, ctx(8), 8, [UNITS[0]], tie, delta=0.0, num_buckets=1)
    assert layers == [1.2, 0.65, 0.0] and lists_by_rank(placements)[4] == [0]
    calls = []

    def better_each_time(placements, stop_above=None):
        calls.append(stop_above)
        out = np.full(8, 12.0 - 0.1 * len(calls))
        out[4:] = 0.0
        return out

    isolated_runs(units, ctx(8), 8, [UNITS[0]], better_each_time, delta=0.0, num_buckets=1)
    assert len(calls) == 3 and calls[0] is None  # 1/4, 3/8, 1/2: no cap past the last


def test_a_node_map_is_cut_to_the_ranks_below_the_isolated_rings():
    topo = Topology.from_node_map([0, 0, 0, 1, 1, 2, 2, 2])
    assert topo.first(5) == Topology.from_node_map([0, 0, 0, 1, 1])
    assert topo.first(8) == topo
    assert Topology(ranks_per_node=4).first(3) == Topology(ranks_per_node=4)
    with pytest.raises(ValueError, match="not a prefix"):
        topo.first(9)


IRREGULAR = Topology.from_node_map([r // 4 if r % 8 < 3 else r // 4 + 100 for r in range(16)])


WINS = [("github", 5, 12, 2, 60_000, None), ("github", 7, 16, 4, 120_000, None), ("byted", 6, 12, 2, 60_000, None),
        ("byted", 4, 16, 2, 120_000, None), ("byted", 4, 16, 2, 120_000, IRREGULAR)]
"""Seeded batches on which rings of their own win (found by a search; the node-map case is
planned whichever wins)."""


@pytest.mark.parametrize("dataset, seed, hdp, pp, tokens, topology", WINS)
def test_where_rings_of_their_own_win_the_plan_is_valid_and_trains_every_sequence_once(
        dataset, seed, hdp, pp, tokens, topology):
    """Seeded batches on which the candidate wins (found by a search; the node-map case is
    planned whichever wins): the plan validates (rings at one local index on all members),
    trains every sequence once, is no slower than naive, and each isolated ring's members run
    nothing but their layer and the ring."""
    lengths = synthetic_lengths(dataset, tokens, seed=seed, max_length=16_384)
    kw = dict(hdp_size=hdp, capacity=2048, cost_model=small_cost_model(), pp_size=pp, context_length=16_384,
              topology=topology)
    plan = make_plan(lengths, scheduler="balance", offload=False, **kw).validate()
    naive = make_plan(lengths, scheduler="naive", offload=False, **kw)
    assert plan.estimate.step_time_s <= naive.estimate.step_time_s
    trained = sorted(s for rank in plan.ranks for mb in rank.micro_batches for s in mb.seqs if mb.ring[0] == rank.rank)
    assert trained == list(range(len(lengths)))
    if topology is not None:
        return
    assert plan.meta["assignment"] == "pp-runs-isolated"
    widest = max((mb.ring for rank in plan.ranks for mb in rank.micro_batches), key=len)
    for r in widest:
        rings = [mb.ring for mb in plan.ranks[r].micro_batches]
        assert rings[-1] == widest and len(rings) <= 2, rings


def test_the_walk_hands_back_its_plans_full_timing(monkeypatch):
    """Rings of their own come with the step their layer-cap walk timed, which ``balance`` takes
    as that candidate's timing (and the best to beat) instead of timing it again: it must be the
    very value a full timing of those placements gives, and the plan's estimate where it wins."""
    import megatron_bytescale.planner.schedulers.balance as balance_mod

    real = balance_mod.isolated_runs
    seen = []

    def capture(units, ctx, n, isolated, finish_times, **kwargs):
        placements, step = real(units, ctx, n, isolated, finish_times, **kwargs)
        seen.append((step, float(np.max(finish_times(placements)))))
        return placements, step

    monkeypatch.setattr(balance_mod, "isolated_runs", capture)
    for dataset, seed, hdp, pp, tokens, topology in WINS[:4]:
        seen.clear()
        lengths = synthetic_lengths(dataset, tokens, seed=seed, max_length=16_384)
        plan = make_plan(lengths, scheduler="balance", offload=False, hdp_size=hdp, capacity=2048,
                         cost_model=small_cost_model(), pp_size=pp, context_length=16_384)
        assert len(seen) == 1 and seen[0][0] == seen[0][1], seen
        assert plan.estimate.step_time_s == seen[0][0]  # it wins on these


@pytest.mark.parametrize("dataset, seed, hdp, pp, tokens, topology", WINS)
def test_skipping_by_the_floors_never_changes_the_plan_where_rings_of_their_own_win(
        dataset, seed, hdp, pp, tokens, topology, monkeypatch):
    """The walk's timing sets the best to beat before the other candidates are ranked (and drops
    the assignments whose order-free floor is already slower): the plan is the one made with
    nothing skipped."""
    from planner_cases import nothing_skipped

    lengths = synthetic_lengths(dataset, tokens, seed=seed, max_length=16_384)
    kw = dict(hdp_size=hdp, capacity=2048, cost_model=small_cost_model(), pp_size=pp, context_length=16_384,
              topology=topology)

    def key():
        plan = make_plan(lengths, scheduler="balance", offload=False, **kw)
        return plan.content_hash(), plan.meta["assignment"], plan.estimate.step_time_s

    planned = key()
    nothing_skipped(monkeypatch)
    assert planned == key()
