"""DP-Balance's assignment (step 3 of :mod:`.balance`): LPT list scheduling with backfilling,
rings on the least-loaded ranks of the fewest nodes."""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Iterable, Sequence

from ..sharding import ShardingContext, Unit
from ._common import Placement, placement
from .placement import RingPlacer

def makespan(placements: Sequence[Placement], units: Sequence[Unit], ctx: ShardingContext, n: int) -> float:
    """Finish time of ``placements`` run in order, rings starting when all members are free."""
    out = makespan_below([placements], units, ctx, n, math.inf)
    return out[1] if out is not None else math.inf  # never None: nothing reaches inf


def makespan_below(steps: Iterable[Sequence[Placement]], units: Sequence[Unit], ctx: ShardingContext, n: int,
                   limit: float) -> tuple[list[Placement], float] | None:
    """The placements of ``steps`` (concatenated) and their :func:`makespan`, or None as soon as
    some rank's finish reaches ``limit`` (the makespan would be at least that: a candidate
    that cannot beat ``limit`` is dropped before the rest of its steps are even made)."""
    by_seqs = {u.seqs: u for u in units}
    free = [0.0] * n  # Python floats: the same sums as a numpy array, without a numpy call per unit
    placements: list[Placement] = []
    for step in steps:
        for p in step:
            u = by_seqs[p.seqs]
            ring = p.ring
            if len(ring) == 1:
                end = free[ring[0]] + u.time
                free[ring[0]] = end
            else:
                end = max([free[r] for r in ring]) + ctx.placed_time(u, ring)
                for r in ring:
                    free[r] = end
            if end >= limit:
                return None
        placements += step
    return placements, (max(free) if n else 0.0)


def dp_balance(units: Sequence[Unit], ctx: ShardingContext, n: int) -> tuple[list[Placement], float]:
    """LPT with backfilling: each unit (heaviest first) on its D least-loaded ranks.

    A ring starts when its slowest member is free; the other members would idle until then.
    Those idle intervals are kept as *holes*, and a later single-rank unit that fits one runs
    there (best fit: the smallest hole that holds it) instead of at the end of the least-loaded
    rank. The placements come back sorted by start time, so every rank's run order is its time
    order and the global order stays consistent for rings (D5).

    Topology (:mod:`.placement`): a ring whose least-loaded ranks span more nodes than its size
    needs takes the compact choice instead (one node for a ring that fits one, else the fewest
    nodes, whole nodes where it can). Members are ordered node by node.
    Returns the placements and their makespan (the estimate's step time for PP = 1).
    """
    placer = RingPlacer(ctx.nodes, n)
    loads = placer.loads
    cur = [0.0] * n  # loads as Python floats: the heap's liveness test reads them per pop
    heap = [(0.0, r) for r in range(n)]  # lazy: an entry is live iff its load == cur[rank]
    pop, push = heapq.heappop, heapq.heappush
    holes = _Holes()
    timed: list[tuple[float, int, Placement]] = []
    for index, u in enumerate(units):
        d = u.ring_size
        if d == 1:
            hole = holes.take(u.time)
            if hole is not None:
                start, rank = hole
            else:
                while True:
                    t, rank = pop(heap)
                    if t == cur[rank]:
                        break
                start = cur[rank]
                end = start + u.time
                cur[rank] = end
                placer.set_load(rank, end)
                push(heap, (end, rank))
            timed.append((start, index, placement((rank,), u.seqs, u.offload_ratio)))
            continue
        picked: list[int] = []
        while len(picked) < d:
            t, r = pop(heap)
            if t == cur[r] and r not in picked:
                picked.append(r)
        start, ring, t_u = _place_ring(u, picked, placer, ctx, cur)
        for r in ring:
            holes.add(cur[r], start, r)
        end = start + t_u
        members = set(ring)
        for r in picked:
            if r not in members:
                push(heap, (cur[r], r))
        placer.set_loads(ring, end)
        for r in ring:
            cur[r] = end
            push(heap, (end, r))
        timed.append((start, index, placement(ring, u.seqs, u.offload_ratio)))
    timed.sort()  # by start, then unit index (unique: the placements are never compared)
    return [p for _, _, p in timed], float(loads.max()) if n else 0.0


def _place_ring(u: Unit, picked: list[int], placer: RingPlacer, ctx: ShardingContext, cur: list[float]
                ) -> tuple[float, tuple[int, ...], float]:
    """``(start, ring, time)`` of unit ``u``: the load-only ``picked`` ranks when they already
    sit on the fewest nodes (then no compact ring starts earlier), else
    :meth:`.placement.RingPlacer.fewest_nodes` over all ranks (see :func:`dp_balance`).
    ``cur``: every rank's load as Python floats (the placer's loads, read without numpy).
    A ring that fits the largest node sits on one node or takes :meth:`~.placement.RingPlacer.compact`
    directly: what ``fewest_nodes`` returns for it (never None: every rank is eligible)."""
    topo = placer.topology
    d = len(picked)
    ring = topo.node_contiguous(picked)
    start = max(map(cur.__getitem__, ring))
    if d <= placer.width:
        if not topo.ring_is_intra_node(ring):
            start, ring = placer.compact(d)
        return start, ring, ctx.placed_time(u, ring)
    if not placer.spans_min_nodes(ring):
        choice = placer.fewest_nodes(d, earliest=start)
        if choice is not None:  # None only if there are fewer than len(picked) ranks
            return choice[0], choice[1], ctx.placed_time(u, choice[1])
    return start, ring, ctx.placed_time(u, ring)


class _Holes:
    """Idle intervals of ranks waiting for a ring, searchable by length (best fit)."""

    def __init__(self) -> None:
        self._by_length: list[tuple[float, float, int]] = []  # (length, start, rank), sorted

    def add(self, start: float, end: float, rank: int) -> None:
        if end - start > 1e-12 * max(1.0, end):
            bisect.insort(self._by_length, (end - start, start, rank))

    def take(self, duration: float) -> tuple[float, int] | None:
        """Start and rank of the smallest hole that holds ``duration``; the rest stays a hole."""
        k = bisect.bisect_left(self._by_length, (duration, -math.inf, -1))
        if k == len(self._by_length):
            return None
        length, start, rank = self._by_length.pop(k)
        self.add(start + duration, start + length, rank)
        return start, rank
