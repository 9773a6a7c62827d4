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
from typing import Iterator

from ..plan import StepPlan
from ..sharding import Unit, shard_batch
from ..topology import Topology
from ._common import Placement, PlanRequest, apply_hdp_overlong, emit_plan, placement
from .placement import FreeRanks

NAME = "naive"


def plan_naive(request: PlanRequest) -> StepPlan:
    """Alg. 1 with time-step filling; see the module docstring."""
    request = apply_hdp_overlong(request)
    units = shard_batch(request.ids, request.lengths, request.sharding_context())
    rings = [u for u in units if u.ring_size > 1]
    singles = deque(u for u in units if u.ring_size == 1)
    topology = Topology.of(request.cost_model, request.topology)
    if request.pp_size > 1:
        placements, steps = fill_steps_aligned(request.hdp_size, rings, singles, topology)
    else:
        placements, steps = fill_steps(request.hdp_size, rings, singles, topology)
    return emit_plan(request, placements, scheduler=NAME, meta={"steps": steps})


def fill_steps(n: int, rings: list[Unit], singles: deque[Unit],
               topology: Topology | None = None) -> tuple[list[Placement], int]:
    """Alg. 1 line 10 without PP: time steps; rings first fit (in id order) on free ranks of the
    fewest nodes (:meth:`.placement.FreeRanks.take`; all ranks one node apart without a
    ``topology``), then packs on the remaining free ranks, lowest first."""
    placements: list[Placement] = []
    steps = 0
    for step in fill_step_iter(n, rings, singles, topology):
        steps += 1
        placements += step
    return placements, steps


def fill_step_iter(n: int, rings: list[Unit], singles: deque[Unit],
                   topology: Topology | None = None) -> Iterator[list[Placement]]:
    """:func:`fill_steps` one time step at a time (the placements of each step), so that a
    caller can stop once the fill is known to lose (balance's safety net)."""
    topology = topology or Topology(ranks_per_node=1)
    while rings or singles:
        step: list[Placement] = []
        free, waiting = FreeRanks(range(n), topology), []
        for u in rings:
            ring = free.take(u.ring_size, fallback=free.count == n)
            if ring is None:
                waiting.append(u)
                continue
            step.append(placement(tuple(ring), u.seqs, u.offload_ratio))
        rings = waiting
        for r in free.remaining():
            if not singles:
                break
            u = singles.popleft()
            step.append(placement((r,), u.seqs, u.offload_ratio))
        yield step


def fill_steps_aligned(n: int, rings: list[Unit], singles: deque[Unit],
                       topology: Topology | None = None) -> tuple[list[Placement], int]:
    """Alg. 1 line 10 with PP: rings (widest first) only on free ranks of one count group, the
    first group (fewest micro-batches) that holds the ring on its fewest nodes; the first ring
    of a step takes the fewest nodes its group allows if no group holds it that well."""
    topology = topology or Topology(ranks_per_node=1)
    rings = sorted(rings, key=lambda u: (-u.ring_size, u.seqs[0]))
    placements: list[Placement] = []
    counts = [0] * n
    steps = 0
    while rings or singles:
        steps += 1
        waiting, free = place_ring_step(rings, counts, topology, placements)
        if len(waiting) == len(rings) and not singles:
            raise RuntimeError("naive: no ring fits any count group (internal error; see docstring)")
        rings = waiting
        for r in sorted(r for g in free for r in g.remaining()):
            if not singles:
                break
            u = singles.popleft()
            placements.append(placement((r,), u.seqs, u.offload_ratio))
            counts[r] += 1
    return placements, steps


def place_ring_step(rings: list[Unit], counts: list[int], topology: Topology,
                    placements: list[Placement]) -> tuple[list[Unit], list[FreeRanks]]:
    """One time step of the PP fill: each ring of ``rings`` (in order) on free ranks of one count
    group (ranks with the same number of micro-batches so far), the first group that holds it on
    its fewest nodes; the step's first ring takes the fewest nodes its group allows if no group
    holds it that well. Appends to ``placements`` and ``counts``; returns the rings that wait
    for a later step and every group's free ranks (for the singles of the step)."""
    by_count: dict[int, list[int]] = {}
    for r, c in enumerate(counts):
        by_count.setdefault(c, []).append(r)
    free = [FreeRanks(ranks, topology) for _, ranks in sorted(by_count.items())]
    waiting: list[Unit] = []
    first = True
    # most rings of a step find no group with that many free ranks (the steps run widest first):
    # they wait without a look at the groups
    most_free = max((g.count for g in free), default=0)
    for u in rings:
        if u.ring_size > most_free:
            waiting.append(u)
            continue
        groups = [g for g in free if g.count >= u.ring_size]
        members = next((m for g in groups if (m := g.take(u.ring_size, fallback=False)) is not None), None)
        if members is None and groups and first:
            members = groups[0].take(u.ring_size, fallback=True)
        if members is None:
            waiting.append(u)
            continue
        first = False
        placements.append(placement(tuple(members), u.seqs, u.offload_ratio))
        for r in members:
            counts[r] += 1
        most_free = max(g.count for g in free)
    return waiting, free
