"""``balance`` times PP candidates without building their plans
(``planner/schedulers/candidate_time.py``): every candidate it times that way must get the same
per-rank finish times, float for float, as the plan it would build, estimated in full. Checked
on every candidate of seeded batches: PP 2 and 4, offload on and off (Eq. 3's ratios), the
regular node map, an irregular one, and two-level rings."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import megatron_bytescale.planner.schedulers.balance as balance_mod
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner import wavefront
from megatron_bytescale.planner.estimate import estimate_plan, micro_batch_costs
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers._common import emit_plan
from megatron_bytescale.planner.schedulers.candidate_time import finish_times, time_key, times_without_plan
from megatron_bytescale.planner.topology import Topology
from planner_cases import small_cost_model


# the last case adds the terms with a square root, a logarithm and a per-document cost (as the
# fitted preset has): a micro-batch's time must not depend on which others it is costed with
NOISY = dict(ring_straggler_s=2e-6, ring_straggler_link_ratio=0.05, per_document_s=1e-6)


@pytest.mark.parametrize("nodes,two_level,terms", [(None, False, {}), ("irregular", False, {}), (None, True, {}),
                                                   (None, False, NOISY)])
def test_every_candidate_is_timed_as_its_plan_would_be(nodes, two_level, terms, monkeypatch):
    checked = {"n": 0, "offloaded": 0, "rings": 0, "stopped": 0}

    def checking(request, placements, cost_model, seconds=None, stop_above=None):
        got = finish_times(request, placements, cost_model, seconds)  # with balance's cache of stage times
        plan = emit_plan(replace(request, pieces=False), placements, scheduler="balance")
        want = np.asarray(estimate_plan(plan, cost_model).rank_time_s)
        assert got is not None and np.array_equal(got, want)
        checked["n"] += 1
        checked["offloaded"] += any(p.offload_ratio > 0 for p in placements)
        checked["rings"] += any(len(p.ring) > 1 for p in placements)
        if stop_above is None:
            return got
        # timed against the best so far: the same floats, or inf only where the step exceeds it
        stopped = finish_times(request, placements, cost_model, seconds, stop_above)
        if np.isinf(stopped).all():
            assert got.max() > stop_above, (got.max(), stop_above)
            checked["stopped"] += 1
        else:
            assert np.array_equal(stopped, got)
        return stopped

    monkeypatch.setattr(balance_mod, "candidate_finish_times", checking)
    monkeypatch.setattr(wavefront, "_STOP_EVERY", 1)  # the bound checked at every key of these short lists
    for ds in ("github", "byted"):
        for pp, hdp in ((2, 8), (4, 16)):
            topology = None
            if nodes == "irregular":  # nodes of 3 and 5 ranks
                topology = Topology.from_node_map([r // 4 if r % 8 < 3 else r // 4 + 100 for r in range(hdp)])
            for offload, seed in ((False, 0), (True, 0), (True, 1)):
                lengths = synthetic_lengths(ds, 100_000, seed=seed, max_length=16_384)
                plan = make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=2_048, pp_size=pp,
                                 cost_model=small_cost_model(two_level_ring=two_level, **terms), offload=offload,
                                 topology=topology, context_length=16_384, align=8)
                # the winner, built at the end, carries the estimate its timing promised
                assert plan.estimate.step_time_s == max(plan.estimate.rank_time_s)
    assert checked["n"] > 25 and checked["offloaded"] >= 4 and checked["rings"] > 25, checked
    assert checked["stopped"] >= 1, checked  # the early stop fires, and only where it may


@pytest.mark.parametrize("pp,hdp,two_level", [(2, 8, False), (4, 16, True)])
def test_balance_keeps_the_same_plan_when_every_candidate_is_built(pp, hdp, two_level, monkeypatch):
    """The winner, its estimate and its meta are those of comparing built plans."""
    def plan():
        lengths = synthetic_lengths("github", 100_000, seed=2, max_length=16_384)
        out = make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=2_048, pp_size=pp, align=8,
                        cost_model=small_cost_model(two_level_ring=two_level), context_length=16_384)
        return out.content_hash(), out.estimate, out.meta

    quick = plan()
    monkeypatch.setattr(balance_mod, "times_without_plan", lambda request: False)
    assert quick == plan()


def test_stage_times_kept_for_the_placements_of_another_candidate():
    """The cache of stage times by placement: a reordered candidate made of the same placements,
    a new candidate of new placements with the same contents, and a new cost model's plans (its
    own cache) all match their full estimates."""
    from megatron_bytescale.planner.schedulers._common import build_request
    from megatron_bytescale.planner.schedulers.pp_balance import pp_balance, short_first
    from megatron_bytescale.planner.schedulers.selective import unit_options

    lengths = synthetic_lengths("byted", 100_000, seed=3, max_length=16_384)
    request = build_request(lengths, scheduler="balance", hdp_size=8, capacity=2_048, pp_size=4, align=8,
                            cost_model=small_cost_model(), offload=True, overlong="error", context_length=16_384,
                            delta=0.05, num_buckets=4)
    request = balance_mod.apply_hdp_overlong(request)
    for _, ctx, base in unit_options(request):
        units = sorted(base, key=balance_mod.unit_sort_key)
        placements = pp_balance(units, ctx, 8, delta=0.05, num_buckets=4, fill_drain=3)
        moved = short_first(placements, units)
        again = [replace(p) for p in placements]  # equal contents, new objects
        # the same units on other ranks: each rank's singles go to the next rank (another
        # assignment of the set), rings stay
        ranks = sorted({p.ring[0] for p in placements if len(p.ring) == 1})
        shift = dict(zip(ranks, ranks[1:] + ranks[:1]))
        shifted = [replace(p, ring=(shift[p.ring[0]],)) if len(p.ring) == 1 else p for p in placements]
        assert shifted != placements
        seconds: dict = {}
        for candidate in (placements, moved, again, shifted, placements):
            if candidate is None:
                continue
            plan = emit_plan(replace(request, pieces=False), candidate, scheduler="balance")
            want = np.asarray(estimate_plan(plan, ctx.cost_model).rank_time_s)
            got = finish_times(request, candidate, ctx.cost_model, seconds)
            assert got is None or np.array_equal(got, want)
        topo = Topology.of(request.cost_model, request.topology)
        assert {time_key(p, topo) for p in placements} == seconds.keys()  # nothing costed twice


def test_candidates_with_expert_groups_or_one_stage_are_estimated_from_their_plan():
    from megatron_bytescale.planner.schedulers._common import build_request

    base = dict(scheduler="balance", hdp_size=8, capacity=2_048, cost_model=small_cost_model(), overlong="error", offload=False, context_length=None,
                align=1, delta=0.05, num_buckets=4, seq_split=False, even_expert_slots=True)
    lengths = [1_000] * 8
    assert times_without_plan(build_request(lengths, pp_size=2, ep_size=1, **base))
    assert not times_without_plan(build_request(lengths, pp_size=1, ep_size=1, **base))
    assert not times_without_plan(build_request(lengths, pp_size=2, ep_size=2, **base))
    # barriers between groups of micro-batches (which the estimate walks as a graph)
    with_barriers = replace(build_request(lengths, pp_size=2, ep_size=1, **base), meta={"barrier_after_orders": [3]})
    assert not times_without_plan(with_barriers)


def test_a_ring_across_a_boundary_of_the_given_node_map_and_the_kept_stage_times():
    """A ring on ranks 2 and 3, one node apart only in the request's node map (3 + 1 + 4 ranks;
    the cost model's 4 ranks per node would put them together), is timed as the plan's
    estimate times it: across nodes. Called without a cache and with one: the same floats, the
    cache then holds every placement with its stage time, and a time found there for the same
    placement object is used as it is (so a reordered candidate is not costed again)."""
    from megatron_bytescale.planner.schedulers._common import Placement, build_request

    node_map = Topology.from_node_map([0, 0, 0, 1, 2, 2, 2, 2])
    cm = small_cost_model(p2p_bandwidth_inter=1e6)  # a slow network: the crossing shows
    request = build_request([3_000, 500, 700, 900, 400, 600, 800], scheduler="balance", hdp_size=8,
                            capacity=2_048, pp_size=2, cost_model=cm, offload=False, overlong="error",
                            context_length=None, align=1, delta=0.05, num_buckets=4, topology=node_map)
    placements = [Placement(ring=(2, 3), seqs=(0,))] + [Placement(ring=(r,), seqs=(s,)) for r, s in
                                                       ((0, 1), (1, 2), (4, 3), (5, 4), (6, 5), (7, 6))]
    plan = emit_plan(replace(request, pieces=False), placements, scheduler="balance")
    want = np.asarray(estimate_plan(plan, cm).rank_time_s)
    regular = finish_times(replace(request, topology=None), placements, cm)
    assert not np.array_equal(regular, want)  # the node map matters here
    assert np.array_equal(finish_times(request, placements, cm), want)
    seconds: dict = {}
    assert np.array_equal(finish_times(request, placements, cm, seconds), want)
    costs = micro_batch_costs(plan, cm)  # the stage time of order k, the k-th placement
    assert seconds == {time_key(p, node_map): t for p, t in zip(placements, costs.seconds.tolist())}
    assert costs.orders.tolist() == list(range(len(placements)))
    # a kept time is used for every micro-batch with its key: the same ring (an equal new
    # object too), the same unit alone on another rank, the ring on other members across nodes;
    # the ring on members inside a node is costed anew
    ring = placements[0]
    seconds[time_key(ring, node_map)] *= 10
    slower = finish_times(request, placements, cm, seconds)
    assert slower[2] > want[2] and slower[3] > want[3]
    assert np.array_equal(finish_times(request, [replace(p) for p in placements], cm, seconds), slower)
    across = [Placement(ring=(1, 4), seqs=(0,))] + [Placement(ring=(r,), seqs=(s,)) for r, s in
                                                   ((0, 1), (2, 2), (3, 3), (5, 4), (6, 5), (7, 6))]
    fresh = finish_times(request, across, cm)
    plan = emit_plan(replace(request, pieces=False), across, scheduler="balance")
    assert np.array_equal(fresh, estimate_plan(plan, cm).rank_time_s)
    kept = finish_times(request, across, cm, seconds)
    assert kept[1] > fresh[1] and kept[4] > fresh[4]  # nodes 0 and 2: the kept time across nodes
    seconds[time_key(placements[1], node_map)] *= 10  # sequence 1 alone on rank 0, now on rank 4
    swapped = [ring, replace(placements[1], ring=(4,)), placements[2], replace(placements[3], ring=(0,))] + placements[4:]
    assert finish_times(request, swapped, cm, seconds)[4] > slower[4]
    other = [Placement(ring=(1, 2), seqs=(0,)), Placement(ring=(0,), seqs=(1,)), Placement(ring=(3,), seqs=(2,))] + placements[3:]
    plan = emit_plan(replace(request, pieces=False), other, scheduler="balance")
    assert np.array_equal(finish_times(request, other, cm, seconds)[1:3], estimate_plan(plan, cm).rank_time_s[1:3])


@pytest.mark.parametrize("pp,hdp,two_level,seq_split", [(2, 8, False, False), (4, 16, True, False),
                                                        (2, 8, False, True)])
def test_a_plan_whose_estimate_is_dropped_is_the_same_plan_built_without_one(pp, hdp, two_level, seq_split,
                                                                            monkeypatch):
    """``make_plan(estimate=False)`` (the simulator's call) returns the plan of
    ``estimate=True`` without its estimate, and with PP the winner timed without a plan is then
    built without running the full estimate (with two-level rings the wrapper estimates both
    sizings itself; Seq1F1B splitting estimates its own trials)."""
    lengths = synthetic_lengths("github", 100_000, seed=0, max_length=16_384)
    kw = dict(scheduler="balance", hdp_size=hdp, capacity=2_048, pp_size=pp, offload=True, seq_split=seq_split,
              cost_model=small_cost_model(two_level_ring=two_level), context_length=16_384)
    with_estimate = make_plan(lengths, **kw)
    calls = {"n": 0}

    def counting(*args, **kwargs):
        calls["n"] += 1
        return estimate_plan(*args, **kwargs)

    monkeypatch.setattr(balance_mod, "estimate_plan", counting)
    without = make_plan(lengths, estimate=False, **kw)
    assert without.estimate is None
    assert without.to_dict() == replace(with_estimate, estimate=None).to_dict()
    # the two-level wrapper estimates each of its two sizings once; nothing else is estimated
    assert calls["n"] == (2 if two_level else 0), calls


@pytest.mark.parametrize("pp", [1, 2])
def test_candidates_with_expert_groups_are_never_timed_without_their_plan(pp, monkeypatch):
    """With expert groups the estimate times groups slot by slot, which the shortcut does not:
    every candidate (and the level steps' ring phase) must be estimated from its plan."""
    def refuse(*args, **kwargs):
        raise AssertionError("a candidate with expert groups was timed without its plan")

    monkeypatch.setattr(balance_mod, "candidate_finish_times", refuse)
    lengths = synthetic_lengths("github", 60_000, seed=0, max_length=16_384)
    plan = make_plan(lengths, scheduler="balance", hdp_size=8, capacity=2_048, cost_model=small_cost_model(),
                     ep_size=2, pp_size=pp, offload=False, context_length=16_384)
    assert plan.meta["mode"] == "PP-Balance" and plan.estimate is not None


def test_a_unit_alone_and_the_same_unit_on_a_ring_inside_a_node_are_kept_apart():
    """A widened list can put a sequence on a ring of 2 inside a node that the unwidened list
    runs alone, and both lists' candidates share one cache of stage times."""
    from megatron_bytescale.planner.schedulers._common import Placement

    topo = Topology(ranks_per_node=4)
    alone, ring = Placement(ring=(3,), seqs=(7,)), Placement(ring=(0, 1), seqs=(7,))
    assert time_key(alone, topo) != time_key(ring, topo)
    assert time_key(alone, topo, True) != time_key(ring, topo, True)


def test_two_level_rings_of_one_size_across_nodes_in_other_node_groups_are_costed_apart():
    """With two-level rings a ring's time depends on its members per node: 4 ranks as 2 x 2
    (two-level) or as 3 + 1 (flat), both across nodes. Timed one after the other with one cache,
    each candidate gets its own plan's estimate."""
    from megatron_bytescale.planner.schedulers._common import Placement, build_request

    cm = small_cost_model(two_level_ring=True)
    request = build_request([5_000, 400, 600], scheduler="balance", hdp_size=12, capacity=2_048, pp_size=2,
                            cost_model=cm, offload=False, overlong="error", context_length=None, align=1,
                            delta=0.05, num_buckets=4)
    topo = Topology(ranks_per_node=4)
    singles = [Placement(ring=(8,), seqs=(1,)), Placement(ring=(9,), seqs=(2,))]
    two_by_two = [Placement(ring=(0, 1, 4, 5), seqs=(0,))] + singles
    three_and_one = [Placement(ring=(0, 1, 2, 4), seqs=(0,))] + singles
    assert topo.two_level_group(two_by_two[0].ring) == 2 and topo.two_level_group(three_and_one[0].ring) == 1
    seconds: dict = {}
    got = []
    for placements in (two_by_two, three_and_one):
        plan = emit_plan(replace(request, pieces=False), placements, scheduler="balance")
        want = np.asarray(estimate_plan(plan, cm).rank_time_s)
        got.append(finish_times(request, placements, cm, seconds))
        assert np.array_equal(got[-1], want)
    assert got[0][0] != got[1][0]  # the two rings take different times
