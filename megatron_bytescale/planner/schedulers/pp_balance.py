"""PP-Balance's assignment (step 4 of :mod:`.balance`): rings aligned by count groups, runs of
single-rank units, and the reorderings that fill the longest ring's 1F1B window (the floors
that let ``balance`` skip hopeless candidates are in :mod:`.pp_floors`)."""

from __future__ import annotations

import bisect
from itertools import chain
from typing import Mapping, Sequence

import numpy as np

from ..sharding import ShardingContext, Unit
from ._common import Placement, placement, split_equal_work
from .placement import RingPlacer


def pp_balance(units: Sequence[Unit], ctx: ShardingContext, n: int, *, delta: float,
               num_buckets: int, fill_drain: int = 0, window: int = 0,
               isolated: Sequence[Unit] = (), layer_cap: float = 0.0) -> list[Placement]:
    """Rings aligned by count groups (widest first), then runs of single-rank units, taken in
    the order of ``units`` (``balance`` passes them longest first, :func:`._common.unit_sort_key`).

    A pipeline's load is its stage work plus ``fill_drain`` times its longest micro-batch: with
    ``fill_drain = pp_size - 1`` that is the 1F1B fill and drain (while a long micro-batch
    crosses the other stages forward and back, a stage only runs its few in-flight neighbours),
    so pipelines in a long ring take less other work; 0 balances stage work alone. With
    ``window = pp_size - 1`` instead, the load is the stage work plus the idle floor of the
    longest micro-batch with the next ``2 window`` in its 1F1B window (:class:`PipelineLoad`):
    the fill-and-drain load charges a pipeline of a long ring in full for the micro-batches
    that would hide in that window, and so gives it too little.

    ``isolated`` rings (:func:`.pp_isolate.dominant_rings`) go first, each on contiguous ranks of
    its own from the top of ``0 .. n - 1`` down (a block of ``D`` contiguous ranks spans the
    fewest nodes or one more) after one layer of micro-batches of at most ``layer_cap`` seconds
    (:func:`_place_isolated`); the other rings and the runs then use only the ranks below.
    """
    load = PipelineLoad(n, fill_drain, window, ctx.cost_model.forward_fraction)
    placements, top, taken = _place_isolated(isolated, units, n, layer_cap)
    rings = [u for u in units if u.ring_size > 1 and u.seqs not in taken]
    placements += _place_rings_aligned(rings, ctx, RingPlacer(ctx.nodes.first(top), top), load, top)
    singles = [u for u in units if u.ring_size == 1 and u.seqs not in taken]
    placements += _place_runs(singles, load, delta=delta, num_buckets=num_buckets,
                              pipelines=top if isolated else None)
    return placements


class PipelineLoad:
    """Per-pipeline load for PP-Balance: stage work + ``fill_drain`` x longest micro-batch, or,
    with ``window`` > 0, stage work + the window floor (:meth:`floor_after`).

    A micro-batch of stage time ``t`` adds ``t + fill_drain * max(0, t - longest)`` to its
    pipeline's load and raises the pipeline's longest to ``t`` if longer. Both placement loops
    apply that update inline (same float operations): it runs once per ring member and per
    single-rank unit, thousands of times per candidate. Python lists: they index faster than
    numpy arrays one element at a time. The window load goes through :meth:`add` (it keeps the
    pipeline's ``2 window + 1`` longest stage times)."""

    def __init__(self, n: int, fill_drain: int, window: int, forward_fraction: float) -> None:
        self.loads = [0.0] * n
        self.longest = [0.0] * n
        self.fill_drain = fill_drain
        self.window = window
        if window:
            self.work = [0.0] * n
            self.top: list[list[float]] = [[] for _ in range(n)]
            self.big = max(forward_fraction, 1.0 - forward_fraction)
            self.small = 1.0 - self.big

    def floor_after(self, r: int, t: float) -> float:
        """Pipeline ``r``'s load once a micro-batch of stage time ``t`` joins it: its stage work
        plus the 1F1B idle of its longest micro-batch ``t_1`` (``window = pp - 1``),
        ``window * t_1`` less the larger share (``max(f, 1 - f)``) of the next ``window``
        longest and the smaller share of the ``window`` after them: the term ``k = 1`` of
        :func:`..pipeline_floor.idle_floor`, what an order that puts the longest between
        them reaches."""
        return self._after(r, t)[0]

    def add(self, r: int, t: float) -> None:
        """Put a micro-batch of stage time ``t`` on pipeline ``r`` (the window load: the load
        :meth:`floor_after` gives, with the new longest stage times kept)."""
        self.loads[r], top = self._after(r, t)
        if top is not None:
            self.top[r] = top
        self.work[r] += t

    def _after(self, r: int, t: float) -> tuple[float, list[float] | None]:
        """(the load with ``t`` added, the new longest stage times or None when ``t`` falls
        outside them)."""
        w = self.window
        top = self.top[r]
        if len(top) > 2 * w and t <= top[-1]:  # outside the window: the idle stays
            return self.loads[r] + t, None
        top = sorted(top + [t], reverse=True)[:2 * w + 1]
        # never negative: each of the other 2 w is at most top[0], and the shares add up to 1
        return (self.work[r] + t + w * top[0] - self.big * sum(top[1:w + 1])
                - self.small * sum(top[w + 1:])), top


def _place_isolated(isolated: Sequence[Unit], units: Sequence[Unit], n: int,
                    cap: float) -> tuple[list[Placement], int, set[tuple[int, ...]]]:
    """Each ``isolated`` ring on the block of contiguous ranks below the previous one's, from
    ``n`` down, after one layer of micro-batches of at most ``cap`` seconds that covers its
    block: the longest other rings that fit what is left of it, then the longest single-rank
    units, one per rank (a block the units cannot cover gets no layer: every member of a ring
    must have run as many micro-batches before it). Such a layer is the one micro-batch per
    member that hides the larger share of its time in the ring's 1F1B window (at PP 2 it costs
    a third of its time there, against all of it on another pipeline), and it takes rings that
    would otherwise load the other pipelines unevenly; the cap keeps the ring's members from
    waiting on a long one. Returns the placements (the layers first), the lowest rank taken and
    the units placed. (No load is kept for these pipelines: nothing else goes to them.)"""
    taken: set[tuple[int, ...]] = set()
    if not isolated:
        return [], n, taken
    taken.update(u.seqs for u in isolated)
    others = [u for u in units if u.ring_size > 1 and u.seqs not in taken]
    others.sort(key=lambda u: (-u.time, u.seqs[0]))
    singles = [u for u in units if u.ring_size == 1 and u.time <= cap]  # longest first, as ``units``
    next_single = 0
    layers: list[tuple[Unit, tuple[int, ...]]] = []
    rings: list[tuple[Unit, tuple[int, ...]]] = []
    top = n
    for big in isolated:
        lo = top - big.ring_size
        layer, cursor, used = [], lo, 0
        for u in others:
            if u.seqs not in taken and u.ring_size <= top - cursor and u.time <= cap:
                layer.append((u, tuple(range(cursor, cursor + u.ring_size))))
                cursor += u.ring_size
        while cursor < top and next_single + used < len(singles):
            layer.append((singles[next_single + used], (cursor,)))
            cursor, used = cursor + 1, used + 1
        if cursor == top:
            layers += layer
            taken.update(u.seqs for u, _ in layer)
            next_single += used
        rings.append((big, tuple(range(lo, top))))
        top = lo
    placements = [Placement(ring=ring, seqs=u.seqs, offload_ratio=u.offload_ratio) for u, ring in layers + rings]
    return placements, top, taken


def _place_rings_aligned(rings: list[Unit], ctx: ShardingContext, placer: RingPlacer,
                         pipeline_load: PipelineLoad, ranks: int | None = None) -> list[Placement]:
    """Each ring (widest first) on ranks of one count group, on the fewest nodes: the group
    whose fewest-nodes choice (:meth:`.placement.RingPlacer.fewest_nodes`) starts first among
    those that hold the ring on ``ceil(D / ranks_per_node)`` nodes (fewer micro-batches on a
    tie). Such a group always exists on a regular topology: the ranks of the previous (wider)
    ring form one. Only if none does (a node map with small nodes) does the ring take the fewest
    nodes any group allows.

    Groups are tried in the order of their lower bound ``(0, d-th smallest load, count)``, and
    the search stops at the first whose bound is not below the best score so far: every choice
    in a group spans at least the fewest nodes (extra nodes >= 0) and starts no earlier than the
    group's d-th smallest load (it starts at its d members' latest load), so no score in that
    group or a later one is lower. Scores differ in the count, so the minimum does not depend
    on the order the groups are tried in.

    Each group is kept as its ranks' ``(load, rank)`` pairs, sorted, so a group's bound and its d
    least-loaded ranks are read off the front of its list, and the fewest-nodes choice walks the
    list (:meth:`.placement.RingPlacer.fewest_nodes_ranked`, the same choice as ``fewest_nodes``
    with the group as the eligible mask) instead of sorting a masked view of every node.

    Only ranks ``0 .. ranks - 1`` (default all) take rings."""
    load = pipeline_load.loads
    longest = pipeline_load.longest
    fd = pipeline_load.fill_drain
    window = pipeline_load.window
    n = len(load)
    topo = placer.topology
    row_of = placer.row_of  # rank -> node row: the nodes a choice spans
    # count -> the ranks that have run that many micro-batches, as (load, rank) pairs sorted: the
    # group's d-th smallest load is entry d - 1 and its d least-loaded ranks (ties by rank) the
    # first d. Only ring members change load here, and each moves one group up.
    groups: dict[int, list[tuple[float, int]]] = {0: sorted(zip(load, range(n if ranks is None else ranks)))}
    # a group's choice for a ring size depends only on its list: kept per group with the ring
    # placement that last changed the group, it is reused while the group stays as it was (rings
    # of one size come one after another, and each changes only two groups)
    changed: dict[int, int] = {0: 0}  # group -> the ring placement that last changed it
    searched: dict[int, tuple] = {}  # group -> (changed, d, start, members, extra nodes, front)
    placements: list[Placement] = []
    for u in sorted(rings, key=lambda x: (-x.ring_size, -x.time, x.seqs[0])):
        d = u.ring_size
        fewest = topo.min_nodes(d)
        # (score, members, whether they are their group's d least-loaded)
        best: tuple[tuple[int, float, int], list[int], bool] | None = None
        # (d-th smallest load, count) of every group that holds d
        bounds = [(ranked[d - 1][0], c) for c, ranked in groups.items() if len(ranked) >= d]
        bounds.sort()
        for start, c in bounds:
            if best is not None and (0, start, c) >= best[0]:
                break  # neither this group nor a later one can win: see the docstring
            known = searched.get(c)
            if known is not None and known[0] == changed[c] and known[1] == d:
                start, members, extra, front = known[2:]
            else:
                ranked = groups[c]
                members = [r for _, r in ranked[:d]]  # put in node-contiguous order once chosen
                extra = len({row_of[r] for r in members}) - fewest  # > 0: not on the fewest nodes
                front = extra <= 0
                if not front:
                    start, members = placer.fewest_nodes_ranked(d, ranked, earliest=start)
                    extra = len({row_of[r] for r in members}) - fewest
                searched[c] = (changed[c], d, start, members, extra, front)
            score = (extra, start, c)
            if best is None or score < best[0]:
                best = (score, members, front)
        if best is None:
            raise RuntimeError("balance: no count group can hold a ring (internal error; see docstring)")
        (_, _, c), members, front = best
        ring = topo.node_contiguous(members)
        t = ctx.placed_time(u, ring)
        # every member leaves group c for group c + 1 (all were in c)
        ranked = groups[c]
        if front:
            del ranked[:d]
        else:
            for r in members:
                del ranked[bisect.bisect_left(ranked, (load[r], r))]
        if not ranked:
            del groups[c]
        changed[c] = changed[c + 1] = len(placements) + 1
        moved = []
        for r in ring:
            if window:
                pipeline_load.add(r, t)
            else:
                x = t - longest[r]  # the load update of PipelineLoad
                load[r] += t + fd * (x if x > 0.0 else 0.0)
                if x > 0.0:
                    longest[r] = t
            moved.append((load[r], r))
        up = groups.get(c + 1)
        if up is None:
            moved.sort()
            groups[c + 1] = moved
        elif len(up) > 16 * d:  # a few into a long list: bisect each
            for pair in moved:
                bisect.insort(up, pair)
        else:  # sort merges the sorted list with the few new pairs
            up += moved
            up.sort()
        placements.append(Placement(ring=ring, seqs=u.seqs, offload_ratio=u.offload_ratio))
    return placements


def _place_runs(singles: list[Unit], pipeline_load: PipelineLoad, *, delta: float,
                num_buckets: int, pipelines: int | None = None) -> list[Placement]:
    """Alg. 2's runs (the module docstring of :mod:`.balance`, step 4): each target pipeline
    takes consecutive units of one bucket until the next would pass the current max load.

    Each unit updates its pipeline's load as :class:`PipelineLoad` says. Only pipelines
    ``0 .. pipelines - 1`` (default all) take units, and the max is theirs."""
    load = pipeline_load.loads
    longest = pipeline_load.longest
    fd = pipeline_load.fill_drain
    window = pipeline_load.window
    ranks = range(len(load) if pipelines is None else pipelines)
    stream = [(b, u) for b, bucket in enumerate(split_equal_work(singles, num_buckets)) for u in bucket]
    total, k = len(stream), 0
    placements: list[Placement] = []
    while k < total:
        max_t = max(load) if pipelines is None else max(load[:pipelines])
        threshold = max_t - delta * max_t
        targets = [r for r in ranks if load[r] < threshold] or list(ranks)
        targets.sort(key=load.__getitem__)  # by load; a stable sort keeps ties by rank
        for r in targets:
            if k == total:
                break
            bucket = stream[k][0]
            while True:  # one unit, then more of the bucket while the pipeline stays within max_t
                u = stream[k][1]
                k += 1
                t = u.time
                if window:
                    pipeline_load.add(r, t)
                else:
                    x = t - longest[r]
                    load[r] += t + fd * (x if x > 0.0 else 0.0)
                    if x > 0.0:
                        longest[r] = t
                placements.append(placement((r,), u.seqs, u.offload_ratio))
                if k == total or stream[k][0] != bucket:
                    break
                t = stream[k][1].time
                if window:
                    if not pipeline_load.floor_after(r, t) <= max_t:
                        break
                    continue
                x = t - longest[r]
                if not load[r] + (t + fd * (x if x > 0.0 else 0.0)) <= max_t:
                    break
    return placements


def unit_times(units: Sequence[Unit] | Mapping[tuple[int, ...], float]) -> Mapping[tuple[int, ...], float]:
    """Each unit's stage time by its ``seqs``: what :func:`short_first` and :func:`singles_first`
    read. A caller that makes several variants of one unit set passes this instead of the units,
    built once (a set holds thousands of units)."""
    if isinstance(units, Mapping):
        return units
    return {u.seqs: u.time for u in units}


def last_rings(placements: Sequence[Placement]) -> dict[int, int]:
    """Each pipeline in a ring: the position in ``placements`` of its last ring. What may move
    before a pipeline's first ring without changing a ring's local index comes after it."""
    last: dict[int, int] = {}
    for k, p in enumerate(placements):
        ring = p.ring
        if len(ring) > 1:
            for r in ring:
                last[r] = k
    return last


def short_first(placements: Sequence[Placement],
                units: Sequence[Unit] | Mapping[tuple[int, ...], float]) -> list[Placement] | None:
    """``placements`` with every pipeline's shortest single-rank micro-batch moved to its front
    (for a pipeline in a ring: the shortest after its last ring), or None when a pipeline of a
    ring has none there.

    Under 1F1B the last stage waits for the first micro-batch's forward through the other
    ``pp - 1`` stages, and PP-Balance starts pipelines with their rings, the longest work they
    have. A short micro-batch first lets the later stages start sooner. Every pipeline of a ring
    gains exactly one micro-batch before it, so rings keep the same local index on all their
    members (D5). On the Fig. 17 PP cells (H100 preset) this shortened the step by 0.5-1.5 %
    when it came; since the next levels first and singles first, which fill the same window
    better, it was never the only fastest there, and ``balance`` tries it only at PP 1 (expert
    groups), where it is the one reordering."""
    time_of = unit_times(units)
    last_ring = last_rings(placements)
    if not last_ring:
        return None
    first: dict[int, tuple[float, int]] = {}
    for k, p in enumerate(placements):
        # a pipeline of a ring moves a micro-batch from after its last ring: then every ring
        # gains exactly one micro-batch before it on every member
        if len(p.ring) == 1 and k > last_ring.get(p.ring[0], -1):
            r, t = p.ring[0], time_of[p.seqs]
            if r not in first or t < first[r][0]:
                first[r] = (t, k)
    if not last_ring.keys() <= first.keys():
        return None
    moved = sorted(k for _, k in first.values())
    taken = set(moved)
    return [placements[k] for k in moved] + [p for k, p in enumerate(placements) if k not in taken]


def singles_first(placements: Sequence[Placement], units: Sequence[Unit] | Mapping[tuple[int, ...], float],
                  lead: int) -> list[Placement] | None:
    """``placements`` with every pipeline in a ring given ``lead`` of its single-rank
    micro-batches from after its last ring at its front, shortest first (fewer when a pipeline
    of a ring has fewer there; None when one has none, or no pipeline is in a ring). Pipelines
    in no ring keep their order. The j-th lifted is a pipeline's longest single of at most the
    smallest j-th longest over all ring pipelines (its shortest left when none is that short).

    Why: PP-Balance starts a pipeline with its widest ring, its longest micro-batch. Under 1F1B,
    while that one crosses the other ``pp - 1`` stages forward and back, stage 0 can only run the
    backwards of the ``pp - 1`` micro-batches before it and the forwards of those after it
    (:func:`..pipeline_floor.idle_floor`); with ``lead = pp - 1`` singles before it, their
    backwards, the larger share, fill the window, and long singles fill it most; but a ring
    starts on all its members when the slowest has run its prefix, so every pipeline lifts about
    what the pipeline with the shortest singles can (the largest gains measured, up to 3 % on
    the Fig. 17 LLaMA-70B cells, need this cap; the longest singles alone lose them). Unlike
    :func:`next_levels_first`, which lifts whatever sits at the next positions (rings of other
    widths among them, so that the widest ring's members reach it at different times), this
    lifts only single-rank work, and every pipeline of a ring lifts the same count from after
    its last ring, so every ring keeps one local index on all its members (D5)."""
    if lead < 1:
        return None
    last_ring = last_rings(placements)
    if not last_ring:
        return None
    time_of = unit_times(units)
    # per pipeline of a ring, its singles after its last ring as (-time, position): sorted, the
    # longest first and ties in list order
    after: dict[int, list[tuple[float, int]]] = {r: [] for r in last_ring}
    end = len(placements)
    for k, p in enumerate(placements):
        ring = p.ring
        if len(ring) == 1 and k > last_ring.get(ring[0], end):
            after[ring[0]].append((-time_of[p.seqs], k))
    lead = min(lead, min(map(len, after.values())))
    if lead < 1:
        return None
    pools = [sorted(singles) for singles in after.values()]
    # the common target: every pipeline's j-th lifted single at most what the pipeline with the
    # fewest long singles can lift, so that the ring's members reach it together
    caps = [min(-pool[j][0] for pool in pools) for j in range(lead)]
    moved = []
    for pool in pools:
        chosen = []
        for cap in caps:
            # its longest single of at most the cap (ties: the earlier), else its shortest
            i = bisect.bisect_left(pool, (-(cap * (1 + 1e-9)),))
            neg, k = pool.pop(i if i < len(pool) else -1)
            chosen.append((-neg, k))
        moved.append(sorted(chosen))  # shortest first
    front = [k for step in zip(*moved) for _, k in step]  # position by position over pipelines
    taken = set(front)
    return [placements[k] for k in front] + [p for k, p in enumerate(placements) if k not in taken]


def next_levels_first(placements: Sequence[Placement], lead: int) -> list[Placement] | None:
    """``placements`` with every pipeline's micro-batches at local positions ``1 .. lead`` moved
    before the one at position 0, shortest level first (positions ``lead, lead - 1, .., 1``,
    then 0), or None when that would put a ring at different local indices on its members.

    Why: PP-Balance puts a pipeline's longest micro-batch (its widest ring) first and the next
    levels after it. Under 1F1B, while that micro-batch crosses the other ``pp - 1`` stages
    forward and back, stage 0 can only run the forwards of the ``pp - 1`` after it and the
    backwards of the ``pp - 1`` before it (:func:`..pipeline_floor.idle_floor`). With nothing
    before it the backward half of that window is empty; with the next ``lead = pp - 1``
    levels before it their backwards, the larger share, fill it. Shortest first keeps the
    later stages' start early. Level steps hold one length level per step on every pipeline,
    so the same positions carry about the same work everywhere and the ring's members arrive
    at it together; where they do not, the estimate decides (this is one more candidate).

    Every pipeline with more than ``lead`` micro-batches permutes positions ``0 .. lead``
    among themselves, so rings keep their local index relation; a pipeline with fewer is
    checked, as is every ring, against the reordered lists."""
    if lead < 1:
        return None
    index = local_indices(placements)
    if index is None or max(index, default=0) < 1:
        return None  # not aligned to begin with, or nothing to move before position 0
    keys = sorted((lead - i if 1 <= i <= lead else (lead if i == 0 else i), k)
                  for k, i in enumerate(index))
    out = [placements[k] for _, k in keys]
    return out if local_indices(out) is not None else None


def local_indices(placements: Sequence[Placement]) -> list[int] | None:
    """Each placement's local index: how many micro-batches its ring's members run before it,
    or None when a ring's members disagree (D5 wants one index on all of them).

    In numpy over every member slot at once (each slot's index among its pipeline's slots, then
    one minimum and one maximum per placement): ``balance`` asks this twice per reordered
    candidate, thousands of placements each."""
    if not placements:
        return []
    rings = [p.ring for p in placements]
    size = np.fromiter(map(len, rings), dtype=np.int64, count=len(rings))
    members = np.fromiter(chain.from_iterable(rings), dtype=np.int64, count=int(size.sum()))
    order = np.argsort(members, kind="stable")  # by pipeline, list order kept within one
    ranked = members[order]
    local = np.empty(len(members), dtype=np.int64)
    local[order] = np.arange(len(members)) - np.searchsorted(ranked, ranked)
    starts = np.cumsum(size) - size
    low = np.minimum.reduceat(local, starts)
    if not np.array_equal(low, np.maximum.reduceat(local, starts)):
        return None
    return low.tolist()
