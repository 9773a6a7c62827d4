"""``naive``: the paper's Alg. 1 ("Naive HDP Solution") with a simple fill for line 10.

Sharding and offload as in §5 (short sequences best-fit packed, each long sequence on D(s)
ranks from Eq. 3). Line 10, "assign sequences to d_hdp ranks", is left open by the paper; we do
what paper.md §4.4 suggests: time steps. In each step every rank is free; long sequences take
D(s) free ranks each (first fit over the waiting long sequences in id order, lowest free ranks
first), then every remaining free rank gets one pack (or one offloaded long sequence that fits a
single rank). Steps repeat until everything is placed. Nothing is balanced: a rank with light
packs idles while a ring in the same step runs long, which is the waste Alg. 2 removes.

With pipeline parallelism every ring must sit at the same local micro-batch index on all its
members (D5). Rings are then taken widest first and may only use free ranks that have run the
same number of micro-batches so far (one "count group"). The widest waiting ring always fits at
the start of a step: the ranks of the previous step's first ring form a count group at least as
large, and later steps never split it.
"""

from __future__ import annotations

from collections import deque

from ..plan import StepPlan
from ..sharding import Unit, shard_batch
from ._common import Placement, PlanRequest, apply_hdp_overlong, emit_plan

NAME = "naive"


def plan_naive(request: PlanRequest) -> StepPlan:
    """Alg. 1 with time-step filling; see the module docstring."""
    request = apply_hdp_overlong(request)
    units = shard_batch(request.ids, request.lengths, request.sharding_context())
    rings = [u for u in units if u.ring_size > 1]
    singles = deque(u for u in units if u.ring_size == 1)
    if request.pp_size > 1:
        placements, steps = fill_steps_aligned(request.hdp_size, rings, singles)
    else:
        placements, steps = fill_steps(request.hdp_size, rings, singles)
    return emit_plan(request, placements, scheduler=NAME, meta={"steps": steps})


def fill_steps(n: int, rings: list[Unit], singles: deque[Unit]) -> tuple[list[Placement], int]:
    """Alg. 1 line 10 without PP: time steps, rings first fit on the lowest free ranks, then packs."""
    placements: list[Placement] = []
    steps = 0
    while rings or singles:
        steps += 1
        next_rank, waiting = 0, []
        for u in rings:
            if u.ring_size <= n - next_rank:
                ring = tuple(range(next_rank, next_rank + u.ring_size))
                placements.append(Placement(ring=ring, seqs=u.seqs, offload_ratio=u.offload_ratio))
                next_rank += u.ring_size
            else:
                waiting.append(u)
        rings = waiting
        while next_rank < n and singles:
            u = singles.popleft()
            placements.append(Placement(ring=(next_rank,), seqs=u.seqs, offload_ratio=u.offload_ratio))
            next_rank += 1
    return placements, steps


def fill_steps_aligned(n: int, rings: list[Unit], singles: deque[Unit]) -> tuple[list[Placement], int]:
    """Alg. 1 line 10 with PP: rings (widest first) only on free ranks of one count group."""
    rings = sorted(rings, key=lambda u: (-u.ring_size, u.seqs[0]))
    placements: list[Placement] = []
    counts = [0] * n
    steps = 0
    while rings or singles:
        steps += 1
        free: dict[int, list[int]] = {}
        for r in range(n):
            free.setdefault(counts[r], []).append(r)
        waiting = []
        for u in rings:
            group = next((g for c, g in sorted(free.items()) if len(g) >= u.ring_size), None)
            if group is None:
                waiting.append(u)
                continue
            members, group[:] = group[: u.ring_size], group[u.ring_size:]
            placements.append(Placement(ring=tuple(members), seqs=u.seqs, offload_ratio=u.offload_ratio))
            for r in members:
                counts[r] += 1
        if len(waiting) == len(rings) and not singles:
            raise RuntimeError("naive: no ring fits any count group (internal error; see docstring)")
        rings = waiting
        for r in sorted(r for g in free.values() for r in g):
            if not singles:
                break
            u = singles.popleft()
            placements.append(Placement(ring=(r,), seqs=u.seqs, offload_ratio=u.offload_ratio))
            counts[r] += 1
    return placements, steps
