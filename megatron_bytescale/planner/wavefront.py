"""The 1F1B simulation of :mod:`.order`, vectorised over pipelines and stages.

:func:`.order.simulate` times a PP plan as a dependency graph (Kahn's algorithm, one Python step
per node and edge). The planner estimates every PP-Balance candidate that way, and on the
Fig. 17 PP cells (a few hundred pipelines of 4-8 stages, tens of micro-batches each) that graph
walk was most of the planning time. This module computes the same times in *wavefronts*.

Give op F of local micro-batch i at stage s the key ``2 i + s`` and op B the key
``2 i + 2 pp - 1 - s``. Every edge of the graph goes from a smaller key to a larger one:

* F(i, s - 1) -> F(i, s) and B(i, s + 1) -> B(i, s): the key grows by one;
* F(i, pp - 1) -> B(i, pp - 1): from ``2 i + pp - 1`` to ``2 i + pp``;
* a stage's op sequence (:func:`.order.pipeline_ops`): warm-up forwards ``2 i + s`` ascending;
  F(w + k) -> B(k) -> F(w + k + 1) in the steady state (``w = pp - 1 - s``:
  ``2 k + 2 pp - 2 - s < 2 k + 2 pp - 1 - s < 2 k + 2 pp - s``); the cool-down backwards
  ascending; with fewer micro-batches than the warm-up (``m <= w``) the last forward's key
  ``2 m - 2 + s`` is below the first backward's ``2 pp - 1 - s``.

None of this depends on the pipeline's micro-batch count, so the keys order every pipeline's
graph at once, and a ring micro-batch, which sits at the same local index on all its members
(D5), has the same key on all of them. Ops of one key are therefore independent and their
predecessors all have smaller keys: processing key after key, each key as one ``numpy`` step over
every (pipeline, stage), is a topological order. At a given key stage s runs an F when
``key - s`` is even and a B when it is odd, and the cross-stage predecessor of every op is the
op of the previous key on the neighbouring stage (F: stage s - 1; B: stage s + 1, or the same
stage's F at the last stage).

The times are the same floats as the graph walk's: a node starts at the largest finish of its
predecessors (and 0), the members of a ring at the largest over all of them, and ends at start
plus its weight (``t * forward_fraction`` or ``t * (1 - forward_fraction)``, the same products);
maxima are exact and each finish is one addition, so the order of evaluation cannot change them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def simulate_wavefront(lists: Sequence[Sequence[int]], dur: Mapping[int, float], pp: int,
                       forward_fraction: float) -> np.ndarray | None:
    """Per pipeline (HDP rank), when its last op finishes; ``lists`` holds every rank's orders in
    list order. None when a ring's micro-batch is not at one local index on all its members (the
    keys would not order the graph; the caller walks the graph instead)."""
    n = len(lists)
    counts = np.fromiter((len(ol) for ol in lists), dtype=np.int64, count=n)
    flat = np.fromiter((o for ol in lists for o in ol), dtype=np.int64, count=int(counts.sum()))
    orders, index = np.unique(flat, return_inverse=True)
    t = np.array([float(dur.get(o, 0.0)) for o in orders.tolist()])
    return simulate_wavefront_flat(np.repeat(np.arange(n), counts), index, t, n, pp, forward_fraction)


def simulate_wavefront_flat(pipeline: np.ndarray, index: np.ndarray, t: np.ndarray, n: int, pp: int,
                            forward_fraction: float, stop_above: float | None = None) -> np.ndarray | None:
    """:func:`simulate_wavefront` with every slot of every list as an entry of two flat arrays:
    the pipeline (0 .. n - 1) whose list holds it and its micro-batch (an index into ``t``, the
    stage times), each pipeline's slots in list order (slots of different pipelines may
    interleave).

    ``stop_above``: a caller that only needs the step when it is at most this value (a
    candidate against the best so far) gets ``inf`` for every pipeline as soon as some
    pipeline provably finishes later (:func:`_run`), without the remaining keys."""
    pipeline = np.asarray(pipeline, dtype=np.int64)
    index = np.asarray(index, dtype=np.int64)
    counts = np.bincount(pipeline, minlength=n)
    depth = int(counts.max()) if n else 0
    if depth == 0:
        return np.zeros(n)
    by_pipeline = np.argsort(pipeline, kind="stable")  # list order kept within a pipeline
    index = index[by_pipeline]
    local = np.arange(len(index)) - np.repeat(np.cumsum(counts) - counts, counts)
    m = len(t)
    # D5: every micro-batch at one local index (all its slots have the index of its last slot)
    first = np.zeros(m, dtype=np.int64)
    first[index] = local
    if not np.array_equal(first[index], local):
        return None
    holders = np.bincount(index, minlength=m)
    grid = np.full((n, depth), m, dtype=np.int64)  # m: a weightless micro-batch past every list's end
    grid[pipeline[by_pipeline], local] = index
    return _run(grid, np.append(np.asarray(t, dtype=float), 0.0), np.append(holders > 1, False)[grid], pp,
                forward_fraction, stop_above)


def pipelines_alone(times: Sequence[Sequence[float]], pp: int, forward_fraction: float) -> np.ndarray:
    """Per pipeline, its 1F1B makespan run alone: ``times[r]`` are its micro-batches' stage
    times in list order, and a ring micro-batch waits for nobody.

    A lower bound on the pipeline's finish in :func:`simulate_wavefront` with the same times:
    the graph is the same minus the rendezvous, so every op's set of predecessors shrinks and its
    start (a maximum over them) can only come earlier."""
    n = len(times)
    counts = np.fromiter((len(ts) for ts in times), dtype=np.int64, count=n)
    flat = np.fromiter((x for ts in times for x in ts), dtype=float, count=int(counts.sum()))
    return pipelines_alone_flat(np.repeat(np.arange(n), counts), flat, n, pp, forward_fraction)


def pipelines_alone_flat(pipeline: np.ndarray, times: np.ndarray, n: int, pp: int,
                         forward_fraction: float) -> np.ndarray:
    """:func:`pipelines_alone` with every micro-batch as an entry of two flat arrays: the
    pipeline (0 .. n - 1) whose list holds it and its stage time, each pipeline's entries in
    list order (entries of different pipelines may interleave).

    Pipelines alone do not interact, so they are timed in bands of similar micro-batch counts
    (:func:`_count_bands`), each band as one grid as deep as its longest list: ``balance`` times
    thousands of pipelines at once here, most with under twenty micro-batches and a few with
    over a hundred, and one grid for all of them was mostly pads. Each pipeline's ops are the
    same maxima and sums in any band, so the floats do not depend on the banding."""
    pipeline = np.asarray(pipeline, dtype=np.int64)
    counts = np.bincount(pipeline, minlength=n)
    out = np.zeros(n)
    if len(pipeline) == 0:
        return out
    by_pipeline = np.argsort(pipeline, kind="stable")  # list order kept within a pipeline
    t = np.asarray(times, dtype=float)[by_pipeline]
    local = np.arange(len(by_pipeline)) - np.repeat(np.cumsum(counts) - counts, counts)
    owner = pipeline[by_pipeline]
    row = np.empty(n, dtype=np.int64)  # each pipeline's row in its band's grid
    band_of = np.empty(n, dtype=np.int64)
    bands = _count_bands(counts)
    for b, members in enumerate(bands):
        row[members] = np.arange(len(members))
        band_of[members] = b
    for b, members in enumerate(bands):
        mine = np.flatnonzero(band_of[owner] == b)
        pad = len(mine)
        grid = np.full((len(members), int(counts[members].max())), pad, dtype=np.int64)
        grid[row[owner[mine]], local[mine]] = np.arange(pad)
        out[members] = _run(grid, np.append(t[mine], 0.0), np.zeros(grid.shape, dtype=bool), pp,
                            forward_fraction)
    return out


def _count_bands(counts: np.ndarray) -> list[np.ndarray]:
    """The pipelines with micro-batches, in bands by count: from the largest count ``c`` left, every
    pipeline with more than ``c / 2``. A band's grid is then at least half full, and there are
    at most ``log2`` of the largest count bands."""
    order = np.argsort(-counts, kind="stable")
    ranked = counts[order]
    bands, i = [], 0
    while i < len(ranked) and ranked[i] > 0:
        j = int(np.searchsorted(-ranked, -(ranked[i] // 2), side="left"))  # first count <= c // 2
        bands.append(order[i:j])
        i = j
    return bands


def _run(grid: np.ndarray, t: np.ndarray, ring_grid: np.ndarray, pp: int, forward_fraction: float,
         stop_above: float | None = None) -> np.ndarray:
    """The wavefronts (module docstring): ``grid[r, i]`` is the order index of pipeline r's
    i-th micro-batch (``len(t) - 1``, a weightless pad, past its end), ``t`` the stage time of
    every order index, ``ring_grid`` where a slot is a ring's.

    Pipelines are sorted by micro-batch count (most first), so those that still have a
    micro-batch at index i are a prefix, and a key only touches the prefix its stages can reach:
    balance plans give a few pipelines far more (short) micro-batches than the rest, and the
    full grid is mostly pads. Sorting permutes pipelines only (a ring's start is a maximum over
    its members wherever they sit). Arrays are stage-major (``[stage, pipeline]``,
    ``[micro-batch, phase, pipeline]``), so a key's work is row gathers of slices.

    With ``stop_above``, every :data:`_STOP_EVERY` keys each stage's latest finish plus the
    stage work its pipeline has left (its forwards and backwards past the key) is a lower bound
    on that pipeline's finish (a stage runs its ops one after another); once one exceeds
    ``stop_above`` (by more than rounding) the run returns ``inf`` for every pipeline."""
    n, depth = grid.shape
    pad = len(t) - 1
    counts = (grid != pad).sum(axis=1)
    by_count = np.argsort(-counts, kind="stable")
    g = np.ascontiguousarray(grid[by_count].T)  # [micro-batch, pipeline]
    # reach[i]: the pipelines with more than i micro-batches, a prefix of the sorted order
    reach = np.searchsorted(-counts[by_count], -np.arange(depth), side="left")
    weight = np.stack([t * forward_fraction, t * (1.0 - forward_fraction)])  # [phase, order]
    w = np.ascontiguousarray(weight[:, g].transpose(1, 0, 2))  # [micro-batch, phase, pipeline]
    live_grid = g != pad
    ring_t = np.ascontiguousarray(ring_grid[by_count].T) & live_grid
    if stop_above is not None:
        # left[i, phase, pipeline]: the stage work of that phase from micro-batch i on (0 at depth)
        left = np.zeros((depth + 1, 2, n))
        left[:depth] = np.cumsum(w[::-1], axis=0)[::-1]
    any_ring = bool(ring_t.any())
    stages = np.arange(pp)
    # per key (row) and stage (column), worked out at once: F or B, its micro-batch index, whether
    # the stage runs an op, and its cross-stage predecessor row: an F reads stage s - 1, a B
    # stage s + 1 (the F at pp - 1); an F at stage 0 has none and reads its own stage's op of
    # the previous key, which its stage's latest finish (``last``) already bounds
    keys = np.arange(2 * depth + 2 * pp - 2)[:, None]
    forward = (keys - stages) % 2 == 0
    index = np.where(forward, (keys - stages) // 2, (keys - 2 * pp + 1 + stages) // 2)
    runs = (index >= 0) & (index < depth)
    # every key runs an op at some stage (the keys run from the first F to the last B of the
    # longest list without a gap: up to key 2 depth - 1 the F of index k // 2 at stage k mod 2,
    # or with one stage the B; then the B ops of the last micro-batches on their way back up),
    # so ``lowest`` < depth, ``reach[lowest]`` is defined and at least one pipeline is reached
    lowest = np.where(runs, index, depth).min(axis=1)
    # the pipelines after the first ``width`` are past their end at every stage that runs
    width = reach[lowest].tolist()
    # from which key on only few pipelines are left and no ring: the rest runs in Python
    # (:func:`_tail`), where numpy's per-call cost would dominate
    later_width = np.maximum.accumulate(np.asarray(width)[::-1])[::-1]
    later_lowest = np.minimum.accumulate(lowest[::-1])[::-1]
    ring_rows = np.flatnonzero(ring_t.any(axis=1))
    ring_free = int(ring_rows[-1]) + 1 if len(ring_rows) else 0
    python_from = np.flatnonzero((later_width * pp <= _TAIL_OPS) & (later_lowest >= ring_free))
    tail_key = int(python_from[0]) if len(python_from) else len(width)
    raw_index = index
    index = np.clip(index, 0, depth - 1)
    column = np.where(forward, np.maximum(stages - 1, 0), np.minimum(stages + 1, pp - 1))
    phase = np.where(forward, 0, 1)
    stage_runs = runs[:, :, None]
    last = np.zeros((pp, n))  # finish of each stage's latest op
    prev = np.zeros((pp, n))  # finish of the ops of the previous key
    buf = np.zeros((pad + 1) * pp)  # per (order, stage): its ring's start; zero between uses
    stage_col = np.broadcast_to(stages[:, None], (pp, n))
    for key, m in enumerate(width[:tail_key]):
        if stop_above is not None and key % _STOP_EVERY == 0 and key:
            # the keys before this one are done: at stage s the forwards of index > (key - 1 - s)
            # // 2 (F(i, s) has key 2 i + s) and the backwards of index > (key - 2 pp + s) // 2
            # (B(i, s) has key 2 i + 2 pp - 1 - s) are still to run
            f_next = np.clip((key - 1 - stages) // 2 + 1, 0, depth)
            b_next = np.clip((key - 2 * pp + stages) // 2 + 1, 0, depth)
            bound = last + left[f_next, 0] + left[b_next, 1]
            if bound.max() > stop_above * (1 + 1e-9):
                return np.full(n, np.inf)
        ik = index[key]
        old = last[:, :m]
        start = np.maximum(old, prev[column[key], :m])  # [stage, pipeline]
        live = live_grid[ik, :m] & stage_runs[key]
        if any_ring:
            rings = ring_t[ik, :m] & live
            if rings.any():  # a ring starts when its last member may: the max over members
                slot = g[ik, :m][rings] * pp + stage_col[:, :m][rings]
                np.maximum.at(buf, slot, start[rings])
                start[rings] = buf[slot]
                buf[slot] = 0.0
        finish = start + w[ik, phase[key], :m]
        prev = np.zeros((pp, n))
        np.copyto(prev[:, :m], finish, where=live)
        np.copyto(old, finish, where=live)
    finish = last.max(axis=0)
    if tail_key < len(width):
        m = int(later_width[tail_key])
        keys_left = slice(tail_key, None)
        finish[:m] = _tail(last[:, :m], prev[:, :m], w[:, :, :m], counts[by_count][:m].tolist(),
                           raw_index[keys_left].tolist(), runs[keys_left].tolist(), forward[keys_left].tolist(),
                           column[keys_left].tolist())
    out = np.empty(n)
    out[by_count] = finish
    return out


_STOP_EVERY = 16
"""With ``stop_above``, how many keys between two checks of the bound (a check costs about as
much as a key)."""

_TAIL_OPS = 48
"""Switch to :func:`_tail` once the pipelines left times the stages are at most this: a key costs
numpy ~13 calls (~20 us) whatever its width, Python well under a microsecond per op."""


def _tail(last: np.ndarray, prev: np.ndarray, w: np.ndarray, counts: list[int], index: list[list[int]],
          runs: list[list[bool]], forward: list[list[bool]], column: list[list[int]]) -> list[float]:
    """The keys left, pipeline by pipeline in Python floats: the same maxima and sums as the
    wavefront loop (IEEE doubles either way), valid where no ring is left (nothing couples the
    pipelines). ``last`` / ``prev`` ``[stage, pipeline]`` as the loop left them, ``w``
    ``[micro-batch, phase, pipeline]``, the per-key lists from the key ``index`` / ``runs`` /
    ``forward`` / ``column`` tables; returns each pipeline's finish."""
    pp = last.shape[0]
    stages = range(pp)
    out = []
    for j, count in enumerate(counts):
        wf, wb = w[:, 0, j].tolist(), w[:, 1, j].tolist()
        done, before = last[:, j].tolist(), prev[:, j].tolist()
        for ik, rk, fk, ck in zip(index, runs, forward, column):
            now = [0.0] * pp
            for s in stages:
                i = ik[s]
                if rk[s] and i < count:
                    a, b = done[s], before[ck[s]]
                    f = (a if a >= b else b) + (wf[i] if fk[s] else wb[i])
                    now[s] = done[s] = f
            before = now
        out.append(max(done))
    return out
