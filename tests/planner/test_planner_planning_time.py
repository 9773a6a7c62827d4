"""Planning-time fast paths give exactly the plans of the straightforward code they replace.

DP-Balance places a ring per long unit (node placement by ``np.partition`` instead of a sorted
view of every node), sharding splits the batch with numpy, the estimate skips the topology
calls of single-rank micro-batches, and units, placements and micro-batches are built without
the frozen dataclasses' ``__init__``. Each is switched back to a reference kept here, and the
plans (content hash and the whole estimate) must not change: DP and PP, offload on and off,
no node map, the regular one and an irregular one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import megatron_bytescale.planner.estimate as estimate_mod
import megatron_bytescale.planner.schedulers._common as common_mod
import megatron_bytescale.planner.schedulers.dp_balance as dp_mod
import megatron_bytescale.planner.schedulers.naive as naive_mod
import megatron_bytescale.planner.schedulers.selective as selective_mod
import megatron_bytescale.planner.sharding as sharding_mod
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.offload import solve_offload
from megatron_bytescale.planner.plan import MicroBatch, Piece
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers._common import Placement
from megatron_bytescale.planner.schedulers.placement import RingPlacer
from megatron_bytescale.planner.sharding import ShardingContext, Unit, best_fit_decreasing, long_times, pack_times
from megatron_bytescale.planner.slots import slot_constructor
from megatron_bytescale.planner.topology import Topology
from planner_cases import small_cost_model


def _shard_reference(ids, lengths, ctx):
    """:func:`.sharding.shard_batch` written with plain lists, dicts and dataclass constructors."""
    length_of = dict(zip(ids, lengths))
    short = [(i, n) for i, n in zip(ids, lengths) if n < ctx.capacity]
    long_ = sorted((i, n) for i, n in zip(ids, lengths) if n >= ctx.capacity)
    units = []
    decisions = [solve_offload(n, capacity=ctx.capacity, layers=ctx.layers, cost_model=ctx.cost_model,
                               align=ctx.align, offload=ctx.offload, max_ring_size=ctx.hdp_size,
                               in_flight=ctx.in_flight) for _, n in long_]
    times = long_times([n for _, n in long_], [d.ring_size for d in decisions],
                       [d.offload_ratio for d in decisions], ctx)
    for (sid, n), dec, t in zip(long_, decisions, times):
        unit = Unit(seqs=(sid,), lengths=(n,), ring_size=dec.ring_size, offload_ratio=dec.offload_ratio,
                    min_ring_size=dec.ring_size, time=t)
        units.append(ctx.resize(unit, dec.ring_size))
    if short:
        bins = best_fit_decreasing([i for i, _ in short], [n for _, n in short], ctx.capacity)
        packs = [tuple(length_of[i] for i in b) for b in bins]
        for b, p, t in zip(bins, packs, pack_times(packs, ctx)):
            units.append(Unit(seqs=tuple(b), lengths=p, ring_size=1, min_ring_size=1, time=t))
    return units


def _micro_batch_reference(order, ring, offload_ratio, seqs, pieces):
    return MicroBatch(order=order, ring=ring, offload_ratio=offload_ratio, seqs=seqs, pieces=pieces)


def _placement_reference(ring, seqs, offload_ratio):
    return Placement(ring=ring, seqs=seqs, offload_ratio=offload_ratio)


def _irregular(hdp: int, g: int) -> Topology:
    """Nodes of g ranks for the first half, of g - 1 (at least 1) for the rest, labels shuffled."""
    node_of = [r // g if r < hdp // 2 else 1000 - (r // max(1, g - 1)) for r in range(hdp)]
    return Topology.from_node_map(node_of)


def _fingerprint(plan) -> tuple:
    e = plan.estimate
    return (plan.content_hash(), plan.meta.get("assignment"), plan.meta.get("offload_choice"),
            json.dumps([e.step_time_s, list(e.rank_time_s), e.p2p_bytes, e.extra], sort_keys=True, default=str))


def _plans(monkeypatch, slow: bool) -> list[tuple]:
    with monkeypatch.context() as m:
        if slow:
            m.setattr(RingPlacer, "compact", RingPlacer._compact_sorted)
            m.setattr(selective_mod, "shard_batch", _shard_reference)
            m.setattr(naive_mod, "shard_batch", _shard_reference)
            m.setattr(common_mod, "_micro_batch", _micro_batch_reference)
            m.setattr(common_mod, "_piece", lambda s, a, b: Piece(seq=s, start=a, end=b))
            for mod in (dp_mod, naive_mod):
                m.setattr(mod, "placement", _placement_reference)
        out = []
        rng = np.random.default_rng(17)
        for _ in range(8):
            hdp = int(rng.choice([8, 12, 16, 32]))
            cap = int(rng.integers(64, 512))
            n = int(rng.integers(10, 90))
            g = int(rng.choice([2, 4]))
            pp = int(rng.choice([1, 2, 4]))
            long_ = rng.integers(cap, cap * hdp // 2 + cap + 1, n)
            lengths = np.where(rng.random(n) < 0.7, rng.integers(1, cap, n), long_).tolist()
            cm = small_cost_model(ranks_per_node=g)
            for topology in (None, _irregular(hdp, g)):
                for offload in (False, True):
                    for scheduler in ("balance", "naive"):
                        plan = make_plan(lengths, scheduler=scheduler, hdp_size=hdp, capacity=cap, cost_model=cm,
                                         pp_size=pp, offload=offload, overlong="truncate", topology=topology)
                        out.append(_fingerprint(plan))
        cm = preset_cost_model("llama-7b")
        for dataset, pp, offload, topology in (("github", 1, False, None), ("byted", 1, True, None),
                                               ("github", 1, False, _irregular(128, 8)), ("byted", 2, True, None)):
            lengths = synthetic_lengths(dataset, 4 * 2**20, seed=5, max_length=262144)
            plan = make_plan(lengths, scheduler="balance", hdp_size=128, capacity=8192, cost_model=cm,
                             pp_size=pp, offload=offload, context_length=262144, topology=topology)
            out.append(_fingerprint(plan))
        return out


def test_fast_paths_make_the_same_plans_and_estimates(monkeypatch):
    fast = _plans(monkeypatch, slow=False)
    slow = _plans(monkeypatch, slow=True)
    assert fast == slow
    assert len({f[0] for f in fast}) > len(fast) // 2  # the cases are not all one plan


@pytest.mark.parametrize("regular", [True, False], ids=["regular", "node-map"])
def test_ring_in_one_node_matches_the_sorted_view(regular):
    """:meth:`RingPlacer.compact` for rings that fit a node (partition) against the sorted view,
    on integer loads full of ties (ties go to the lower node, then the lower rank)."""
    rng = np.random.default_rng(4)
    for _ in range(60):
        g = int(rng.choice([2, 4, 8]))
        n = g * int(rng.integers(1, 9))
        topo = Topology(ranks_per_node=g) if regular else _irregular(n, g)
        placer = RingPlacer(topo, n)
        assert placer._regular == (regular and n >= g)
        for _ in range(5):
            placer.set_loads(range(n), 0.0)
            loads = rng.integers(0, 4, n).astype(float)
            for r in range(n):
                placer.set_load(r, float(loads[r]))
            for d in range(1, placer.width + 1):
                assert placer.compact(d) == placer._compact_sorted(d), (g, n, d, loads.tolist())


def test_shard_batch_matches_the_plain_version():
    cm = preset_cost_model("llama-7b")
    for offload in (False, True):
        ctx = ShardingContext(capacity=8192, layers=cm.num_layers, cost_model=cm, hdp_size=256, offload=offload)
        lengths = synthetic_lengths("github", 4 * 2**20, seed=2, max_length=524288).tolist()
        ids = np.random.default_rng(1).permutation(3 * len(lengths))[: len(lengths)].tolist()  # any ids
        assert sharding_mod.shard_batch(ids, lengths, ctx) == _shard_reference(ids, lengths, ctx)
    assert sharding_mod.shard_batch([], [], ctx) == []


def test_slot_constructors_build_equal_objects():
    make = slot_constructor(Unit, ("seqs", "lengths", "ring_size", "offload_ratio", "min_ring_size", "time"))
    a = make((3, 1), (5, 7), 2, 0.25, 1, 1.5)
    b = Unit(seqs=(3, 1), lengths=(5, 7), ring_size=2, offload_ratio=0.25, min_ring_size=1, time=1.5)
    assert a == b and hash(a) == hash(b) and a.work == b.work
    mb = slot_constructor(MicroBatch, ("order", "ring", "offload_ratio", "seqs", "pieces"))
    assert mb(4, (0, 1), 0.0, (2,), ()) == MicroBatch(order=4, ring=(0, 1), offload_ratio=0.0, seqs=(2,), pieces=())
    with pytest.raises(TypeError, match="needs 4 values, got 2"):
        slot_constructor(Unit, ("seqs", "lengths", "ring_size", "time"))((1,), (2,))


def test_micro_batch_costs_match_a_plain_loop():
    """The estimate's per-micro-batch inputs (intra-node, inter-node links, two-level groups)
    equal the topology's answer for every ring, single ranks included."""
    for two_level in (False, True):
        cm = small_cost_model(ranks_per_node=4, two_level_ring=two_level)
        lengths = np.random.default_rng(8).integers(1, 3000, 120).tolist()
        for topology in (None, _irregular(24, 4)):
            plan = make_plan(lengths, scheduler="balance", hdp_size=24, capacity=256, cost_model=cm,
                             overlong="truncate", estimate=False, topology=topology)
            topo = Topology.for_plan(plan, cm, topology)
            costs = estimate_mod.micro_batch_costs(plan, cm, topology)
            assert costs.intra_node.tolist() == [topo.ring_is_intra_node(r) for r in costs.rings]
            links = [topo.inter_node_links(r) for r in costs.rings]
            groups = [topo.two_level_group(r) if two_level and len(r) > 1 else 1 for r in costs.rings]
            assert costs.node_group.tolist() == groups
            if not two_level:
                assert costs.inter_node_bytes.tolist() == [p * k / len(r) for p, k, r in
                                                           zip(costs.p2p_bytes.tolist(), links, costs.rings)]
            assert any(len(r) == 1 for r in costs.rings) and any(k > 0 for k in links)


def test_stage_node_lists_follow_the_1f1b_ops():
    """The pipeline simulation's per-stage node lists (built by slicing) are :func:`pipeline_ops`."""
    from megatron_bytescale.planner.order import _stage_nodes, pipeline_ops

    rng = np.random.default_rng(0)
    for m in range(0, 11):
        for pp in range(1, 9):
            ids = (rng.permutation(50)[:m] * 2 * pp).tolist()
            for stage in range(pp):
                expected = [ids[i] + (pp if phase == "B" else 0) + stage for phase, i in pipeline_ops(m, pp, stage)]
                assert _stage_nodes(ids, pp, stage) == expected, (m, pp, stage)


def test_slot_constructors_give_every_field_not_passed_its_default():
    """A field added with a default later (MicroBatch.chunk, say) is set, never left unset."""
    import dataclasses

    import pytest

    from megatron_bytescale.planner.plan import MicroBatch, Piece
    from megatron_bytescale.planner.slots import slot_constructor

    make = slot_constructor(MicroBatch, ("order", "ring", "offload_ratio", "seqs", "pieces"))
    built = make(3, (0, 1), 0.0, (7,), (Piece(seq=7, start=0, end=4),))
    normal = MicroBatch(order=3, ring=(0, 1), seqs=(7,), pieces=(Piece(seq=7, start=0, end=4),))
    assert built == normal and hash(built) == hash(normal) and built.chunk is None

    @dataclasses.dataclass(frozen=True, slots=True)
    class Needs:
        a: int
        b: int

    with pytest.raises(TypeError, match="Needs.b has no plain default"):
        slot_constructor(Needs, ("a",))
