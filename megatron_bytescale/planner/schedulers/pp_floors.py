"""Lower bounds on a PP candidate's 1F1B step, cheap enough to skip hopeless candidates.

``balance`` builds a dozen or more PP candidates per unit set and times each with the full
1F1B estimate (:mod:`.candidate_time`), the costliest step of planning. Most cannot win: their
floor is already slower than the best step found. Two floors, from the cheaper to the tighter:

* :func:`order_free_floor` holds for every order of a candidate's micro-batches, so one value
  covers a candidate and all its reorderings (computed once per assignment);
* :func:`alone_floors`: each pipeline's 1F1B run alone, every candidate in one wavefront run.
"""

from __future__ import annotations

from itertools import chain
from typing import Mapping, Sequence

import numpy as np

from ..sharding import ShardingContext, Unit
from ..wavefront import pipelines_alone_flat
from ._common import Placement


Units = Sequence[Unit] | Mapping[tuple[int, ...], Unit]
"""A candidate's units: the list, or :func:`units_by_seqs` of it (a caller that asks for several
candidates of one list builds that once; a list holds thousands of units)."""


def units_by_seqs(units: Units) -> Mapping[tuple[int, ...], Unit]:
    """Each unit by its ``seqs``; a mapping comes back as it is."""
    return units if isinstance(units, Mapping) else {u.seqs: u for u in units}


def order_free_floor(placements: Sequence[Placement], units: Units, ctx: ShardingContext,
                     pp_size: int) -> float:
    """A lower bound on the 1F1B step of every order of ``placements``: the slowest pipeline's
    stage work plus the idle its longest micro-batch ``t_1`` leaves on stage 0 whatever the
    order, ``w t_1`` less the larger share (``max(f, 1 - f)``) of the next ``w`` longest and the
    smaller share of the ``w`` after them (``w = pp_size - 1``: the term ``k = 1`` of
    :func:`..pipeline_floor.idle_floor`, which the window load of :class:`.pp_balance.PipelineLoad`
    charges too). With one stage it is the stage work alone.

    ``balance`` drops a candidate and all its reorderings (short first, next levels first,
    singles first) at once when this is already slower than the best: they hold the same
    micro-batches per pipeline, so the same bound, and none of them then needs the 1F1B run of
    :func:`alone_floors`."""
    n = ctx.hdp_size
    if not placements:
        return 0.0
    by_seqs = units_by_seqs(units)
    placed = ctx.placed_time
    seconds = []
    rings = []
    for p in placements:
        u = by_seqs[p.seqs]
        ring = p.ring
        rings.append(ring)
        # a single-rank unit on its own rank runs at the time it was costed with
        seconds.append(u.time if len(ring) == 1 == u.ring_size else placed(u, ring))
    size = np.fromiter(map(len, rings), dtype=np.int64, count=len(rings))
    rank = np.fromiter(chain.from_iterable(rings), dtype=np.int64, count=int(size.sum()))
    t = np.repeat(np.asarray(seconds, dtype=float), size)
    work = np.bincount(rank, weights=t, minlength=n)
    w = pp_size - 1
    if w < 1:
        return float(work.max())
    # every pipeline's 2 w + 1 longest stage times, longest first (zero where it has fewer)
    order = np.lexsort((-t, rank))
    rank, t = rank[order], t[order]
    position = np.arange(len(rank)) - np.searchsorted(rank, rank)
    keep = position <= 2 * w
    top = np.zeros((n, 2 * w + 1))
    top[rank[keep], position[keep]] = t[keep]
    ff = ctx.cost_model.forward_fraction
    big, small = max(ff, 1.0 - ff), min(ff, 1.0 - ff)
    # never negative: each of the other 2 w is at most the longest, and the shares add up to 1
    idle = w * top[:, 0] - big * top[:, 1:w + 1].sum(axis=1) - small * top[:, w + 1:].sum(axis=1)
    return float((work + idle).max())


def alone_floor(placements: Sequence[Placement], units: Units, ctx: ShardingContext,
                pp_size: int) -> float:
    """A lower bound on the 1F1B step of ``placements``, at least :func:`order_free_floor`: the
    slowest pipeline's 1F1B run alone (:func:`..wavefront.pipelines_alone`), its rings waiting
    for no other member. The estimate runs the same ops with the rendezvous added, and each
    op's start is a maximum over its predecessors, so adding predecessors never starts an op
    earlier; its step time is at least its slowest pipeline's finish."""
    return alone_floors([(placements, units)], ctx, pp_size)[0]


def alone_floors(candidates: Sequence[tuple[Sequence[Placement], Units]], ctx: ShardingContext,
                 pp_size: int) -> list[float]:
    """:func:`alone_floor` of every ``(placements, units)`` candidate, in one wavefront run over
    all their pipelines side by side (pipelines run alone do not interact, so each candidate's
    maximum is its own; the wavefront's cost is per key, not per pipeline). A placement shared by
    candidates (short-first reorders the same objects) is timed once."""
    if not candidates:
        return []
    n = ctx.hdp_size
    # every distinct placement once, as a row of a table (its stage time, its members' span in
    # one flat array), by units list and id (all are alive here, so no id is reused); a
    # candidate is then a list of rows (a reordering of a list seen before is one lookup per
    # placement) and its flat members and times are numpy gathers
    tables: dict[int, dict[int, int]] = {}
    times: list[float] = []
    rings: list[tuple[int, ...]] = []
    rows = []
    for placements, units in candidates:
        row = tables.setdefault(id(units), {})
        try:
            rows.append([row[id(p)] for p in placements])
            continue
        except KeyError:
            pass
        by_seqs = units_by_seqs(units)
        for p in placements:
            if id(p) not in row:
                u = by_seqs[p.seqs]
                # a single-rank unit on its own rank runs at the time it was costed with
                times.append(u.time if len(p.ring) == 1 == u.ring_size else ctx.placed_time(u, p.ring))
                row[id(p)] = len(rings)
                rings.append(p.ring)
        rows.append([row[id(p)] for p in placements])
    size = np.fromiter(map(len, rings), dtype=np.int64, count=len(rings))
    members = np.fromiter(chain.from_iterable(rings), dtype=np.int64, count=int(size.sum()))
    pick = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=sum(map(len, rows)))
    sizes = size[pick]
    # entry j of a picked ring: its row's first entry + j, for all picked rings at once
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    # candidate k's pipelines are numbered k * n .. k * n + n - 1
    offset = np.repeat(np.arange(len(rows), dtype=np.int64) * n, [len(r) for r in rows])
    flat_r = members[np.repeat((np.cumsum(size) - size)[pick], sizes) + within] + np.repeat(offset, sizes)
    flat_t = np.repeat(np.array(times, dtype=float)[pick], sizes)
    alone = pipelines_alone_flat(flat_r, flat_t, n * len(candidates), pp_size, ctx.cost_model.forward_fraction)
    return [float(x) for x in alone.reshape(len(candidates), n).max(axis=1, initial=0.0)]
