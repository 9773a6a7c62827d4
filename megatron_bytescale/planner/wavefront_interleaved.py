"""The interleaved (virtual-stage) schedule of :func:`.pipeline_floor.simulate_schedule`, in
wavefronts.

``simulate_schedule`` times a plan with ``v`` virtual stages as a dependency graph walked one
Python step per node and edge: ``2 v pp`` nodes per micro-batch, a quarter of a second per plan on
the Fig. 17 cells at v = 4. PP-Balance times several candidates that way when it plans for
interleaved stages (:mod:`.schedulers.pp_vpp`), so this module computes the same times the way
:mod:`.wavefront` does for 1F1B.

Every pipeline runs one **template**: Megatron's interleaved schedule of ``M`` micro-batches (the
longest list rounded up to a multiple of ``pp``) restricted to its own local indices
(:func:`.pipeline_floor.template_stage_ops`). Give every op ``(phase, local index i, chunk c,
stage s)`` of that template the length of the longest path to it in the template's graph (its
stage sequences and each micro-batch's chain through the chunks and stages). Every edge goes
from a smaller key to a larger one; a pipeline's restricted sequence skips ops, but its
consecutive ops are still ordered by the template's (the keys grow along every path), and the
keys do not depend on a pipeline's own count. A ring micro-batch sits at the same local index on
all its members (D5), so it has one key on all of them. Ops of one key are therefore independent
and all their predecessors have smaller keys: one ``numpy`` step per key over every (op,
pipeline) is a topological order.

The times are the same floats as the graph walk's: a node starts at the largest finish of its
predecessors (and 0), a ring's at the largest over all its members, and ends at start plus its
weight (``t / v`` times ``forward_fraction`` or ``1 - forward_fraction``, the same products).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np


@lru_cache(maxsize=64)
def template_keys(m: int, pp: int, vpp: int) -> tuple[np.ndarray, ...]:
    """Every op of the interleaved template of ``m`` micro-batches, sorted by key: ``(bounds,
    phase, i, c, s, own, dep)``. ``bounds`` cuts the sorted ops into keys (ops ``bounds[k] ..
    bounds[k + 1] - 1`` share one); ``phase`` 0 is F, 1 B; ``own`` is the op's node in its
    micro-batch's block of ``2 vpp pp`` nodes, ``dep`` the node of its chain predecessor in that
    block, or -1 (F of chunk 0 on stage 0)."""
    from .pipeline_floor import pipeline_stage_ops  # pipeline_floor imports this module

    per = 2 * vpp * pp

    def node(i: int, ph: int, c: int, s: int) -> int:
        return i * per + (ph * vpp + c) * pp + s

    n = m * per
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    dep = [-1] * n

    def edge(a: int, b: int) -> None:
        succ[a].append(b)
        indeg[b] += 1

    for i in range(m):
        for c in range(vpp):
            for s in range(pp):
                if s > 0:
                    dep[node(i, 0, c, s)] = node(i, 0, c, s - 1)
                elif c > 0:
                    dep[node(i, 0, c, 0)] = node(i, 0, c - 1, pp - 1)
                if s < pp - 1:
                    dep[node(i, 1, c, s)] = node(i, 1, c, s + 1)
                elif c < vpp - 1:
                    dep[node(i, 1, c, pp - 1)] = node(i, 1, c + 1, 0)
        dep[node(i, 1, vpp - 1, pp - 1)] = node(i, 0, vpp - 1, pp - 1)
    for b, a in enumerate(dep):
        if a >= 0:
            edge(a, b)
    for s in range(pp):
        seq = [node(i, 0 if ph == "F" else 1, c, s) for ph, i, c in pipeline_stage_ops(list(range(m)), pp, vpp, s)]
        for a, b in zip(seq, seq[1:]):
            edge(a, b)
    depth = [0] * n
    queue = [v for v in range(n) if indeg[v] == 0]
    while queue:
        a = queue.pop()
        for b in succ[a]:
            if depth[a] + 1 > depth[b]:
                depth[b] = depth[a] + 1
            indeg[b] -= 1
            if indeg[b] == 0:
                queue.append(b)
    if any(indeg):
        raise RuntimeError(f"the interleaved template of {m} micro-batches (pp {pp}, vpp {vpp}) has a cycle")
    keys = np.asarray(depth, dtype=np.int64)
    ids = np.argsort(keys, kind="stable")  # the nodes, key by key
    keys = keys[ids]
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(keys)) + 1, [n]))
    own = ids % per
    i = ids // per
    ph, rest = np.divmod(own, vpp * pp)
    c, s = np.divmod(rest, pp)
    deps = np.asarray(dep, dtype=np.int64)[ids]
    out = (bounds, ph, i, c, s, own, np.where(deps >= 0, deps % per, -1))
    for a in out:  # cached and shared: read-only
        a.flags.writeable = False
    return out


def simulate_interleaved(lists: Sequence[Sequence[int]], seconds: Mapping[int, float], *, pp: int, vpp: int,
                         forward_fraction: float, stop_above: float | None = None) -> np.ndarray | None:
    """Per pipeline, when its last op finishes under the interleaved template (the floats of
    :func:`.pipeline_floor.simulate_schedule`), or None when a unit is not at one local index
    on every list that holds it (the keys would not order the graph: the caller walks it)."""
    n = len(lists)
    counts = np.fromiter((len(ul) for ul in lists), dtype=np.int64, count=n)
    flat = np.fromiter((u for ul in lists for u in ul), dtype=np.int64, count=int(counts.sum()))
    units, index = np.unique(flat, return_inverse=True)
    t = np.array([float(seconds.get(u, 0.0)) for u in units.tolist()])
    return simulate_interleaved_flat(np.repeat(np.arange(n), counts), index, t, n, pp=pp, vpp=vpp,
                                     forward_fraction=forward_fraction, stop_above=stop_above)


def simulate_interleaved_flat(pipeline: np.ndarray, index: np.ndarray, t: np.ndarray, n: int, *, pp: int, vpp: int,
                              forward_fraction: float, stop_above: float | None = None) -> np.ndarray | None:
    """:func:`simulate_interleaved` with every slot of every list as an entry of two flat
    arrays: the pipeline (0 .. n - 1) whose list holds it and its unit (an index into ``t``, the
    stage times, every unit in some slot), each pipeline's slots in list order (slots of
    different pipelines may interleave), as :func:`..wavefront.simulate_wavefront_flat` takes
    them.

    ``stop_above``: a caller that only needs the step when it is at most this value. Every
    :data:`STOP_EVERY` keys each stage's latest finish plus the stage work its pipeline has
    left there is a lower bound on that pipeline's finish (a stage runs its ops one after
    another); once one exceeds ``stop_above`` (by more than rounding) the run returns ``inf``
    for every pipeline."""
    counts = np.bincount(pipeline, minlength=n)
    if not counts.any():
        return np.zeros(n)
    by_pipe = np.argsort(pipeline, kind="stable")  # each pipeline's slots together, in list order
    pos = np.empty(len(pipeline), dtype=np.int64)
    pos[by_pipe] = np.arange(len(pipeline)) - np.repeat(np.cumsum(counts) - counts, counts)
    lo = np.full(len(t), len(pipeline), dtype=np.int64)
    hi = np.full(len(t), -1, dtype=np.int64)
    np.minimum.at(lo, index, pos)
    np.maximum.at(hi, index, pos)
    if np.any(lo != hi) or len(np.unique(pipeline * len(t) + index)) != len(pipeline):
        return None  # a unit at two local indices, or twice in one list
    m = -(-int(counts.max()) // pp) * pp
    slot = np.full((n, m), -1, dtype=np.int64)
    slot[pipeline, pos] = index
    t = np.asarray(t, dtype=np.float64) / vpp
    weight = np.stack([t * forward_fraction, t * (1.0 - forward_fraction)])  # [phase, unit]
    per = 2 * vpp * pp
    bounds, ph, i, c, s, own, dep = template_keys(m, pp, vpp)
    node_end = np.zeros(len(t) * per)
    stage_end = np.zeros((n, pp))
    if stop_above is not None:
        # left[r, s]: the work stage s of pipeline r has still to run (at first every unit of its
        # list, v chunks forward and v backward), less each op as it is timed
        per_unit = vpp * (weight[0] + weight[1])
        left = np.repeat(np.bincount(pipeline, weights=per_unit[index], minlength=n)[:, None], pp, axis=1)
    for key, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        if stop_above is not None and key % STOP_EVERY == 0 and key:
            if (stage_end + left).max() > stop_above * (1 + 1e-9):
                return np.full(n, np.inf)
        gi = i[a:b]
        op, r = np.nonzero(counts[None, :] > gi[:, None])  # the pipelines that run each op
        if not len(op):
            continue
        u = slot[r, gi[op]]
        st = s[a:b][op]
        d = dep[a:b][op]
        base = u * per
        ready = np.maximum(stage_end[r, st], np.where(d >= 0, node_end[base + np.maximum(d, 0)], 0.0))
        me = base + own[a:b][op]
        np.maximum.at(node_end, me, ready)  # a ring starts when its last member is ready
        w = weight[ph[a:b][op], u]
        end = node_end[me] + w
        node_end[me] = end
        stage_end[r, st] = end
        if stop_above is not None:
            left[r, st] -= w  # one op per (pipeline, stage) and key
    return stage_end.max(axis=1)


STOP_EVERY = 16
"""With ``stop_above``, how many keys between two checks of the bound."""
