"""PP-Balance with the longest rings on pipelines of their own.

Under 1F1B a pipeline whose longest micro-batch takes ``t`` per stage needs at least ``pp x t``
(:func:`..pipeline_floor.idle_floor`): while that micro-batch crosses the other stages forward
and back, stage 0 only runs the few micro-batches in its 1F1B window. When a ring's ``pp x t``
is above what the other pipelines must carry on average, every other micro-batch given to its
members lengthens the step: each one beyond that window costs its full time on top of
``pp x t``. The other assignments spread every length level over all pipelines, so a ring's
members also take its neighbours' levels (docs/pipeline.md, "Rings of their own"). Here no
other ring joins those rings' members (:func:`.pp_balance.pp_balance` with ``isolated``), so
they finish at about ``pp x t`` plus the single-rank micro-batches the window load gives them,
the few that hide in the ring's 1F1B window, and the other pipelines take the rest.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..sharding import ShardingContext, Unit
from ._common import Placement
from .pp_balance import pp_balance


def dominant_rings(units: Sequence[Unit], n: int, pp: int) -> list[Unit]:
    """The rings, longest first, whose 1F1B floor ``pp x t`` is at least the mean stage work the
    pipelines outside them would carry, as long as those pipelines can still hold the widest
    ring left (empty when none qualifies or PP is 1).

    Why that test: a ring run alone finishes at about ``pp x t``; the others then share the rest
    of the work, so isolating pays when the ring alone is already the slower of the two."""
    if pp < 2:
        return []
    rings = sorted((u for u in units if u.ring_size > 1), key=lambda u: (-u.time, -u.ring_size, u.seqs[0]))
    rest_work = sum(u.work for u in units)
    free = n
    chosen: list[Unit] = []
    for k, u in enumerate(rings):
        left = free - u.ring_size
        widest = max((x.ring_size for x in rings[k + 1:]), default=1)
        if left < widest:
            break
        if pp * u.time < (rest_work - u.work) / left:
            break
        chosen.append(u)
        free, rest_work = left, rest_work - u.work
    return chosen


LAYER_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2)
"""The layer caps :func:`isolated_runs` walks, as fractions of the shortest isolated ring's
stage time."""


def isolated_runs(units: Sequence[Unit], ctx: ShardingContext, n: int, isolated: Sequence[Unit],
                  finish_times: Callable[..., np.ndarray], *, delta: float,
                  num_buckets: int) -> tuple[list[Placement], float]:
    """PP-Balance's runs with ``isolated`` on pipelines of their own
    (:func:`.pp_balance.pp_balance`), with the layer cap the 1F1B estimate prefers, and that
    plan's step: ``finish_times(placements, stop_above)`` gives every pipeline's finish, or
    ``inf`` once the step exceeds ``stop_above`` (None: time it to the end). The step comes
    back so that the caller need not time the same plan again.

    A longer layer before the isolated rings takes more work off the other pipelines and makes
    the rings' members later (a third of its time at PP 2, and a ring waits for its slowest
    member), so the best cap is where the two sides finish together; it depends on how much the
    others carry (docs/pipeline.md, "Rings of their own"). The walk starts at a quarter of the
    shortest isolated ring's time and moves one step of :data:`LAYER_FRACTIONS` at a time
    towards the slower side's relief (a shorter layer when the isolated pipelines finish last),
    while the step shortens; at most three plans are timed."""
    t = min(u.time for u in isolated)
    top = n - sum(u.ring_size for u in isolated)

    def timed(k: int, stop_above: float | None = None) -> tuple[float, bool, list[Placement]]:
        placements = pp_balance(units, ctx, n, delta=delta, num_buckets=num_buckets, isolated=isolated,
                                layer_cap=t * LAYER_FRACTIONS[k])
        finish = np.asarray(finish_times(placements, stop_above), dtype=float)
        rest = float(finish[:top].max())  # dominant_rings leaves at least one pipeline
        return float(finish.max()), float(finish[top:].max()) >= rest, placements

    k = 2
    best = timed(k)  # to the end: which side finishes last sets the direction
    step = -1 if best[1] else 1
    while 0 <= k + step < len(LAYER_FRACTIONS):
        k += step
        other = timed(k, best[0])  # given up once it is no faster
        if not other[0] < best[0]:
            break
        best = other
    return best[2], best[0]
