"""The planner's fast paths give the same plans as the straightforward code they replace.

Planning time matters (it is on the critical path without lookahead), so the schedulers reuse
unit times instead of calling the cost model per ring, the 1F1B simulation runs on integer node
ids, PP-Balance skips candidates whose 1F1B floor is already slower than the best, and packing
and the time-step fill use sorted structures. Each is compared here with a slow reference kept in
this file or reached by switching the fast path off: plan content hashes must be identical.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import megatron_bytescale.planner.order as order_mod
import megatron_bytescale.planner.schedulers.balance as balance_mod
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.estimate import micro_batch_costs
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.placement import FreeRanks
from megatron_bytescale.planner.sharding import ShardingContext, best_fit_decreasing, pack_times
from megatron_bytescale.planner.topology import Topology
from planner_cases import nothing_skipped, small_cost_model


def _slow_placed_time(self, unit, ring):
    return self.ring_time(unit.lengths, ring, unit.offload_ratio)


def _batches(count: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        hdp = int(rng.choice([8, 12, 16, 32]))
        cap = int(rng.integers(64, 512))
        n = int(rng.integers(10, 90))
        long_ = rng.integers(cap, cap * hdp // 2 + cap + 1, n)
        lengths = np.where(rng.random(n) < 0.7, rng.integers(1, cap, n), long_).tolist()
        yield lengths, hdp, cap, int(rng.choice([2, 4])), int(rng.choice([1, 2, 4]))


def _plans(monkeypatch, slow: bool, *, two_level: bool = False):
    """Plans of random toy batches and of seeded synthetic batches (DP and PP, offload on and
    off), with the fast paths on or (``slow``) replaced by their references."""
    with monkeypatch.context() as m:
        if slow:
            m.setattr(ShardingContext, "placed_time", _slow_placed_time)
            m.setattr(order_mod, "_simulate_pipelines", lambda *a, **k: None)
            nothing_skipped(m)  # no candidate skipped by a floor, every one timed to its end
        hashes = []
        for lengths, hdp, cap, g, pp in _batches(10, seed=7):
            cm = small_cost_model(ranks_per_node=g, two_level_ring=two_level)
            for scheduler in ("balance", "naive"):
                for offload in (False, True):
                    plan = make_plan(lengths, scheduler=scheduler, hdp_size=hdp, capacity=cap, cost_model=cm,
                                     pp_size=pp, offload=offload, overlong="truncate")
                    hashes.append((plan.content_hash(), plan.estimate.step_time_s, plan.meta.get("assignment")))
        cm = preset_cost_model("llama-7b").with_(two_level_ring=two_level)
        for dataset, pp, offload in (("github", 1, False), ("byted", 1, True), ("github", 2, False),
                                     ("byted", 4, True)):
            lengths = synthetic_lengths(dataset, 2 * 2**20, seed=3, max_length=262144)
            plan = make_plan(lengths, scheduler="balance", hdp_size=64, capacity=8192, cost_model=cm,
                             pp_size=pp, offload=offload, context_length=262144)
            hashes.append((plan.content_hash(), plan.estimate.step_time_s, plan.meta.get("assignment")))
        return hashes


@pytest.mark.parametrize("two_level", [False, True], ids=["flat", "two-level"])
def test_fast_paths_make_the_same_plans(monkeypatch, two_level):
    fast = _plans(monkeypatch, slow=False, two_level=two_level)
    slow = _plans(monkeypatch, slow=True, two_level=two_level)
    assert fast == slow
    # the candidates PP-Balance may skip are really exercised: more than one assignment wins
    assert len({a for _, _, a in fast if a}) >= 3, {a for _, _, a in fast}


def test_unit_times_are_what_the_cost_model_gives_on_their_ring():
    """``placed_time`` reuses ``Unit.time`` when the ring's nodes match what it was costed for;
    that time must then be the cost model's own (the vectorised sharding costs every unit)."""
    from megatron_bytescale.planner.sharding import shard_batch

    kinds: set[str] = set()
    for cm in (preset_cost_model("llama-7b"), preset_cost_model("llama-7b").with_(two_level_ring=True)):
        lengths = synthetic_lengths("byted", 8 * 2**20, seed=1, max_length=2097152)
        for offload in (False, True):
            ctx = ShardingContext(capacity=8192, layers=cm.num_layers, cost_model=cm, hdp_size=512,
                                  offload=offload, topology=Topology(ranks_per_node=8))
            units = shard_batch(list(range(len(lengths))), [int(x) for x in lengths], ctx)
            kinds.update("long" if u.ring_size > 8 else "small" for u in units if u.ring_size > 1)
            for u in units:
                ring = tuple(range(u.ring_size))  # node-contiguous from rank 0: the costed shape
                assert ctx.placed_time(u, ring) == ctx.ring_time(u.lengths, ring, u.offload_ratio)
                if 1 < u.ring_size <= 8:  # across two nodes: a different rate, recomputed
                    across = tuple(range(4, 4 + u.ring_size))
                    assert ctx.placed_time(u, across) == ctx.ring_time(u.lengths, across, u.offload_ratio)
    assert kinds == {"long", "small"}


def test_pipeline_simulation_matches_the_general_graph(monkeypatch):
    """The integer-node 1F1B simulation gives the same finish times (and recorded op times) as
    the general dependency graph, and still reports deadlocks through it."""
    cm = small_cost_model()
    checked = 0
    for lengths, hdp, cap, g, pp in _batches(20, seed=3):
        if pp == 1:
            continue
        plan = make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=cap, cost_model=cm, pp_size=pp,
                         overlong="truncate", estimate=False)
        costs = micro_batch_costs(plan, cm)
        durations = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
        fast = order_mod.simulate(plan, durations, record=True)
        with monkeypatch.context() as m:
            m.setattr(order_mod, "_simulate_pipelines", lambda *a, **k: None)
            slow = order_mod.simulate(plan, durations, record=True)
        assert fast.rank_finish_s.tolist() == slow.rank_finish_s.tolist()
        assert fast.node_times == slow.node_times
        checked += 1
    assert checked >= 8


def test_the_floors_are_below_every_candidate_step():
    """PP-Balance skips a candidate whose floor exceeds the best step: the floor must never
    exceed the candidate's own 1F1B step."""
    from dataclasses import replace

    from megatron_bytescale.planner.estimate import estimate_plan
    from megatron_bytescale.planner.schedulers._common import build_request, emit_plan
    from megatron_bytescale.planner.schedulers.pp_floors import alone_floor, order_free_floor
    from megatron_bytescale.planner.sharding import shard_batch

    cm = small_cost_model()
    seen = 0
    for lengths, hdp, cap, g, pp in _batches(30, seed=5):
        if pp == 1:
            continue
        req = build_request(lengths, hdp_size=hdp, capacity=cap, cost_model=cm, pp_size=pp, offload=True,
                            overlong="truncate", align=1, context_length=None, delta=0.05, num_buckets=4)
        req = balance_mod.apply_hdp_overlong(req)
        ctx = req.sharding_context()
        units = shard_batch(req.ids, req.lengths, ctx)
        for fd in (0, pp - 1):
            placements = balance_mod.pp_balance(sorted(units, key=balance_mod.unit_sort_key), ctx, hdp,
                                                delta=0.05, num_buckets=4, fill_drain=fd)
            plan = emit_plan(req, placements, scheduler="balance")
            step = estimate_plan(plan, cm).step_time_s
            floor = alone_floor(placements, units, ctx, pp)
            assert 0 < order_free_floor(placements, units, ctx, pp) <= floor <= step * (1 + 1e-12), (floor, step)
            seen += 1
    assert seen >= 10


def _bfd_reference(ids, lengths, capacity):
    order = sorted(range(len(ids)), key=lambda i: (-lengths[i], ids[i]))
    bins, room = [], []
    for i in order:
        fits = [(room[b], b) for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits)[1]
            bins[b].append(ids[i])
            room[b] -= lengths[i]
        else:
            bins.append([ids[i]])
            room.append(capacity - lengths[i])
    return bins


def test_packing_and_pack_times_match_references():
    rng = np.random.default_rng(11)
    ctx = ShardingContext(capacity=500, layers=8, cost_model=small_cost_model(), hdp_size=4)
    for _ in range(40):
        n = int(rng.integers(0, 120))
        ids = rng.permutation(1000)[:n].tolist()
        lengths = rng.integers(1, 500, n).tolist()
        assert best_fit_decreasing(ids, lengths, 500) == _bfd_reference(ids, lengths, 500)
    packs = [tuple(rng.integers(1, 500, int(rng.integers(1, 40))).tolist()) for _ in range(200)]
    slow = [ctx.cost_model.micro_batch_time(list(p), 1, layers=8) for p in packs]
    assert pack_times(packs, ctx) == slow


def _take_reference(by_node: dict, d: int, topo: Topology, fallback: bool):
    """The time-step fill's rule written out plainly (scan every node per choice)."""
    g = topo.ranks_per_node
    if d > sum(len(v) for v in by_node.values()):
        return None
    whole, rest = divmod(d, g) if d > g else (0, d)
    nodes = sorted(by_node)
    full = [k for k in nodes if len(by_node[k]) == g][:whole]
    chosen = None
    if len(full) == whole:
        fits = [(len(by_node[k]), k) for k in nodes if k not in full and len(by_node[k]) >= rest]
        if rest == 0 or fits:
            chosen = [r for k in full for r in by_node[k]] + (by_node[min(fits)[1]][:rest] if rest else [])
    if chosen is None:
        chosen, used = [], 0
        for k in sorted(nodes, key=lambda k: (-len(by_node[k]), k)):
            if len(chosen) == d:
                break
            chosen += by_node[k][: d - len(chosen)]
            used += 1
        if used > topo.min_nodes(d) and not fallback:
            return None
    for k in {topo.node(r) for r in chosen}:
        by_node[k] = [r for r in by_node[k] if r not in chosen]
        if not by_node[k]:
            del by_node[k]
    return list(topo.node_contiguous(chosen))


def test_free_ranks_match_the_plain_rule():
    rng = np.random.default_rng(2)
    for _ in range(200):
        g = int(rng.choice([2, 4, 8]))
        n = int(rng.integers(4, 64))
        topo = Topology(ranks_per_node=g)
        free = sorted(rng.permutation(n)[: int(rng.integers(1, n + 1))].tolist())
        fast = FreeRanks(free, topo)
        ref: dict[int, list[int]] = {}
        for r in free:
            ref.setdefault(topo.node(r), []).append(r)
        for _ in range(6):
            d = int(rng.integers(1, 2 * g + 3))
            fb = bool(rng.random() < 0.3)
            assert fast.take(d, fallback=fb) == _take_reference(ref, d, topo, fb)
            assert fast.remaining() == sorted(r for v in ref.values() for r in v)


def test_ring_sizes_without_offload_match_the_scalar_search():
    """The vectorised offload-free ring sizes (sharding sizes every long sequence at once) are
    the scalar search's, for alignments that push sizes past the activation ratio, and the
    same error where no ring holds a sequence."""
    from megatron_bytescale.planner.offload import ring_size_without_offload, ring_sizes_without_offload, solve_offload

    rng = np.random.default_rng(5)
    bumped = 0  # sizes the zigzag check pushed past the activation ratio and ceil(n / C)
    for cm in (small_cost_model(), preset_cost_model("llama-7b")):
        for capacity, align, layers in ((512, 1, 8), (5, 1, 4), (300, 7, 2), (1024, 16, 4), (64, 24, 8),
                                        (777, 100, 16)):
            lengths = np.concatenate([rng.integers(capacity, capacity * 80, 300),
                                      [capacity, capacity + 1, 2 * capacity - 1, 2 * capacity]]).tolist()
            kw = dict(capacity=capacity, cost_model=cm, layers=layers, align=align)
            want = [ring_size_without_offload(n, **kw) for n in lengths]
            assert ring_sizes_without_offload(lengths, **kw) == want
            start = [max(1, math.ceil(cm.activation_bytes(n) / cm.activation_bytes(capacity) - 1e-9),
                         -(-n // capacity)) for n in lengths]
            bumped += sum(d > s for d, s in zip(want, start))
            assert start == [-(-n // capacity) for n in lengths]  # Act(s) / Act(C) never sets the start
            if align == 1:  # the default alignment
                assert ring_sizes_without_offload(lengths, capacity=capacity, cost_model=cm, layers=layers) == want
            for n, d0 in list(zip(lengths, want))[:40]:  # the caller's D0 handed in: the same decision
                args = dict(capacity=capacity, layers=layers, cost_model=cm, align=align, max_ring_size=64)
                assert solve_offload(n, without_offload=d0, **args) == solve_offload(n, **args)
    assert bumped > 50
    assert ring_sizes_without_offload([], capacity=64, cost_model=small_cost_model(), layers=4) == []
    kw = dict(capacity=64, cost_model=small_cost_model(), layers=4, align=100)  # no ring holds 100 > 64
    with pytest.raises(ValueError) as scalar:
        ring_size_without_offload(500, **kw)
    with pytest.raises(ValueError) as vector:
        ring_sizes_without_offload([64, 500, 900], **kw)
    assert str(vector.value) == str(scalar.value) and "500" in str(scalar.value)


def test_packs_hold_the_lengths_of_their_bins():
    from megatron_bytescale.planner.sharding import best_fit_packs

    rng = np.random.default_rng(12)
    for _ in range(20):
        n = int(rng.integers(1, 300))
        ids = rng.permutation(5000)[:n].tolist()
        lengths = rng.integers(1, 800, n).tolist()
        bins, packs = best_fit_packs(ids, lengths, 800)
        length_of = dict(zip(ids, lengths))
        assert bins == _bfd_reference(ids, lengths, 800)
        assert packs == [[length_of[i] for i in b] for b in bins]


def test_placements_added_at_once_are_the_plan_of_adding_each():
    """``add_placements`` (single-rank micro-batches inline) builds what ``add`` per placement
    does: the same micro-batches, pieces and orders on every rank."""
    from megatron_bytescale.planner.schedulers._common import FastPlanBuilder, placement

    rng = np.random.default_rng(4)
    lengths = {i: int(n) for i, n in enumerate(rng.integers(1, 5000, 400))}
    placements, seq = [], 0
    while seq < len(lengths):
        d = int(rng.choice([1, 1, 1, 2, 3, 4]))
        k = 1 if d > 1 else int(rng.integers(1, 5))
        ring = tuple(sorted(rng.choice(8, d, replace=False).tolist()))
        ratio = round(float(rng.random()), 3) if rng.random() < 0.3 else 0.0  # fractional offload ratios too
        placements.append(placement(ring, tuple(range(seq, min(seq + k, len(lengths)))), ratio))
        seq += k
    for pieces in (True, False):
        one, all_ = (FastPlanBuilder(hdp_size=8, capacity=4096, lengths=lengths, align=4, pieces=pieces)
                     for _ in range(2))
        for p in placements:
            one.add(p.ring, p.seqs, p.offload_ratio)
        all_.add_placements(placements)
        assert all_.per_rank == one.per_rank and all_._next_order == one._next_order == len(placements)
        assert sum(len(mb.pieces) for mbs in all_.per_rank for mb in mbs if len(mb.ring) == 1) == (
            sum(len(p.seqs) for p in placements if len(p.ring) == 1) if pieces else 0)
