"""PP-Balance's level-step assignment: rings in lockstep levels, the tail by simulated finish.

Why not balance stage work alone (:func:`.pp_balance.pp_balance`)? Under 1F1B a ring micro-batch
is a rendezvous of its members' pipelines, forward and backward, and a stage runs a ring's
backward only after the forwards its 1F1B window puts before it. Pipelines whose micro-batch
lists differ in shape (a ring here, a run of packs there) then wait for each other at every ring,
and the waits chain from ring to ring. On the ring-heavy Fig. 17 cells (LLaMA-70B at 256K-2M,
Mistral-8x22B at 256K-512K, `h100` preset: 500-570 rings of 25-64 ranks) PP-Balance's runs
balance stage work to within 1 % of the mean and still take about twice the work bound, while
Alg. 1's time-step fill, 11 % off in work, is faster (docs/pipeline.md, "Why naive's assignment
won"). Two things make the fill win, and this module keeps both and fixes what it lacks:

1. **Levels in lockstep** (Insight 1: lengths of one level together). Rings go widest first in
   time steps, each on ranks that have run the same number of micro-batches (D5), and every rank
   left free in a step takes the next single-rank unit, longest first, so a step holds
   micro-batches of one length level on every pipeline and the transitions between levels happen
   on all pipelines at the same local index.
2. **The tail by finish time.** What is left after the last ring (packs, shortest level) is
   given longest first to the pipeline that *finishes* first in the 1F1B estimate of the ring
   phase (``finish_times``), not to the one with the least stage work: ring waits make the two
   differ by seconds, and balancing work alone put the packs on pipelines that were already late
   (LLaMA-70B Byted 512K: 20.3 s by work, 15.2 s by finish time, for the same ring phase).
   Longest first also leaves every pipeline's shortest micro-batch last, which shortens the
   1F1B drain.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Sequence

import numpy as np

from ..sharding import ShardingContext, Unit
from ..topology import Topology
from ._common import Placement, placement, unit_sort_key
from .naive import place_ring_step


def level_steps(units: Sequence[Unit], ctx: ShardingContext, n: int,
                finish_times: Callable[[list[Placement]], np.ndarray]) -> list[Placement]:
    """Rings in lockstep levels with the singles, then the remaining singles by finish time.

    ``finish_times(placements)`` returns every pipeline's finish time (seconds) in the 1F1B
    estimate of those placements; it is called once, on the ring phase."""
    head, rest = _ring_phase(units, ctx.nodes or Topology(ranks_per_node=1), n)
    if not rest:
        return head
    finish = np.asarray(finish_times(head), dtype=float) if head else np.zeros(n)
    heap = [(float(finish[r]), r) for r in range(n)]
    heapq.heapify(heap)
    out = list(head)
    for u in rest:  # already longest first
        t, r = heapq.heappop(heap)
        out.append(placement((r,), u.seqs, u.offload_ratio))
        heapq.heappush(heap, (t + u.time, r))
    return out


def _ring_phase(units: Sequence[Unit], topology: Topology, n: int) -> tuple[list[Placement], list[Unit]]:
    """Time steps while rings remain: rings (widest first) on free ranks of one count group on
    their fewest nodes (the first ring of a step takes the fewest nodes its group allows if no
    group holds it that well), then one single, longest first, per rank left free."""
    rings = sorted((u for u in units if u.ring_size > 1), key=lambda u: (-u.ring_size, u.seqs[0]))
    singles = deque(sorted((u for u in units if u.ring_size == 1), key=unit_sort_key))
    placements: list[Placement] = []
    counts = [0] * n
    while rings:
        waiting, free = place_ring_step(rings, counts, topology, placements)
        if len(waiting) == len(rings) and not singles:
            raise RuntimeError("balance: no ring fits any count group (internal error)")
        rings = waiting
        for r in sorted(r for g in free for r in g.remaining()):
            if not singles:
                break
            u = singles.popleft()
            placements.append(placement((r,), u.seqs, u.offload_ratio))
            counts[r] += 1
    return placements, list(singles)
