"""Widening for ``balance`` (step 1 of :mod:`.balance`): give long units slower than the step's
lower bound more ranks than Eq. 3's minimum, with the smallest offload ratio that still fits."""

from __future__ import annotations

import numpy as np

from ..sharding import ShardingContext, Unit

WIDEN_PASSES = 4

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
        # the units this pass looks at (packs of short sequences never communicate, paper §5.1),
        # known before it starts: a unit is replaced only when it is looked at; their ring grids
        # are timed together where they hold one sequence
        todo = [k for k, u in enumerate(units)
                if not (u.time <= target * (1 + 1e-9) or u.ring_size >= n or max(u.lengths) < ctx.capacity)]
        grids = {k: _ring_grid(units[k].ring_size, n) for k in todo}
        single = [k for k in todo if len(units[k].lengths) == 1]
        timed = dict(zip(single, ctx.time_on_rings_each([units[k].lengths[0] for k in single],
                                                        [grids[k] for k in single])))
        for k in todo:
            u = units[k]
            times = timed[k] if k in timed else ctx.time_on_rings(u.lengths, grids[k])
            w = _smallest_ring_under(u, target, ctx, grids[k], times)
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


def _smallest_ring_under(u: Unit, target: float, ctx: ShardingContext, grid: np.ndarray,
                         times: np.ndarray) -> Unit:
    """The unit on the smallest ring in (ring_size, grid[-1]] whose time is <= target.

    A ring's time cannot fall below its communication floor: every member receives the whole
    sequence's K/V in forward and K/V plus dK/dV in backward, ``(2 * kv + dkv) * s / bandwidth`` per layer
    whatever D is, and each extra member adds a latency per step. So time(D) falls, flattens,
    then rises again. The caller evaluates it on a geometric grid of ring sizes
    (``grid``, :func:`_ring_grid`, and its ``times``); we find the fastest, and if
    the target is below that (a very long sequence) aim at 2 % above the fastest instead, so the
    ring does not burn ranks on exposed communication. Then the smallest grid size that meets the
    aim is refined by bisection against the grid point before it.
    """
    best = int(np.argmin(times))
    if grid[best] == u.ring_size:
        return u
    aim = max(target, float(times[best]) * 1.02)
    k = int(np.flatnonzero(times[: best + 1] <= aim)[0])
    lo, hi = int(grid[k - 1]) if k else u.ring_size, int(grid[k])
    if hi - lo > 1:
        # every size the bisection may ask, timed in one call (the cost model is elementwise:
        # each the float a call of its own gives)
        first = lo + 1
        between = ctx.time_on_rings(u.lengths, np.arange(first, hi))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if between[mid - first] <= aim:
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
