"""Topology-aware ring placement in every HDP scheduler path (balance DP and PP with their
candidates, naive, offload on and off) and its building blocks, RingPlacer and FreeRanks.

The rule (planner/schedulers/placement.py): a ring of at most ``ranks_per_node`` ranks sits on
one node, a longer one on ``ceil(D / ranks_per_node)`` nodes; only where the ranks a scheduler
may use cannot hold it that way (a node map with small nodes) on the fewest they allow."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.order import check_deadlock_free
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.placement import FreeRanks, RingPlacer
from megatron_bytescale.planner.topology import Topology
from planner_cases import small_cost_model


# --------------------------------------------------------------------------- RingPlacer by hand
def _placer(loads, topology):
    placer = RingPlacer(topology, len(loads))
    placer.set_loads(range(len(loads)), 0.0)
    for r, x in enumerate(loads):
        placer.set_loads([r], float(x))
    return placer


def test_compact_choices_by_hand():
    # nodes of 4: node 0 = ranks 0-3, node 1 = 4-7, node 2 = 8-11
    p = _placer([0, 5, 5, 5, 1, 1, 5, 5, 2, 2, 2, 5], Topology(ranks_per_node=4))
    # the two least-loaded ranks are 0 and 4 (two nodes); node 1 frees two ranks at t = 1
    assert p.compact(2) == (1.0, (4, 5))
    assert p.compact(3) == (2.0, (8, 9, 10))  # node 2's third rank frees at 2, the others' at 5
    # 6 ranks: one whole node (all free at 5: the lowest id wins) plus 2 ranks of node 1
    assert p.compact(6) == (5.0, (0, 1, 2, 3, 4, 5))
    # earliest on at most 2 nodes: ranks 0, 4, 5 are all free by t = 1
    assert p.on_nodes(3, 2) == (1.0, (0, 4, 5))
    assert p.on_nodes(13, 3) is None
    # only ranks of a count group may be used (PP-Balance)
    eligible = np.array([True] * 4 + [False] * 4 + [True] * 4)
    assert p.compact(2, eligible) == (2.0, (8, 9))
    # loads changed by the scheduler are seen at the next choice
    p.set_loads([8, 9, 10], 7.0)
    assert p.compact(3) == (5.0, (0, 1, 2))  # nodes 0 and 1 tie at 5: the lower id wins
    p.set_loads([1, 2], 6.0)
    assert p.compact(3) == (5.0, (4, 5, 6))


def test_compact_on_an_explicit_node_map():
    # two nodes, interleaved: even ranks on node 0, odd ranks on node 1
    topo = Topology.from_node_map([0, 1] * 4)
    p = _placer([0, 0, 3, 1, 3, 3, 3, 3], topo)
    assert p.compact(2) == (1.0, (1, 3))
    assert p.compact(5) == (3.0, (0, 2, 4, 6, 1))  # node 0 whole (ids 0, 2, 4, 6), then rank 1
    assert topo.inter_node_links((0, 2, 4, 6, 1)) == 2


# --------------------------------------------------------------------------- properties
def _random_batches(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        hdp = int(rng.choice([8, 12, 16, 24, 32, 64]))
        g = int(rng.choice([2, 4, 8]))
        cap = int(rng.integers(64, 512))
        n = int(rng.integers(5, 80))
        long_ = rng.integers(cap, cap * hdp // 2 + cap + 1, n)
        lengths = np.where(rng.random(n) < 0.7, rng.integers(1, cap, n), long_).tolist()
        yield lengths, hdp, g, cap, int(rng.choice([1, 1, 2]))


def _rings(plan):
    return {mb.order: mb.ring for r in plan.ranks for mb in r.micro_batches if len(mb.ring) > 1}


@pytest.mark.parametrize("scheduler", ["balance", "naive"])
@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_every_ring_sits_on_its_fewest_nodes(scheduler, offload):
    """Over 50 random batches (2-8 ranks per node, HDP sizes that are and are not multiples of
    it, PP 1 and 2): every ring that fits a node is inside one, every longer ring spans exactly
    ceil(D / g) nodes, and a ring on several nodes crosses one network link per node
    (node-contiguous order), whichever candidate balance kept."""
    cm = small_cost_model()
    fit = multi = 0
    kept = set()
    for lengths, hdp, g, cap, pp in _random_batches(50, seed=1 + offload):
        topo = Topology(ranks_per_node=g)
        plan = make_plan(lengths, scheduler=scheduler, hdp_size=hdp, capacity=cap, cost_model=cm,
                         overlong="truncate", topology=topo, pp_size=pp, offload=offload)
        plan.validate()
        kept.add(plan.meta.get("assignment"))
        for ring in _rings(plan).values():
            spans = topo.ring_nodes(ring)
            assert spans == topo.min_nodes(len(ring)), (scheduler, ring, g, hdp, pp)
            assert topo.inter_node_links(ring) == (spans if spans > 1 else 0), ring
            fit += len(ring) <= g
            multi += spans > 1
    assert fit > 150 and multi > 15, (fit, multi)
    if scheduler == "balance":  # the fallbacks were exercised too, not only the LPT/PP runs
        assert len(kept) >= 2, kept


def test_fill_candidates_follow_the_nodes():
    """Alg. 1's time-step fill (naive, and balance's fallback candidate) puts a ring on one node
    even when the lowest free ranks straddle two: rings of 3 on nodes of 4 take ranks 0-2, 4-6
    (not 3-5), and packs fill the rest; with PP the same inside count groups."""
    from collections import deque

    from megatron_bytescale.planner.schedulers.naive import fill_steps, fill_steps_aligned
    from megatron_bytescale.planner.sharding import Unit

    topo = Topology(ranks_per_node=4)
    rings = [Unit(seqs=(k,), lengths=(300,), ring_size=3, time=1.0) for k in range(3)]
    packs = deque(Unit(seqs=(10 + k,), lengths=(50,), ring_size=1, time=0.1) for k in range(3))
    placements, steps = fill_steps(8, list(rings), deque(packs), topo)
    assert [p.ring for p in placements] == [(0, 1, 2), (4, 5, 6), (3,), (7,), (0, 1, 2), (3,)]
    assert steps == 2
    # without a topology every rank is its own node: the old first fit on the lowest ranks
    blind = fill_steps(8, list(rings), deque(packs))[0]
    assert [p.ring for p in blind][:2] == [(0, 1, 2), (3, 4, 5)]
    aligned = fill_steps_aligned(8, list(rings), deque(packs), topo)[0]
    assert all(topo.ring_is_intra_node(p.ring) for p in aligned)
    assert [p.ring for p in aligned][:2] == [(0, 1, 2), (4, 5, 6)]


def test_free_ranks_by_hand():
    topo = Topology(ranks_per_node=4)  # nodes 0-3, 4-7, 8-11
    free = FreeRanks([1, 2, 3, 4, 5, 6, 7, 8, 9], topo)
    assert free.take(2, fallback=False) == [8, 9]  # best fit: node 2 has exactly 2 free
    assert free.take(6, fallback=False) == [1, 2, 4, 5, 6, 7]  # node 1 whole + 2 of node 0
    assert free.count == 1 and free.remaining() == [3]
    free = FreeRanks([2, 3, 4, 5, 8, 9], topo)  # 2 free on each node
    assert free.take(3, fallback=False) is None  # no node holds 3
    assert free.take(3, fallback=True) == [2, 3, 4]  # fewest nodes they allow: 2
    assert free.take(4, fallback=False) is None  # 4 fit one node, but no node has 4 free
    assert free.take(4, fallback=True) is None  # only 3 ranks left
    # an explicit map with small nodes: a ring of 7 on nodes of 4, 2, 2 cannot use 2 nodes
    small = Topology.from_node_map([0, 0, 0, 0, 1, 1, 2, 2])
    assert FreeRanks(range(8), small).take(7, fallback=False) is None
    assert FreeRanks(range(8), small).take(7, fallback=True) == [0, 1, 2, 3, 4, 5, 6]
    assert FreeRanks(range(8), small).take(5, fallback=False) == [0, 1, 2, 3, 4]


def test_fewest_nodes_when_no_compact_choice_exists():
    # nodes of 4, 2, 2 (largest 4): 7 ranks need 3 nodes here although 2 would do on full nodes
    small = Topology.from_node_map([0, 0, 0, 0, 1, 1, 2, 2])
    p = _placer([0, 0, 0, 0, 1, 2, 3, 0], small)
    assert p.compact(7) is None
    start, ring = p.fewest_nodes(7)
    assert small.ring_nodes(ring) == 3 and start == 2.0 and ring == (0, 1, 2, 3, 4, 5, 7)
    assert p.fewest_nodes(9) is None
    # in a count group spread over nodes (PP): the fewest nodes of the eligible ranks
    topo = Topology(ranks_per_node=4)
    p = _placer([0, 1, 2, 3, 0, 1, 2, 3], topo)
    eligible = np.array([True, True, False, False, True, True, True, False])
    assert p.compact(3, eligible) == (2.0, (4, 5, 6))
    eligible[6] = False
    assert p.compact(3, eligible) is None
    assert p.fewest_nodes(3, eligible) == (1.0, (0, 1, 4))
    # a ring over several nodes: whole nodes first, or an earlier start on as few nodes
    p = _placer([0, 0, 0, 9, 0, 0, 0, 9, 5, 5, 5, 5], topo)
    assert p.compact(6) == (5.0, (0, 1, 8, 9, 10, 11))  # node 2 whole, 2 ranks of node 0
    assert p.fewest_nodes(6) == (0.0, (0, 1, 2, 4, 5, 6))


def test_placement_follows_an_explicit_node_map():
    """Same batch on 4 nodes of 4, once numbered node by node and once with the nodes
    interleaved (rank r on node r % 4): every ring that fits a node stays inside one, the plans
    are valid, deadlock-free and deterministic."""
    lengths = synthetic_lengths("github", 600_000, seed=2, max_length=65536)
    cm = small_cost_model(ranks_per_node=4)
    kw = dict(scheduler="balance", hdp_size=16, capacity=2048, cost_model=cm, overlong="truncate")
    shuffled = Topology.from_node_map([r % 4 for r in range(16)])
    results = []
    for topo in (Topology(ranks_per_node=4), shuffled):
        plan = make_plan(lengths, topology=topo, **kw)
        plan.validate()
        check_deadlock_free(plan)
        assert make_plan(lengths, topology=topo, **kw).content_hash() == plan.content_hash()
        rings = {mb.order: mb.ring for r in plan.ranks for mb in r.micro_batches if len(mb.ring) > 1}
        small = [r for r in rings.values() if len(r) <= 4]
        results.append(sum(topo.ring_is_intra_node(r) for r in small) / len(small))
        assert plan.estimate.extra["rings_within_one_node"] == sum(topo.ring_is_intra_node(r) for r in small)
    assert results == [1.0, 1.0], results


STANDARD = [  # (dataset, context, offload, pp): offload off is training's default
    ("github", 262144, False, 1), ("byted", 262144, False, 1),
    ("github", 262144, True, 1), ("byted", 262144, True, 1),
    ("github", 2097152, False, 1), ("byted", 2097152, True, 1),
    ("github", 262144, False, 2), ("byted", 262144, False, 2),
]


@pytest.mark.parametrize("dataset,context,offload,pp", STANDARD,
                         ids=[f"{d}-{c // 1024}K-offload{int(o)}-pp{p}" for d, c, o, p in STANDARD])
def test_balance_is_unchanged_by_topology_on_the_standard_batches(dataset, context, offload, pp):
    """32M-token batches, 1,024 ranks, C = 8K, LLaMA-7B on 8-GPU nodes, offload off and on, DP
    and PP 2: every ring that fits a node is in one and none is on more nodes than it needs
    (with offload off the load-only plans straddle 57-94 rings that fit a node), and the
    topology-aware plan's step is within 2 % of the load-only plan's (both costed on the real
    nodes)."""
    from megatron_bytescale.planner.estimate import estimate_plan

    cm = preset_cost_model("llama-7b")
    lengths = synthetic_lengths(dataset, 32 * 2**20, seed=0, max_length=context)
    kw = dict(scheduler="balance", hdp_size=1024, capacity=8192, cost_model=cm, context_length=context,
              estimate=False, offload=offload, pp_size=pp)
    nodes = Topology(ranks_per_node=8)
    aware = estimate_plan(make_plan(lengths, topology=nodes, **kw), cm, nodes)
    blind = estimate_plan(make_plan(lengths, topology=Topology(ranks_per_node=1), **kw), cm, nodes)
    assert aware.step_time_s <= 1.02 * blind.step_time_s
    x = aware.extra
    assert x["rings_within_one_node"] == x["rings_fitting_one_node"] > 0
    assert x["rings_over_min_nodes"] == 0
    assert blind.extra["rings_over_min_nodes"] > 0  # the load-only plan does straddle
    assert x["inter_node_p2p_bytes"] < blind.extra["inter_node_p2p_bytes"]
