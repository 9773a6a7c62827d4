"""``pow2``: Megatron's hybrid context parallelism, re-implemented as a baseline (megatron.md §2.3).

Behaviour reproduced (no code copied):

* A sequence of s >= C tokens gets a ring of the next power of two >= ceil(s / C) ranks
  (doubled again if its zigzag share with padding would not fit C); shorter sequences are
  best-fit packed onto single ranks. No offload.
* Rings live on **aligned power-of-two blocks** of the HDP rank list (ranks [k*D, (k+1)*D)),
  because Megatron pre-creates one process group per aligned block of every power-of-two size.
* Placement is greedy in **groups**: units sorted by estimated time, longest first; each goes to
  the least-loaded block of its size already used in the group, or to a free aligned block, and
  is accepted only if the block's load stays within (1 + delta) of the group's largest load
  (delta = 5 %, as in Megatron); the rest waits for the next group. Then idle blocks are filled:
  a block whose buddy (the other half of its aligned 2D block) is entirely idle doubles its
  units' ring size onto both halves, repeatedly.
* **A barrier after every group** (``meta["barrier_after_orders"]``: the last order of every group
  but the final one); the estimator makes every rank wait there.

Megatron asserts pipeline parallelism off for hybrid CP; so does this baseline.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..offload import fits_on_ring, no_ring_fits
from ..plan import StepPlan
from ..sharding import ShardingContext, Unit, best_fit_decreasing, pack_times
from ._common import Placement, PlanRequest, apply_overlong, emit_plan, unit_sort_key

NAME = "pow2"
POW2_DELTA = 0.05


def pow2_ring_size(length: int, capacity: int, align: int = 1) -> int:
    """Next power of two >= ceil(length / capacity), doubled until the zigzag share fits."""
    need = max(1, -(-length // capacity))
    d = 1 << (need - 1).bit_length()
    last = max(need, -(-length // align))  # beyond it the fullest share no longer shrinks
    while not fits_on_ring(length, d, capacity=capacity, layers=1, offload_ratio=0.0, align=align):
        if d >= last:
            raise ValueError(no_ring_fits(length, capacity, align))
        d *= 2
    return d


def _largest_block(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _max_pow2_length(request: PlanRequest) -> int:
    top = _largest_block(request.hdp_size)
    lo, hi = 0, request.capacity * top + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pow2_ring_size(mid, request.capacity, request.align) <= top:
            lo = mid
        else:
            hi = mid
    return lo


def plan_pow2(request: PlanRequest) -> StepPlan:
    """Megatron-style hybrid CP; see the module docstring."""
    if request.pp_size > 1:
        raise ValueError(
            f"scheduler 'pow2' (Megatron hybrid context parallel) does not support pipeline "
            f"parallelism (pp_size={request.pp_size}); Megatron asserts PP off for it. Use "
            f"'balance' or 'static'"
        )
    top = _largest_block(request.hdp_size)
    request = apply_overlong(
        request, _max_pow2_length(request),
        why=f"the largest power-of-two ring on {request.hdp_size} ranks has {top} ranks",
        hint="Use more HDP ranks or a larger capacity",
    )
    ctx = request.sharding_context(offload=False)
    units = _pow2_units(request, ctx)
    groups = _place_groups(units, ctx, request.hdp_size)
    placements: list[Placement] = []
    barriers: list[int] = []
    for blocks in groups:
        depth = max(len(us) for _, _, us in blocks)
        for j in range(depth):
            for start, size, us in blocks:
                if j < len(us):
                    placements.append(Placement(ring=tuple(range(start, start + size)), seqs=us[j].seqs))
        barriers.append(len(placements) - 1)
    meta = {"barrier_after_orders": barriers[:-1], "num_groups": len(groups), "delta": POW2_DELTA}
    return emit_plan(request, placements, scheduler=NAME, meta=meta, offload_allowed=False)


def _pow2_units(request: PlanRequest, ctx: ShardingContext) -> list[Unit]:
    units: list[Unit] = []
    short = [(i, n) for i, n in zip(request.ids, request.lengths) if n < request.capacity]
    for i, n in zip(request.ids, request.lengths):
        if n >= request.capacity:
            d = pow2_ring_size(n, request.capacity, request.align)
            units.append(Unit(seqs=(i,), lengths=(n,), ring_size=d, min_ring_size=d,
                              time=ctx.unit_time((n,), d, 0.0)))
    if short:
        length_of = dict(short)
        bins = best_fit_decreasing([i for i, _ in short], [n for _, n in short], request.capacity)
        for b, t in zip(bins, pack_times([[length_of[s] for s in b] for b in bins], ctx)):
            units.append(Unit(seqs=tuple(b), lengths=tuple(length_of[s] for s in b), ring_size=1, time=t))
    units.sort(key=unit_sort_key)
    return units


Block = tuple[int, int, list[Unit]]  # (first rank, size, units run one after another)


def _place_groups(units: list[Unit], ctx: ShardingContext, n: int) -> list[list[Block]]:
    groups: list[list[Block]] = []
    remaining = units
    while remaining:
        blocks, remaining = _one_group(remaining, ctx, n)
        groups.append(blocks)
    return groups


def _one_group(units: Sequence[Unit], ctx: ShardingContext, n: int) -> tuple[list[Block], list[Unit]]:
    busy = np.zeros(n, dtype=bool)
    blocks: dict[int, list] = {}  # start -> [size, load, units]
    by_size: dict[int, list[tuple[float, int]]] = {}  # size -> heap of (load, start)
    cursor: dict[int, int] = {}  # size -> next aligned start to try for a free block
    group_max = 0.0
    leftovers: list[Unit] = []
    for u in units:
        d = u.ring_size
        used = by_size.get(d)
        free_start = _next_free_block(busy, d, cursor)
        if free_start is not None:  # a free block always gives the lower load
            new_load, start, fresh = u.time, free_start, True
        elif used:
            new_load, start, fresh = used[0][0] + u.time, used[0][1], False
        else:
            leftovers.append(u)
            continue
        if group_max > 0 and new_load > group_max * (1 + POW2_DELTA):
            leftovers.append(u)
            continue
        if fresh:
            busy[start:start + d] = True
            blocks[start] = [d, u.time, [u]]
            heapq.heappush(by_size.setdefault(d, []), (u.time, start))
        else:
            heapq.heappop(used)
            blocks[start][1] = new_load
            blocks[start][2].append(u)
            heapq.heappush(used, (new_load, start))
        group_max = max(group_max, new_load)
    if not blocks:  # cannot happen: the first unit always finds the empty group's block
        raise RuntimeError("pow2: empty group (internal error)")
    _fill_idle(blocks, busy, ctx, n)
    out = [(start, b[0], b[2]) for start, b in sorted(blocks.items())]
    return out, leftovers


def _next_free_block(busy: np.ndarray, d: int, cursor: dict[int, int]) -> int | None:
    """First aligned block of size d with all ranks free; blocks only ever fill up within a
    group, so the search resumes where it stopped."""
    n = len(busy)
    start = cursor.get(d, 0)
    while start + d <= n:
        if not busy[start:start + d].any():
            cursor[d] = start
            return start
        start += d
    cursor[d] = start
    return None


def _fill_idle(blocks: dict[int, list], busy: np.ndarray, ctx: ShardingContext, n: int) -> None:
    """Double blocks onto their idle buddy halves until nothing changes (Megatron's fill of
    empty GPUs)."""
    changed = True
    while changed:
        changed = False
        for start in sorted(blocks):
            if start not in blocks:
                continue
            size, _, us = blocks[start]
            parent = start - start % (2 * size)
            buddy = parent + size if parent == start else parent
            if parent + 2 * size > n or busy[buddy:buddy + size].any():
                continue
            grown = [replace(u, ring_size=2 * size, time=ctx.unit_time(u.lengths, 2 * size, 0.0)) for u in us]
            del blocks[start]
            blocks[parent] = [2 * size, sum(u.time for u in grown), grown]
            busy[parent:parent + 2 * size] = True
            changed = True
