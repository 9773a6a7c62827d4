"""``balance``: the paper's Alg. 2 ("Balance Strategy for HDP"), DP-Balance and PP-Balance.

Sharding and offload come from §5 as in ``naive`` (packs of short sequences on one rank, each long
sequence on D(s) ranks from Eq. 3). Then:

1. **Widening** (our addition; the paper is silent). Eq. 3's D(s) is the *fewest* ranks a
   sequence may use. A 2M-token sequence on D(s) ranks can take longer than the whole step's
   lower bound ``LB = total rank-seconds / d_hdp``, and no assignment can then balance. Every
   long unit (one holding a sequence of at least C tokens: packs of short sequences stay on
   one rank and never communicate, as in the paper) whose per-rank time exceeds LB (LB / pp_size with PP: a micro-batch crosses every stage)
   gets the smallest ring (up to d_hdp) that brings it under that, or within 2 % of the fastest
   any ring size gives when its communication floor is above it, with the smallest offload ratio
   that still fits (often none). A widening is kept only if it lowers max(LB, the unit's time);
   LB is recomputed and the pass repeated until stable (at most 4 passes).
2. **Sort and bucketize.** Units are sorted by estimated time, longest first, and cut into
   ``num_buckets`` contiguous buckets of ~equal work (rank-seconds).
3. **DP-Balance (pp_size == 1).** Alg. 2 takes units from the first (heaviest) non-empty bucket
   and gives them to *target ranks* (``max_time - t_i > delta * max_time``, all ranks if none).
   Giving each unit to the least-loaded targets (ties by rank id; a ring takes its D
   least-loaded ranks, topped up with the least-loaded others) makes this LPT list scheduling,
   which we run with a heap: buckets and delta therefore do not change DP-Balance plans (they
   shape PP-Balance). Units go heaviest *work* first (rank-seconds: a wide ring before a long
   single, so rings start while ranks are still level; a ring starts when its slowest member is
   free and that idle wait is charged). Topology (:mod:`.placement`): a ring that fits a node
   takes ranks of one node, a longer one the fewest nodes (whole nodes where it can), in
   node-contiguous order, always (offload on or off). Ranks that run light units get more of
   them, so micro-batch counts differ per rank.
4. **PP-Balance (pp_size > 1).** Ring micro-batches must sit at the same local index on all
   members (D5, checked by the validator). Rings are placed first, widest first, on the D
   least-loaded ranks of one *count group* (ranks that have run the same number of micro-batches),
   on its fewest nodes (:func:`_place_rings_aligned`);
   the widest remaining ring always fits the group the previous ring created. Single-rank units
   then follow Alg. 2's "sequentially from all buckets": each target pipeline (below
   ``max - delta * max``) takes a *run* of consecutive units from the sorted stream, staying inside
   the current bucket, until the next would pass the current max. So a pipeline gets a run of
   similar micro-batches (Insight 1: fewer transition bubbles) and lighter pipelines get more
   of them (Fig. 12). When no pipeline is a target, all are, and each takes at least one unit.
   A second candidate counts a pipeline's load as its stage work plus (PP - 1) x its longest
   micro-batch (the 1F1B fill and drain of that micro-batch, which the pipeline cannot fill
   beyond its few in-flight neighbours), so the pipelines of a long ring take less other work.
5. **Safety net.** The plan emitted is the fastest by the cost model among this assignment (both
   loads with PP), the same on Eq. 3's (unwidened) units, and Alg. 1's fill of Eq. 3's units; ``meta["assignment"]``
   says which won. At scale the first wins and the others are skipped when they cannot (their
   longest unit is already slower); on tiny batches a greedy can lose by chance (LPT's worst
   case is 4/3 of optimal), and a ring over all ranks can serialise indivisible packs.

Defaults. ``delta = 0.05``: Megatron's hybrid-CP uses 5 % of the max time (paper.md §5.4); a
smaller delta makes runs shorter, a larger one tolerates more spread before a pipeline becomes a
target. ``num_buckets = 4``: the paper gives no value; Megatron uses one bucket per distinct CP
size. Four equal-work levels separate "longest / long / medium / packs" in long-tailed batches
while keeping runs long enough to matter; it only affects PP-Balance.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..estimate import estimate_plan
from ..plan import StepPlan
from ..sharding import ShardingContext, Unit, shard_batch
from .naive import fill_steps, fill_steps_aligned
from .placement import RingPlacer
from ._common import (
    Placement,
    PlanRequest,
    apply_hdp_overlong,
    emit_plan,
    split_equal_work,
    unit_sort_key,
    unit_work_key,
)

NAME = "balance"
WIDEN_PASSES = 4


def plan_balance(request: PlanRequest) -> StepPlan:
    """Alg. 2; see the module docstring.

    With two-level rings (``cost_model.two_level_ring``) long rings are sized in whole nodes and
    costed two-level; the plan sized as for flat rings is planned too, both are estimated with
    the two-level cost (each ring as it will run: two-level on whole nodes, else flat) and the
    faster is kept (``meta["ring_sizing"]``; on a tie the two-level sizing that was asked for),
    so turning two-level rings on never makes a plan slower by the estimate (list scheduling can
    lose on differently shaped units).
    """
    cm = request.cost_model
    if not cm.two_level_ring:
        return _plan_balance(request)
    best = None
    for sizing, model in (("two-level", cm), ("flat", cm.with_(two_level_ring=False))):
        plan = _plan_balance(replace(request, cost_model=model))
        plan = replace(plan, meta={**plan.meta, "ring_sizing": sizing},
                       estimate=estimate_plan(plan, cm, request.topology))
        if best is None or plan.estimate.step_time_s < best.estimate.step_time_s:
            best = plan
    return best


def _plan_balance(request: PlanRequest) -> StepPlan:
    request = apply_hdp_overlong(request)
    ctx = request.sharding_context()
    eq3_units = shard_batch(request.ids, request.lengths, ctx)
    units, widened = widen_for_balance(list(eq3_units), ctx, request.hdp_size, pp_size=request.pp_size)
    units.sort(key=unit_sort_key)
    meta = {"delta": request.delta, "num_buckets": request.num_buckets}
    if request.pp_size == 1:
        placements, assignment, widened = _best_dp_assignment(units, eq3_units, widened, ctx, request.hdp_size)
        meta.update(mode="DP-Balance", widened_units=widened, assignment=assignment)
        return emit_plan(request, placements, scheduler=NAME, meta=meta)
    return _best_pp_plan(request, units, eq3_units, widened, ctx, meta)


# --------------------------------------------------------------------------- widening
def widen_for_balance(units: list[Unit], ctx: ShardingContext, n: int, *, pp_size: int = 1) -> tuple[list[Unit], int]:
    """Give units slower than the target more ranks; returns the units and how many grew.

    The target is the lower bound LB without PP. With PP a pipeline needs at least
    ``pp_size * t`` for a micro-batch of stage time t (it crosses every stage forward and back),
    so the target is LB / pp_size.
    """
    if n <= 1 or not units:
        return units, 0
    grown: set[int] = set()
    for _ in range(WIDEN_PASSES):
        work = sum(u.work for u in units)
        target = work / n / pp_size
        changed = False
        for k, u in enumerate(units):
            if u.time <= target * (1 + 1e-9) or u.ring_size >= n or max(u.lengths) < ctx.capacity:
                continue  # packs of short sequences never communicate (paper §5.1)
            w = _smallest_ring_under(u, target, ctx, n)
            # only if it lowers the bound max(work / n, this unit's time): a wider ring costs more
            # rank-seconds (gamma and communication per member), which can outweigh the gain
            new_work = work - u.work + w.work
            if w.ring_size != u.ring_size and max(new_work / n, w.time * pp_size) < max(work / n, u.time * pp_size) * (1 - 1e-9):
                units[k] = w
                work = new_work
                grown.add(k)
                changed = True
        if not changed:
            break
    return units, len(grown)


def _smallest_ring_under(u: Unit, target: float, ctx: ShardingContext, n: int) -> Unit:
    """The unit on the smallest ring in (ring_size, n] whose time is <= target.

    A ring's time cannot fall below its communication floor: every member receives the whole
    sequence's K/V in forward and K/V plus dK/dV in backward, ``(2 * kv + dkv) * s / bandwidth`` per layer
    whatever D is, and each extra member adds a latency per step. So time(D) falls, flattens,
    then rises again. We evaluate it on a geometric grid of ring sizes, find the fastest, and if
    the target is below that (a very long sequence) aim at 2 % above the fastest instead, so the
    ring does not burn ranks on exposed communication. Then the smallest grid size that meets the
    aim is refined by bisection against the grid point before it.
    """
    grid = _ring_grid(u.ring_size, n)
    times = ctx.time_on_rings(u.lengths, grid)
    best = int(np.argmin(times))
    if grid[best] == u.ring_size:
        return u
    aim = max(target, float(times[best]) * 1.02)
    k = int(np.flatnonzero(times[: best + 1] <= aim)[0])
    lo, hi = int(grid[k - 1]) if k else u.ring_size, int(grid[k])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ctx.time_on_rings(u.lengths, np.array([mid]))[0] <= aim:
            hi = mid
        else:
            lo = mid
    return ctx.resize(u, hi) if hi != u.ring_size else u


def _ring_grid(lo: int, hi: int) -> np.ndarray:
    """Ring sizes lo, ~1.1*lo, ... up to hi (both included)."""
    sizes = {lo, hi}
    x = float(lo)
    while x < hi:
        x = max(x * 1.1, x + 1)
        sizes.add(min(hi, int(x)))
    return np.array(sorted(sizes), dtype=np.int64)


# --------------------------------------------------------------------------- DP
def _best_dp_assignment(
    units: list[Unit], eq3_units: list[Unit], widened: int, ctx: ShardingContext, n: int
) -> tuple[list[Placement], str, int]:
    """The fastest (by the cost model) of: LPT on the widened units, LPT on Eq. 3's units, and
    Alg. 1's time-step fill of Eq. 3's units.

    LPT is a greedy heuristic (its worst case is 4/3 of optimal even without rings) and on tiny
    batches the fill can win by chance; on real batches LPT on the widened units wins by far.
    Keeping the best of three deterministic candidates costs two cheap extra passes.
    """
    candidates = [("lpt", *dp_balance(sorted(units, key=unit_work_key), ctx, n), widened)]
    # both alternatives run Eq. 3's units, so neither can beat their longest one: skip them when
    # the first candidate is already that fast (the common case at scale)
    floor = max((u.time for u in eq3_units), default=0.0)
    if candidates[0][2] <= floor:
        return candidates[0][1], "lpt", widened
    if widened:
        candidates.append(("lpt-eq3", *dp_balance(sorted(eq3_units, key=unit_work_key), ctx, n), 0))
    fill = fill_steps(n, [u for u in eq3_units if u.ring_size > 1], deque(u for u in eq3_units if u.ring_size == 1),
                      ctx.nodes)[0]
    candidates.append(("fill", fill, _makespan(fill, eq3_units, ctx, n), 0))
    name, placements, _, grown = min(candidates, key=lambda c: c[2])
    return placements, name, grown


def _makespan(placements: Sequence[Placement], units: Sequence[Unit], ctx: ShardingContext, n: int) -> float:
    """Finish time of ``placements`` run in order, rings starting when all members are free."""
    by_seqs = {u.seqs: u for u in units}
    free = np.zeros(n)
    for p in placements:
        u = by_seqs[p.seqs]
        if len(p.ring) == 1:
            free[p.ring[0]] += u.time
        else:
            idx = list(p.ring)
            free[idx] = free[idx].max() + ctx.placed_time(u, p.ring)
    return float(free.max()) if n else 0.0


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
            timed.append((start, index, Placement(ring=(rank,), seqs=u.seqs, offload_ratio=u.offload_ratio)))
            continue
        picked: list[int] = []
        while len(picked) < d:
            t, r = pop(heap)
            if t == cur[r] and r not in picked:
                picked.append(r)
        start, ring, t_u = _place_ring(u, picked, placer, ctx)
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
        timed.append((start, index, Placement(ring=ring, seqs=u.seqs, offload_ratio=u.offload_ratio)))
    timed.sort(key=lambda x: (x[0], x[1]))
    return [p for _, _, p in timed], float(loads.max()) if n else 0.0


def _place_ring(u: Unit, picked: list[int], placer: RingPlacer, ctx: ShardingContext,
                eligible: np.ndarray | None = None) -> tuple[float, tuple[int, ...], float]:
    """``(start, ring, time)`` of unit ``u``: the load-only ``picked`` ranks when they already
    sit on the fewest nodes (then no compact ring starts earlier), else
    :meth:`.placement.RingPlacer.fewest_nodes` among the ``eligible`` ranks (see
    :func:`dp_balance`)."""
    ring = placer.topology.node_contiguous(picked)
    start = float(placer.loads[list(ring)].max())
    if not placer.spans_min_nodes(ring):
        choice = placer.fewest_nodes(len(picked), eligible, earliest=start)
        if choice is not None:  # None only if fewer than len(picked) ranks are eligible
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


# --------------------------------------------------------------------------- PP
def pp_balance(units: Sequence[Unit], ctx: ShardingContext, n: int, *, delta: float,
               num_buckets: int, fill_drain: int = 0) -> list[Placement]:
    """Rings aligned by count groups (widest first), then runs of single-rank units.

    A pipeline's load is its stage work plus ``fill_drain`` times its longest micro-batch: with
    ``fill_drain = pp_size - 1`` that is the 1F1B fill and drain (while a long micro-batch
    crosses the other stages forward and back, a stage only runs its few in-flight neighbours),
    so pipelines in a long ring take less other work; 0 balances stage work alone.
    """
    placer = RingPlacer(ctx.nodes, n)
    load = _PipelineLoad(placer.loads, fill_drain)
    placements = _place_rings_aligned([u for u in units if u.ring_size > 1], ctx, placer, load)
    load.loads = placer.loads.tolist()  # the placer is done; lists index faster
    singles = [u for u in units if u.ring_size == 1]
    placements += _place_runs(singles, load, delta=delta, num_buckets=num_buckets)
    return placements


class _PipelineLoad:
    """Per-pipeline load for PP-Balance: stage work + ``fill_drain`` x longest micro-batch."""

    def __init__(self, loads: np.ndarray, fill_drain: int) -> None:
        self.loads: np.ndarray | list[float] = loads  # updated in place
        self.fill_drain = fill_drain
        self.longest = [0.0] * len(loads)

    def added(self, r: int, t: float) -> float:
        """How much a micro-batch of stage time ``t`` adds to pipeline ``r``'s load."""
        return t + self.fill_drain * max(0.0, t - self.longest[r])

    def add(self, r: int, t: float) -> None:
        self.loads[r] += self.added(r, t)
        self.longest[r] = max(self.longest[r], t)


def _best_pp_plan(request: PlanRequest, units: list[Unit], eq3_units: list[Unit], widened: int,
                  ctx: ShardingContext, meta: dict) -> StepPlan:
    """The fastest, by the full 1F1B estimate, of PP-Balance on the widened units, PP-Balance on
    Eq. 3's units and Alg. 1's aligned fill (the safety net of :func:`_best_dp_assignment`; with
    PP, widening trades fewer bubbles for more communication and the estimate decides)."""
    n = request.hdp_size
    kw = dict(delta=request.delta, num_buckets=request.num_buckets)
    candidates = [("pp-runs", pp_balance(units, ctx, n, **kw), widened, units),
                  ("pp-runs-1f1b", pp_balance(units, ctx, n, fill_drain=request.pp_size - 1, **kw),
                   widened, units)]
    if widened:
        candidates.append(("pp-runs-eq3", pp_balance(sorted(eq3_units, key=unit_sort_key), ctx, n, **kw), 0,
                           eq3_units))
    fill = fill_steps_aligned(n, [u for u in eq3_units if u.ring_size > 1],
                              deque(u for u in eq3_units if u.ring_size == 1), ctx.nodes)[0]
    candidates.append(("fill", fill, 0, eq3_units))
    best: StepPlan | None = None
    for name, placements, grown, pool in candidates:
        # a candidate whose 1F1B floor is already slower than the best cannot win: skip its
        # plan and full estimate (the margin covers rounding between the two time sums)
        if best is not None and pipeline_floor(placements, pool, ctx, request.pp_size) \
                > best.estimate.step_time_s * (1 + 1e-9):
            continue
        plan = emit_plan(request, placements, scheduler=NAME,
                         meta={**meta, "mode": "PP-Balance", "widened_units": grown, "assignment": name})
        plan = replace(plan, estimate=estimate_plan(plan, ctx.cost_model))
        if best is None or plan.estimate.step_time_s < best.estimate.step_time_s:
            best = plan
    return best


def pipeline_floor(placements: Sequence[Placement], units: Sequence[Unit], ctx: ShardingContext,
                   pp_size: int) -> float:
    """A lower bound on the 1F1B step of ``placements`` (each rank a pipeline running its
    micro-batches in list order): the slowest pipeline's stage work plus the first micro-batch's
    forward down the other ``pp_size - 1`` stages before the last stage can start, and the last
    one's backward back up them after it ends. Rings only add waiting to that."""
    by_seqs = {u.seqs: u for u in units}
    ff = ctx.cost_model.forward_fraction
    work = [0.0] * ctx.hdp_size
    first: list[float | None] = [None] * ctx.hdp_size
    last = [0.0] * ctx.hdp_size
    for p in placements:
        t = ctx.placed_time(by_seqs[p.seqs], p.ring)
        for r in p.ring:
            work[r] += t
            if first[r] is None:
                first[r] = t
            last[r] = t
    hops = pp_size - 1
    return max((w + hops * (ff * f + (1.0 - ff) * b) for w, f, b in zip(work, first, last) if f is not None),
               default=0.0)


def _place_rings_aligned(rings: list[Unit], ctx: ShardingContext, placer: RingPlacer,
                         pipeline_load: _PipelineLoad) -> list[Placement]:
    """Each ring (widest first) on ranks of one count group, on the fewest nodes: the group
    whose fewest-nodes choice (:meth:`.placement.RingPlacer.fewest_nodes`) starts first among
    those that hold the ring on ``ceil(D / ranks_per_node)`` nodes (fewer micro-batches on a
    tie). Such a group always exists on a regular topology: the ranks of the previous (wider)
    ring form one. Only if none does (a node map with small nodes) does the ring take the fewest
    nodes any group allows."""
    load = placer.loads
    n = len(load)
    topo = placer.topology
    groups: dict[int, int] = {0: n}  # count -> ranks that have run that many micro-batches
    count = np.zeros(n, dtype=np.int64)
    placements: list[Placement] = []
    for u in sorted(rings, key=lambda x: (-x.ring_size, -x.time, x.seqs[0])):
        d = u.ring_size
        best: tuple[tuple[int, float, int], tuple[int, ...]] | None = None
        for c in sorted(groups):
            if groups[c] < d:
                continue
            eligible = count == c
            ranks = np.flatnonzero(eligible)
            least = ranks[np.lexsort((ranks, load[ranks]))[:d]]  # the d least loaded, ties by rank
            members = topo.node_contiguous(least.tolist())
            start = float(load[least].max())
            if not placer.spans_min_nodes(members):
                start, members = placer.fewest_nodes(d, eligible, earliest=start)
            score = (topo.ring_nodes(members) - topo.min_nodes(d), start, c)
            if best is None or score < best[0]:
                best = (score, members)
        if best is None:
            raise RuntimeError("balance: no count group can hold a ring (internal error; see docstring)")
        ring = best[1]
        t = ctx.placed_time(u, ring)
        for r in ring:
            c = int(count[r])
            groups[c] -= 1
            if not groups[c]:
                del groups[c]
            count[r] = c + 1
            groups[c + 1] = groups.get(c + 1, 0) + 1
            pipeline_load.add(r, t)
        placer.touch(ring)
        placements.append(Placement(ring=ring, seqs=u.seqs, offload_ratio=u.offload_ratio))
    return placements


def _place_runs(singles: list[Unit], pipeline_load: _PipelineLoad, *, delta: float,
                num_buckets: int) -> list[Placement]:
    load = pipeline_load.loads
    n = len(load)
    buckets = split_equal_work(singles, num_buckets)
    stream: deque[tuple[int, Unit]] = deque((b, u) for b, bucket in enumerate(buckets) for u in bucket)
    placements: list[Placement] = []

    def give(r: int) -> None:
        _, u = stream.popleft()
        pipeline_load.add(r, u.time)
        placements.append(Placement(ring=(r,), seqs=u.seqs, offload_ratio=u.offload_ratio))

    while stream:
        max_t = max(load)
        threshold = max_t - delta * max_t
        targets = [r for r in range(n) if load[r] < threshold] or list(range(n))
        targets.sort(key=lambda r: (load[r], r))
        for r in targets:
            if not stream:
                break
            bucket = stream[0][0]
            give(r)
            while (stream and stream[0][0] == bucket
                   and load[r] + pipeline_load.added(r, stream[0][1].time) <= max_t):
                give(r)
    return placements

