"""RingPlacer's choices against a plain-Python reference, and the cases the reference and the
by-hand tests in test_topology_placement.py do not reach: loads full of ties (the rule "ties go
to the lower node id, then the lower rank" decides), loads set one rank at a time, nodes
shorter than ``ranks_per_node``, a compact choice that ties with the earliest-start one, and
rings the eligible ranks cannot hold on ``ceil(D / ranks_per_node)`` nodes."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.schedulers.placement import FreeRanks, RingPlacer
from megatron_bytescale.planner.topology import Topology


# --------------------------------------------------------------------------- reference
def _nodes(topo: Topology, n: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in range(n):
        out.setdefault(topo.node(r), []).append(r)
    return dict(sorted(out.items()))


def _free_first(ranks, loads, ok):
    """Eligible ranks by (load, rank)."""
    return sorted((r for r in ranks if ok[r]), key=lambda r: (loads[r], r))


def _result(topo, loads, members):
    return float(max(loads[r] for r in members)), topo.node_contiguous(members)


def ref_compact(topo, loads, d, ok):
    nodes, g = _nodes(topo, len(loads)), topo.ranks_per_node
    if d <= g:
        best = None
        for label, ranks in nodes.items():
            free = _free_first(ranks, loads, ok)
            if len(free) >= d and (best is None or loads[free[d - 1]] < best[0]):
                best = (loads[free[d - 1]], free[:d])
        return None if best is None else _result(topo, loads, best[1])
    whole, rest = divmod(d, g)
    full = [(max(loads[r] for r in ranks), label) for label, ranks in nodes.items()
            if len(ranks) == g and all(ok[r] for r in ranks)]
    picks = [label for _, label in sorted(full)[:whole]]
    if len(picks) < whole:
        return None
    members = [r for label in picks for r in nodes[label]]
    if rest:
        best = None
        for label, ranks in nodes.items():
            free = _free_first(ranks, loads, ok)
            if label not in picks and len(free) >= rest and (best is None or loads[free[rest - 1]] < best[0]):
                best = (loads[free[rest - 1]], free[:rest])
        if best is None:
            return None
        members += best[1]
    return _result(topo, loads, members)


def ref_on_nodes(topo, loads, d, num_nodes, ok):
    nodes = _nodes(topo, len(loads))
    for s in sorted({loads[r] for r in range(len(loads)) if ok[r]}):
        counts = {label: sum(1 for r in ranks if ok[r] and loads[r] <= s) for label, ranks in nodes.items()}
        if sum(sorted(counts.values(), reverse=True)[:num_nodes]) < d:
            continue
        members: list[int] = []
        for label in sorted(nodes, key=lambda k: (-counts[k], k)):  # fullest first, then node id
            take = min(counts[label], d - len(members))
            members += _free_first(nodes[label], loads, ok)[:take]
        return _result(topo, loads, members)
    return None


def _placer_one_by_one(topo, loads):
    """A placer whose loads were set the way list scheduling sets them: one rank at a time,
    with choices made in between (so rows are re-sorted after each batch of changes)."""
    p = RingPlacer(topo, len(loads))
    for r, x in enumerate(loads):
        p.set_load(r, float(x))
        if r % 5 == 4:
            p.compact(1)
    return p


TOPOLOGIES = [
    Topology(ranks_per_node=8),
    Topology(ranks_per_node=4),
    Topology.from_node_map([r % 3 for r in range(24)]),  # interleaved nodes of 8
    Topology.from_node_map([0] * 3 + [1] * 8 + [2] * 8 + [3] * 5),  # short first and last nodes
]


# --------------------------------------------------------------------------- properties
@pytest.mark.parametrize("case", range(len(TOPOLOGIES)))
def test_compact_and_on_nodes_match_the_reference_on_tied_loads(case):
    """Loads drawn from three values: nearly every choice has ties, at the d-th rank of a node
    and between nodes, which only the tie rule decides."""
    topo = TOPOLOGIES[case]
    n = len(topo.node_of) if topo.node_of is not None else 24
    rng = np.random.default_rng(case)
    for trial in range(12):
        loads = rng.integers(0, 3, size=n).tolist()
        p = _placer_one_by_one(topo, loads)
        assert p.loads.tolist() == [float(x) for x in loads]
        masks = [None, rng.random(n) < 0.75]
        for eligible in masks:
            ok = [True] * n if eligible is None else eligible.tolist()
            for d in range(1, n + 1):
                assert p.compact(d, eligible) == ref_compact(topo, loads, d, ok), (trial, d, eligible)
                for k in (1, 2, 3):
                    got = p.on_nodes(d, k, eligible)
                    assert got == ref_on_nodes(topo, loads, d, k, ok), (trial, d, k, eligible)
                    if got is not None:
                        assert len(got[1]) == d and len(set(got[1])) == d
                        assert topo.ring_nodes(got[1]) <= k


def test_loads_set_one_rank_at_a_time_are_seen():
    topo = Topology(ranks_per_node=2)
    p = RingPlacer(topo, 6)
    assert p.compact(2) == (0.0, (0, 1))
    p.set_load(0, 5.0)
    p.set_load(1, 4.0)
    p.set_load(3, 1.0)
    assert p.loads.tolist() == [5.0, 4.0, 0.0, 1.0, 0.0, 0.0]
    assert p.compact(2) == (0.0, (4, 5))
    assert p.compact(1) == (0.0, (2,))
    p.set_load(4, 2.0)
    assert p.compact(2) == (1.0, (2, 3))


def test_nodes_shorter_than_ranks_per_node():
    """A node with fewer ranks than the largest one cannot hold a ring that needs more, but
    must not stop the choice on the others."""
    short_last = Topology(ranks_per_node=4)  # 6 ranks: node 0 = 0-3, node 1 = 4-5
    p = RingPlacer(short_last, 6)
    p.set_loads([0, 1, 2, 3], 5.0)
    assert p.compact(2) == (0.0, (4, 5))
    assert p.compact(3) == (5.0, (0, 1, 2))
    assert p.compact(6) == (5.0, (0, 1, 2, 3, 4, 5))
    short_first = Topology.from_node_map([0, 0, 1, 1, 1, 1])
    q = RingPlacer(short_first, 6)
    q.set_loads([2, 3, 4, 5], 1.0)
    assert q.compact(2) == (0.0, (0, 1))
    assert q.compact(3) == (1.0, (2, 3, 4))
    assert q.compact(5, np.array([True] * 6)) == (1.0, (0, 2, 3, 4, 5))  # node by node
    assert q.fewest_nodes(3) == (1.0, (2, 3, 4))


def test_spans_min_nodes():
    p = RingPlacer(Topology(ranks_per_node=4), 12)
    assert p.spans_min_nodes((0, 1, 2, 3))
    assert p.spans_min_nodes((5,))
    assert p.spans_min_nodes((2, 3, 4, 5, 6))  # 5 ranks on 2 nodes: the fewest
    assert not p.spans_min_nodes((3, 4))
    assert not p.spans_min_nodes((0, 4, 8, 9, 10))


# --------------------------------------------------------------------------- fewest_nodes
def test_fewest_nodes_ties_go_to_the_lower_node():
    """Both nodes free two ranks at t = 5; node 1 has more ranks free by then, but the rule
    gives the ring to the lower node id."""
    p = RingPlacer(Topology(ranks_per_node=4), 8)
    p.set_loads(range(8), 0.0)
    for r, x in enumerate([0, 5, 9, 9, 0, 5, 5, 9]):
        p.set_load(r, float(x))
    assert p.fewest_nodes(2) == (5.0, (0, 1))
    assert p.compact(2) == (5.0, (0, 1))


def test_fewest_nodes_keeps_the_compact_choice_unless_another_starts_earlier():
    """A ring of 3 on nodes of 2: the compact choice (whole node 0 plus rank 4) and the
    earliest start on 2 nodes (nodes 0 and 1) both start at 5; the compact one is kept."""
    p = RingPlacer(Topology(ranks_per_node=2), 6)
    p.set_loads(range(6), 0.0)
    for r, x in enumerate([0, 5, 5, 5, 0, 9]):
        p.set_load(r, float(x))
    assert p.compact(3) == (5.0, (0, 1, 4))
    assert p.on_nodes(3, 2) == (5.0, (0, 1, 2))  # as early, other members
    assert p.fewest_nodes(3) == (5.0, (0, 1, 4))
    # where the search on the fewest nodes starts earlier, it wins: nodes of 4, a ring of 5
    q = RingPlacer(Topology(ranks_per_node=4), 12)
    for r, x in enumerate([0, 0, 0, 9, 0, 0, 9, 9, 9, 9, 9, 9]):
        q.set_load(r, float(x))
    assert q.compact(5) == (9.0, (0, 1, 2, 3, 4))  # a whole node frees at 9
    assert q.fewest_nodes(5) == (0.0, (0, 1, 2, 4, 5))  # 3 + 2 ranks on 2 nodes at 0


def test_fewest_nodes_without_a_compact_choice_takes_the_fewest_nodes_allowed():
    """Nodes of 4 with 3, 3 and 1 eligible ranks: no whole node, so a ring of 6 has no compact
    choice. Two nodes can hold it (3 + 3), and it must stay on two, even though a third node
    would let it start earlier."""
    topo = Topology(ranks_per_node=4)
    p = RingPlacer(topo, 12)
    p.set_loads(range(12), 0.0)
    p.set_load(6, 10.0)
    eligible = np.array([True, True, True, False, True, True, True, False, True, False, False, False])
    assert p.compact(6, eligible) is None
    assert p.on_nodes(6, 3, eligible)[0] == 0.0  # three nodes would start at 0
    start, ring = p.fewest_nodes(6, eligible)
    assert (start, ring) == (10.0, (0, 1, 2, 4, 5, 6))
    assert topo.ring_nodes(ring) == 2
    # a ring of 7 needs all three nodes; a ring of 8 cannot be held
    assert p.fewest_nodes(7, eligible) == (10.0, (0, 1, 2, 4, 5, 6, 8))
    assert p.fewest_nodes(8, eligible) is None


# --------------------------------------------------------------------------- FreeRanks.take
def test_free_ranks_take_whole_nodes_then_the_best_fit_for_the_rest():
    """Nodes of 4 with 4, 3 and 2 free ranks: a ring of 6 takes the free node and the node with
    exactly 2 free (best fit), not the fuller one; a ring of 3 takes the node with exactly 3."""
    topo = Topology(ranks_per_node=4)
    free = [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert FreeRanks(free, topo).take(6, fallback=False) == [0, 1, 2, 3, 8, 9]
    assert FreeRanks(free, topo).take(3, fallback=False) == [4, 5, 6]
    assert FreeRanks(free, topo).take(2, fallback=False) == [8, 9]


def test_free_ranks_take_the_fewest_nodes_without_a_free_node():
    """Nodes with 3, 3 and 1 free ranks: a ring of 6 fits the two fuller nodes, the fewest a ring
    of 6 can use (2), so it is taken even without the fallback; a ring of 7 needs a third node."""
    topo = Topology(ranks_per_node=4)
    free = [0, 1, 2, 4, 5, 6, 8]
    assert FreeRanks(free, topo).take(6, fallback=False) == [0, 1, 2, 4, 5, 6]
    assert FreeRanks(free, topo).take(7, fallback=False) is None
    assert FreeRanks(free, topo).take(7, fallback=True) == [0, 1, 2, 4, 5, 6, 8]


def test_compact_in_a_node_matches_the_sorted_reference_on_wide_nodes():
    """Nodes of 64 ranks with random loads: the partition path picks what the sorted view picks
    for every ring size that fits a node."""
    rng = np.random.default_rng(5)
    topo = Topology(ranks_per_node=64)
    p = RingPlacer(topo, 256)
    p.set_loads(range(256), 0.0)
    for r, v in enumerate(rng.random(256)):
        p.set_load(r, float(v))
    everyone = np.ones(256, dtype=bool)
    for d in range(1, 65):
        assert p.compact(d) == p.compact(d, everyone), d


def test_compact_in_a_node_reads_each_nodes_dth_smallest_load():
    """Node 0's loads descend (5 .. 0): its third smallest is 2, below node 1's 2.5 (and below
    node 0's third-placed 3), so a ring of 3 starts at 2 on node 0's three least-loaded ranks."""
    p = RingPlacer(Topology(ranks_per_node=6), 12)
    for r, v in enumerate([5, 4, 3, 2, 1, 0, 2.5, 2.5, 2.5, 9, 9, 9]):
        p.set_load(r, float(v))
    assert p.compact(3) == (2.0, (3, 4, 5))


# --------------------------------------------------------------------------- from a sorted rank list
@pytest.mark.parametrize("case", range(len(TOPOLOGIES) + 1))
def test_choices_from_a_sorted_rank_list_match_the_masked_view(case):
    """PP-Balance asks ``fewest_nodes_ranked`` with a count group's ``(load, rank)`` list; it
    must choose exactly what ``fewest_nodes`` chooses with that group as the eligible mask (and
    its compact choice and search on nodes what ``compact`` and ``on_nodes`` do), on tied loads,
    interleaved and short nodes, and groups of every density."""
    topo = TOPOLOGIES[case] if case < len(TOPOLOGIES) else Topology(ranks_per_node=2)
    n = len(topo.node_of) if topo.node_of is not None else 24
    rng = np.random.default_rng(100 + case)
    for trial in range(10):
        loads = rng.integers(0, 3 if trial % 2 else 6, size=n).tolist()
        p = _placer_one_by_one(topo, loads)
        for density in (1.0, 0.75, 0.4):
            eligible = rng.random(n) < density
            ranked = sorted((float(loads[r]), r) for r in range(n) if eligible[r])
            for d in range(1, len(ranked) + 1):
                assert p._compact_ranked(d, ranked) == p.compact(d, eligible), (trial, density, d)
                for k in (1, 2, 3):
                    assert p._on_nodes_ranked(d, k, ranked) == p.on_nodes(d, k, eligible), (trial, density, d, k)
                dth = ranked[d - 1][0]
                for earliest in (-np.inf, dth, dth + 1):
                    got = p.fewest_nodes_ranked(d, ranked, earliest=earliest)
                    assert got == p.fewest_nodes(d, eligible, earliest=earliest), (trial, density, d, earliest)
            assert p.fewest_nodes_ranked(len(ranked) + 1, ranked) is None
