"""Topology-aware ring placement in the balance scheduler (and its building block, RingPlacer)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.order import check_deadlock_free
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.placement import RingPlacer
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


def test_small_rings_stay_in_one_node_and_long_rings_on_few_nodes():
    """Over 300 random batches (2-8 ranks per node, PP 1 and 2): >= 95 % of the rings that fit
    a node sit in one; under DP-Balance no ring spans more than ceil(D / g) + 1 nodes, and a ring
    on several nodes crosses one network link per node (node-contiguous order)."""
    cm = small_cost_model()
    fit = inside = 0
    for lengths, hdp, g, cap, pp in _random_batches(300):
        topo = Topology(ranks_per_node=g)
        plan = make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=cap, cost_model=cm,
                         overlong="truncate", topology=topo, pp_size=pp)
        plan.validate()
        rings = {mb.order: mb.ring for r in plan.ranks for mb in r.micro_batches if len(mb.ring) > 1}
        for ring in rings.values():
            spans = topo.ring_nodes(ring)
            if len(ring) <= g:
                fit += 1
                inside += spans == 1
            if pp == 1 and plan.meta["assignment"].startswith("lpt"):
                assert spans <= topo.min_nodes(len(ring)) + 1, (ring, g)
                assert topo.inter_node_links(ring) == (spans if spans > 1 else 0), ring
    assert fit > 1500
    assert inside / fit >= 0.95, (inside, fit)


def test_placement_follows_an_explicit_node_map():
    """Same batch on 4 nodes of 4, once numbered node by node and once with the nodes
    interleaved (rank r on node r % 4): about the same share of rings stays inside a node (64
    rings on 16 ranks: late rings sometimes cannot wait for one node), the plans are valid,
    deadlock-free and deterministic."""
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
    assert min(results) >= 0.85 and abs(results[0] - results[1]) <= 0.05, results


@pytest.mark.parametrize("dataset,context", [("github", 262144), ("byted", 262144),
                                             ("github", 2097152), ("byted", 2097152)])
def test_balance_is_unchanged_by_topology_on_the_standard_batches(dataset, context):
    """32M-token batches, 1,024 ranks, C = 8K, LLaMA-7B on 8-GPU nodes: the topology-aware plan's
    step is within 2 % of the load-only plan's (both costed on the real nodes), every ring that
    fits a node is in one, and none is on more nodes than it needs."""
    cm = preset_cost_model("llama-7b")
    lengths = synthetic_lengths(dataset, 32 * 2**20, seed=0, max_length=context)
    kw = dict(scheduler="balance", hdp_size=1024, capacity=8192, cost_model=cm, context_length=context,
              estimate=False)
    from megatron_bytescale.planner.estimate import estimate_plan

    nodes = Topology(ranks_per_node=8)
    aware = estimate_plan(make_plan(lengths, topology=nodes, **kw), cm, nodes)
    blind = estimate_plan(make_plan(lengths, topology=Topology(ranks_per_node=1), **kw), cm, nodes)
    assert aware.step_time_s <= 1.02 * blind.step_time_s
    x = aware.extra
    assert x["rings_within_one_node"] == x["rings_fitting_one_node"] > 0
    assert x["rings_over_min_nodes"] == 0
    assert blind.extra["rings_over_min_nodes"] > 0  # the load-only plan does straddle
    assert x["inter_node_p2p_bytes"] < blind.extra["inter_node_p2p_bytes"]
