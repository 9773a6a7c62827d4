"""The 1F1B fill-and-drain floor and two ways to lower it: interleaved (virtual) pipeline
stages and long micro-batches split into causal chunks along the pipeline (Seq1F1B-style).

Why this module exists. With PP, every HDP rank is a pipeline of ``p`` stages running 1F1B
over its own micro-batch list, and a ring micro-batch is a rendezvous of its members'
pipelines (:mod:`.order`). While a micro-batch of stage time ``t`` crosses the other ``p - 1``
stages, forward and back, a stage can only run what its 1F1B window holds: a pipeline whose
longest micro-batch is ``t_max`` idles about ``(p - 1) * t_max`` per step. That floor, not the
assignment, is what keeps PP-Balance above the work bound for the largest models
(docs/benchmarks.md, section "pipeline"). This module times the same plan under two schedules
that shrink it; everything else (rings, members, order numbers) stays the plan's.

**Interleaved 1F1B** (Megatron-LM's ``forward_backward_pipelining_with_interleaving``).
Each stage holds ``v`` model chunks of ``layers_per_stage / v`` layers; model chunk ``c`` of
stage ``s`` is virtual stage ``c * p + s``, so a micro-batch goes round the ``p`` stages ``v``
times. Op order on a stage is Megatron's schedule table (:func:`interleaved_table`): local
micro-batches in groups of ``g = p``, each group forwarded through chunk 0, then chunk 1, ...;
backward the same with the chunks reversed; warm-up ``2 (p - s - 1) + (v - 1) g`` forwards
(capped at all ``m v`` of them), then one forward one backward, then the cool-down.

Derivation of the bubble. Take ``m`` equal micro-batches of stage time ``t`` (forward
``t_f``, backward ``t_b``, ``t = t_f + t_b``), ``m`` a multiple of ``p``. Without interleaving
the last stage starts its first forward after ``p - 1`` forwards upstream and the first stage
ends ``p - 1`` backwards after the last one does, so the makespan is
``m t + (p - 1)(t_f + t_b) = (m + p - 1) t``: a bubble of ``(p - 1) t``. With ``v`` chunks each
op lasts ``t_f / v`` or ``t_b / v``; the stage still works ``m t`` in all, and the fill and the
drain each cross ``p - 1`` *chunk* ops instead of whole-stage ops, so

    makespan(v) = m t + (p - 1) t / v,    bubble fraction (p - 1) / (v m)

(Narayanan et al., SC'21, §2.2). With ``v = 1`` it is exactly the 1F1B makespan. The formula
holds for equal micro-batches; unequal ones (HDP's lists) are timed by the event simulation
(:func:`simulate_schedule`), which the tests hold to the formula when times are equal.

**Sequence chunks** (Seq1F1B, Sun et al. 2024). A ring micro-batch of documents of lengths
``P_j`` is split into ``k`` causal chunks that follow each other through the pipeline as
separate units: chunk ``i`` holds positions ``[i P_j / k, (i + 1) P_j / k)`` of every document
and attends to the K/V of chunks ``<= i`` kept from forward, so its attention work is
``(2 i + 1) / k**2`` of the whole and its linear work ``1 / k``. Backward runs the chunks in
reverse (chunk ``i``'s backward produces the dK/dV that chunk ``i - 1``'s needs). Three costings:

* ``"ideal"``: chunk ``i`` costs the micro-batch's non-attention time over ``k`` plus its
  attention time times ``(2 i + 1) / k**2``: no extra transfer, no per-call overhead beyond
  the micro-batch's own. An upper bound on what splitting can gain.
* ``"cached"``: the cost model's ring formula per chunk (:meth:`CostModel.ring_time_terms`)
  where every member keeps the K/V blocks of earlier chunks that passed it during their
  rotation, so a ring step of chunk ``i`` moves only chunk ``i``'s own K/V (``1 / k`` of the
  sequence's) while computing ``(2 i + 1) / k**2`` of the attention; the prefix's dK/dV is
  accumulated locally and its reduction is not charged (optimistic). Memory: every member
  holds the whole prefix's K/V per layer, ``D`` times its own share.
* ``"ring"``: the same formula when members keep only their own shares, so chunk ``i``'s
  ring rotates the K/V of the whole prefix, ``(i + 1) / k`` of the sequence's, behind
  ``(2 i + 1) / k**2`` of the compute.

In both ring costings every chunk pays the per-layer constant and the ring-step overheads and
no chunk offloads (each holds ``1 / k`` of the activations).

Stage op order with chunks: forwards in list order; before the ``j``-th backward (backward
order: the list with every split micro-batch's chunks reversed) the stage has issued
``max(warm-up + j + 1, position of that backward's forward + 1)`` forwards, which is 1F1B
when nothing is split and lets every chunk's forward run before the split micro-batch's first
backward (its last chunk's).

Deadlocks. Rings couple pipelines, and a schedule that orders two ring ops differently on two
member pipelines deadlocks. Ring members hold a ring at the same local index, and plain 1F1B's
op order at a local index does not depend on the list's length, so it never does. Megatron's
interleaved table does: the last group takes the rest and the warm-up is capped at ``m v``, so
pipelines ``[0, 1]`` and ``[0, ..., 7]`` sharing rings 0 and 1 (p 4, v 2) order them
differently and deadlock (``own_tables=True`` reproduces it; :func:`simulate_schedule`
returns None). By default every pipeline follows one template instead
(:func:`template_stage_ops`): the schedule of the longest list, rounded up to a multiple of
``p``, restricted to its own indices, which cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .cost_model import CostModel
from .plan import StepPlan
from .topology import Topology
from .wavefront_interleaved import simulate_interleaved

SPLIT_COSTINGS = ("ideal", "cached", "ring")


# --------------------------------------------------------------------------- op orders
def interleaved_table(num_micro_batches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """Megatron-LM's forward order ``(local micro-batch, model chunk)`` of the interleaved
    schedule: groups of ``group`` micro-batches (the last one takes the rest), each through
    chunk 0, then chunk 1, ... (the backward order is the same with chunk ``vpp - 1 - c``)."""
    out: list[tuple[int, int]] = []
    m = num_micro_batches
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        out.extend((i, c) for c in range(vpp) for i in range(lo, hi))
    return out


def stage_ops(forward: Sequence[tuple[int, int]], backward: Sequence[tuple[int, int]], warmup: int
              ) -> list[tuple[str, int, int]]:
    """One stage's op sequence ``("F"|"B", unit, chunk)`` from its forward and backward orders:
    ``warmup`` forwards, then before the j-th backward enough forwards that ``warmup + j + 1``
    (capped at all) and that backward's own forward have been issued, then the rest."""
    total = len(forward)
    where = {op: k for k, op in enumerate(forward)}
    ops: list[tuple[str, int, int]] = []
    issued = 0
    warmup = min(warmup, total)
    for j, op in enumerate(backward):
        target = max(min(total, warmup + j + 1), where[op] + 1)
        while issued < target:
            ops.append(("F", *forward[issued]))
            issued += 1
        ops.append(("B", *op))
    while issued < total:  # only when there are no backwards at all (never in training)
        ops.append(("F", *forward[issued]))
        issued += 1
    return ops


def pipeline_stage_ops(units: Sequence[int], pp: int, vpp: int, stage: int, *,
                       chunk_groups: Mapping[int, int] | None = None) -> list[tuple[str, int, int]]:
    """The op sequence of ``stage`` for a pipeline whose unit list is ``units`` (global unit ids).

    ``vpp`` 1: 1F1B (backwards in list order except that consecutive units sharing a
    ``chunk_groups`` value run reversed: the chunks of one split micro-batch). ``vpp`` > 1:
    Megatron's interleaved table with groups of ``pp`` local micro-batches and its warm-up.
    """
    m = len(units)
    if vpp == 1:
        forward = [(u, 0) for u in units]
        backward: list[tuple[int, int]] = []
        k = 0
        while k < m:
            g = chunk_groups.get(units[k]) if chunk_groups else None
            j = k + 1
            while g is not None and j < m and chunk_groups.get(units[j]) == g:  # type: ignore[union-attr]
                j += 1
            backward.extend((u, 0) for u in reversed(units[k:j]))
            k = j
        return stage_ops(forward, backward, pp - 1 - stage)
    table = interleaved_table(m, vpp, pp)
    forward = [(units[i], c) for i, c in table]
    backward = [(units[i], vpp - 1 - c) for i, c in table]
    return stage_ops(forward, backward, 2 * (pp - 1 - stage) + (vpp - 1) * pp)


def template_stage_ops(lengths: Sequence[int], pp: int, vpp: int, stage: int) -> list[list[tuple[str, int, int]]]:
    """Interleaved op sequences of ``stage`` for pipelines of ``lengths`` micro-batches that
    agree with each other: Megatron's schedule for ``M`` micro-batches, the longest list
    rounded up to a multiple of ``pp``, restricted on each pipeline to its own local indices
    ``< m``. (Megatron refuses a last group of 1 to ``pp - 1`` micro-batches: with its warm-up
    such a table deadlocks on its own, e.g. ``pp`` 4, ``vpp`` 4, 5 micro-batches.)

    Ring members hold a micro-batch at the same local index (:meth:`StepPlan.validate`), so
    every pipeline runs shared ops in the template's order and the coupled graph stays acyclic
    (every edge follows one topological order of the template's graph). Megatron's own table
    depends on ``m`` (the last group takes the rest; the warm-up is capped at ``m v``), which
    lets two member pipelines order two shared ops differently: a deadlock. With ``vpp`` 1 the
    restriction is exactly each pipeline's own 1F1B (:func:`.order.pipeline_ops`).
    """
    top = -(-max(lengths, default=0) // pp) * pp
    template = pipeline_stage_ops(list(range(top)), pp, vpp, stage)
    return [[op for op in template if op[1] < m] for m in lengths]


# --------------------------------------------------------------------------- simulation
@dataclass
class ScheduleResult:
    """Per pipeline, when its last op finishes; node times when recorded."""

    rank_finish_s: np.ndarray
    node_times: dict[tuple[int, str, int, int], tuple[float, float]] = field(default_factory=dict)
    """``(unit, "F"|"B", model chunk, stage) -> (start, finish)`` when ``record``."""


def simulate_schedule(lists: Sequence[Sequence[int]], seconds: Mapping[int, float], *, pp: int, vpp: int = 1,
                      forward_fraction: float = 1.0 / 3.0, chunk_groups: Mapping[int, int] | None = None,
                      own_tables: bool = False, record: bool = False) -> ScheduleResult | None:
    """Time every pipeline's schedule; a unit shared by several lists is a ring (its ops are
    rendezvous of all its pipelines). None if the schedule deadlocks.

    ``seconds[u]``: the unit's time per member on one whole stage (all ``vpp`` chunks, forward
    and backward); each op takes ``seconds[u] / vpp`` times ``forward_fraction`` (forward) or
    the rest (backward). Edges: each stage's op sequence; ``F(c, s - 1) -> F(c, s)``,
    ``F(c - 1, p - 1) -> F(c, 0)``; ``F(v - 1, p - 1) -> B(v - 1, p - 1)``;
    ``B(c, s + 1) -> B(c, s)``, ``B(c + 1, 0) -> B(c, p - 1)``. With ``vpp`` > 1 the stages
    follow :func:`template_stage_ops` (one schedule all pipelines agree on), or with
    ``own_tables`` Megatron's table of each pipeline's own length (which may deadlock).

    The template's times come from :mod:`.wavefront_interleaved` (the same floats, one numpy
    step per key) unless node times are recorded or a unit sits at two local indices; the rest
    walks the graph (:func:`walk_schedule`).
    """
    if pp < 1 or vpp < 1:
        raise ValueError(f"pp ({pp}) and vpp ({vpp}) must be >= 1")
    if vpp > 1 and not own_tables and not record and chunk_groups is None:
        # the same floats in one numpy step per key; None when a unit sits at two local indices
        finish = simulate_interleaved(lists, seconds, pp=pp, vpp=vpp, forward_fraction=forward_fraction)
        if finish is not None:
            return ScheduleResult(rank_finish_s=finish)
    return walk_schedule(lists, seconds, pp=pp, vpp=vpp, forward_fraction=forward_fraction,
                         chunk_groups=chunk_groups, own_tables=own_tables, record=record)


def walk_schedule(lists: Sequence[Sequence[int]], seconds: Mapping[int, float], *, pp: int, vpp: int = 1,
                  forward_fraction: float = 1.0 / 3.0, chunk_groups: Mapping[int, int] | None = None,
                  own_tables: bool = False, record: bool = False) -> ScheduleResult | None:
    """:func:`simulate_schedule` as a dependency graph walked node by node (Kahn's algorithm):
    what the interleaved wavefronts (:mod:`.wavefront_interleaved`) are checked against, and the
    way for recorded node times, Megatron's own tables, split chunks and misaligned rings."""
    units = sorted({u for ul in lists for u in ul})
    index = {u: k for k, u in enumerate(units)}
    per = 2 * vpp * pp  # nodes per unit

    def node(k: int, phase: int, c: int, s: int) -> int:
        return ((k * 2 + phase) * vpp + c) * pp + s

    n_nodes = per * len(units)
    weight = [0.0] * n_nodes
    succ: list[list[int]] = [[] for _ in range(n_nodes)]
    indeg = [0] * n_nodes

    def edge(a: int, b: int) -> None:
        succ[a].append(b)
        indeg[b] += 1

    for k, u in enumerate(units):
        t = float(seconds.get(u, 0.0)) / vpp
        f, b = t * forward_fraction, t * (1.0 - forward_fraction)
        for c in range(vpp):
            for s in range(pp):
                weight[node(k, 0, c, s)] = f
                weight[node(k, 1, c, s)] = b
                if s > 0:
                    edge(node(k, 0, c, s - 1), node(k, 0, c, s))
                    edge(node(k, 1, c, s), node(k, 1, c, s - 1))
            if c > 0:
                edge(node(k, 0, c - 1, pp - 1), node(k, 0, c, 0))
                edge(node(k, 1, c, 0), node(k, 1, c - 1, pp - 1))
        edge(node(k, 0, vpp - 1, pp - 1), node(k, 1, vpp - 1, pp - 1))
    templates = [template_stage_ops([len(ul) for ul in lists], pp, vpp, s) for s in range(pp)] \
        if vpp > 1 and not own_tables else None
    last_nodes: list[list[int]] = []
    for r, ul in enumerate(lists):
        ends = []
        for s in range(pp):
            if templates is not None:
                ops = [(ph, ul[i], c) for ph, i, c in templates[s][r]]
            else:
                ops = pipeline_stage_ops(ul, pp, vpp, s, chunk_groups=chunk_groups)
            seq = [node(index[u], 0 if ph == "F" else 1, c, s) for ph, u, c in ops]
            for a, b in zip(seq, seq[1:]):
                edge(a, b)
            if seq:
                ends.append(seq[-1])
        last_nodes.append(ends)
    ready = [0.0] * n_nodes
    finish = [0.0] * n_nodes
    queue = [v for v in range(n_nodes) if indeg[v] == 0]
    done = 0
    while queue:
        a = queue.pop()
        end = ready[a] + weight[a]
        finish[a] = end
        done += 1
        for b in succ[a]:
            if end > ready[b]:
                ready[b] = end
            indeg[b] -= 1
            if indeg[b] == 0:
                queue.append(b)
    if done != n_nodes:
        return None
    out = np.array([max((finish[v] for v in ends), default=0.0) for ends in last_nodes])
    times: dict[tuple[int, str, int, int], tuple[float, float]] = {}
    if record:
        for k, u in enumerate(units):
            for phase in (0, 1):
                for c in range(vpp):
                    for s in range(pp):
                        v = node(k, phase, c, s)
                        times[(u, "FB"[phase], c, s)] = (ready[v], finish[v])
    return ScheduleResult(rank_finish_s=out, node_times=times)


def interleaved_makespan(num_micro_batches: int, stage_seconds: float, *, pp: int, vpp: int) -> float:
    """``m t + (p - 1) t / v``: the interleaved 1F1B makespan of ``m`` equal micro-batches of
    stage time ``t`` (module docstring; exact when ``m`` is a multiple of ``p``)."""
    return num_micro_batches * stage_seconds + (pp - 1) * stage_seconds / vpp


# --------------------------------------------------------------------------- sequence chunks
def chunk_seconds(cost_model: CostModel, *, sum_p: float, sum_p2: float, ring_size: int, layers: int,
                  seconds: float, chunks: int, costing: str, intra_node: bool = True, node_group: float = 1,
                  num_docs: float = 1) -> np.ndarray:
    """Stage time per member of each of the ``chunks`` causal chunks of one ring micro-batch
    (``seconds``: the whole micro-batch's; costings in the module docstring)."""
    if costing not in SPLIT_COSTINGS:
        raise ValueError(f"unknown split costing {costing!r}; choose one of {SPLIT_COSTINGS}")
    k = np.arange(chunks, dtype=np.float64)
    attn_share = (2 * k + 1) / chunks**2
    attn = layers * cost_model.alpha1 * sum_p2 / ring_size
    if costing == "ideal":
        return (seconds - attn) / chunks + attn * attn_share
    prefix = (k + 1) / chunks if costing == "ring" else np.full(chunks, 1.0 / chunks)
    terms = cost_model.ring_time_terms(
        sum_p * prefix, sum_p2 * attn_share, np.full(chunks, ring_size), layers=layers,
        intra_node=np.full(chunks, intra_node), node_group=np.full(chunks, node_group), num_docs=num_docs,
    )
    total = np.asarray(terms.compute + terms.exposed_comm + terms.step_overhead, dtype=np.float64)
    # the formula's linear term saw the rotated tokens; a chunk computes only its own
    return total - layers * cost_model.beta1 * (sum_p * prefix - sum_p / chunks) / ring_size


@dataclass(frozen=True, kw_only=True)
class FloorResult:
    """One plan timed under one pipeline schedule."""

    step_s: float
    """The slowest pipeline's makespan (micro-batch phase)."""
    lower_bound_s: float
    """Busy stage-seconds over pipelines (perfect balance, no bubble)."""
    rank_finish_s: np.ndarray
    split_micro_batches: int = 0


def time_plan(plan: StepPlan, cost_model: CostModel, *, vpp: int = 1, split_chunks: int = 1, split_costing: str = "ideal",
              split_min_ring: int = 2, split_min_seconds: float = 0.0, own_tables: bool = False,
              topology: Topology | None = None) -> FloorResult | None:
    """Time ``plan`` (PP > 1) with ``vpp`` virtual stages, or with every ring micro-batch of at
    least ``split_min_ring`` members and ``split_min_seconds`` stage time split into
    ``split_chunks`` causal chunks (``vpp`` 1). None if that schedule deadlocks."""
    from .estimate import micro_batch_costs  # estimate imports this module

    if isinstance(split_chunks, bool) or not isinstance(split_chunks, int) or split_chunks < 1:
        raise ValueError(f"split_chunks ({split_chunks!r}) must be an integer >= 1")
    if split_chunks > 1 and vpp > 1:
        raise ValueError("sequence chunks are modelled with vpp 1 only")
    costs = micro_batch_costs(plan, cost_model, topology)
    lists = [[mb.order for mb in rp.micro_batches] for rp in plan.ranks]
    seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
    busy = float(np.sum(costs.seconds * costs.ring_sizes))
    groups: dict[int, int] = {}
    split = 0
    if split_chunks > 1:
        # unit ids: order * split_chunks + chunk, so list order stays ascending
        new_seconds: dict[int, float] = {}
        split_orders: set[int] = set()
        busy = 0.0
        for k, o in enumerate(costs.orders.tolist()):
            d = int(costs.ring_sizes[k])
            if d >= split_min_ring and costs.seconds[k] >= split_min_seconds:
                t = chunk_seconds(
                    cost_model, sum_p=float(costs.sum_p[k]), sum_p2=float(costs.sum_p2[k]), ring_size=d,
                    layers=plan.layers_per_stage, seconds=float(costs.seconds[k]), chunks=split_chunks,
                    costing=split_costing, intra_node=bool(costs.intra_node[k]),
                    node_group=float(costs.node_group[k]), num_docs=float(costs.num_docs[k]),
                )
                for i in range(split_chunks):
                    new_seconds[o * split_chunks + i] = float(t[i])
                    groups[o * split_chunks + i] = o
                busy += float(t.sum()) * d
                split_orders.add(o)
            else:
                new_seconds[o * split_chunks] = float(costs.seconds[k])
                busy += float(costs.seconds[k]) * d
        seconds = new_seconds
        split = len(split_orders)
        lists = [[o * split_chunks + i for o in ol for i in (range(split_chunks) if o in split_orders else (0,))]
                 for ol in lists]
    sim = simulate_schedule(lists, seconds, pp=plan.pp_size, vpp=vpp, forward_fraction=cost_model.forward_fraction,
                            chunk_groups=groups or None, own_tables=own_tables)
    if sim is None:
        return None
    n = plan.hdp_size
    return FloorResult(step_s=float(sim.rank_finish_s.max(initial=0.0)), lower_bound_s=busy / n if n else 0.0,
                       rank_finish_s=sim.rank_finish_s, split_micro_batches=split)


def idle_floor(stage_seconds: Sequence[float], pp: int, forward_fraction: float) -> float:
    """Seconds stage 0 of one pipeline must idle under 1F1B (no virtual stages), whatever the
    order of its list.

    Why: the step of a plan is at least every pipeline's stage work plus this, which is the
    lower bound PP-Balance is held to (``tests/planner/test_planner_balance_scale.py``,
    docs/pipeline.md "The 1F1B floor of a pipeline's list"). Only the list's stage times count.

    Proof. Stage 0 runs its ops in 1F1B order: ``p - 1`` warm-up forwards, then forward ``i + p
    - 1`` and backward ``i`` alternately. So between the end of micro-batch ``j``'s forward and
    the start of micro-batch ``j'``'s backward (``j`` before or equal to ``j'`` in the list) it
    runs exactly: the forwards of ``j + 1 .. j' + p - 1`` and the backwards of ``j - p + 1 ..
    j' - 1``. Meanwhile a chain of dependent ops must run: ``j``'s forward on stages ``1 .. p -
    2``, the last stage's own ops from ``j``'s forward to ``j'``'s backward (it alternates one
    forward, one backward), and ``j'``'s backward on stages ``p - 2 .. 1``: ``(p - 2)(f_j +
    b_j') + sum_{i=j..j'} t_i``. Subtracting stage 0's work inside leaves an idle time of at
    least ``(p - 1)(f_j + b_j') - sum_{i=j'+1..j'+p-1} f_i - sum_{i=j-p+1..j-1} b_i``. Take any
    set S of the list, ``j`` its first and ``j'`` its last member in the order: the
    ``2 (p - 1)`` ops subtracted belong to micro-batches outside S, and ``f_j + b_j'`` is at
    least the shortest stage time in S (``f = forward_fraction * t``). With S = the ``k``
    longest, the idle is at least ``(p - 1) t_k`` less the ``2 (p - 1)`` longest ops of the rest
    (backwards, the larger share, given to the longest); the floor is the best ``k``. Ring
    waits and transfers only add time, so the bound holds for the estimate and for training.
    """
    if pp < 1:
        raise ValueError(f"pp ({pp}) must be >= 1")
    if not 0.0 <= forward_fraction <= 1.0:
        raise ValueError(f"forward_fraction ({forward_fraction}) must be within [0, 1]")
    times = sorted((float(t) for t in stage_seconds), reverse=True)
    if times and times[-1] < 0:
        raise ValueError(f"stage times must be >= 0 (got {times[-1]})")
    big, small = max(forward_fraction, 1 - forward_fraction), min(forward_fraction, 1 - forward_fraction)
    best = 0.0
    for k in range(1, len(times) + 1):
        rest = times[k:k + 2 * (pp - 1)]
        best = max(best, (pp - 1) * times[k - 1] - big * sum(rest[:pp - 1]) - small * sum(rest[pp - 1:]))
    return best


def assignment_floor(micro_batches: Sequence[tuple[float, int]], pipelines: int, pp: int,
                     forward_fraction: float, *, longest: int = 64) -> float:
    """A lower bound on the 1F1B step of any plan of these micro-batches, whatever the pipelines
    they go to and their order: ``micro_batches`` holds ``(stage seconds, ring size)`` pairs.

    Why: :func:`idle_floor` bounds one pipeline's own list, and averaged over a plan's pipelines
    it cannot see granularity: a ring that no pipeline can take without passing the others. This
    bound can, and depends on no assignment.

    Proof. A pipeline holding ``k`` micro-batches of at least ``tau`` takes at least
    ``(k + p - 1) tau``: by :func:`idle_floor` with S those ``k``, its idle is at least
    ``(p - 1) tau`` less ``2 (p - 1)`` weighted ops of the rest, which the rest's own stage work
    covers. A pipeline holding one of at least ``tau1`` and another of at least ``tau2`` takes at
    least ``p tau1 + min(f, 1 - f) tau2`` (S the first: the other is at most a ``max(f, 1 - f)``
    share in the window and counts in full in the work). Sort the micro-batches longest first;
    call the first ones, down to stage time ``tau1``, long (``N1`` member slots) and the next
    ones, down to ``tau2``, medium (``N2`` slots). In
    any plan either a pipeline holds two long ones (``(p + 1) tau1``), or one holds a long and a
    medium one (``p tau1 + min(f, 1 - f) tau2``), or neither: then exactly ``N1`` pipelines hold
    the long ones, and the medium slots lie on the other ``P - N1``, so one holds at least
    ``ceil(N2 / (P - N1))`` of them. The step is at least the smallest of the three, for every
    pair ``tau1 > tau2``; ``tau1`` is tried at the ``longest`` longest stage times and at none
    (no long ones: plain pigeonhole), ``tau2`` at every stage time below it. The first case is
    never the smallest (``min(f, 1 - f) tau2 <= tau1``), so only the other two are computed.
    When the long ones alone need more than ``P`` slots, no ``tau1`` there or below adds
    anything: plain pigeonhole with ``tau2 = tau1`` already puts two of them on one pipeline,
    ``(p + 1) tau1``.
    """
    if pipelines < 1 or pp < 1:
        raise ValueError(f"pipelines ({pipelines}) and pp ({pp}) must be >= 1")
    if not 0.0 <= forward_fraction <= 1.0:
        raise ValueError(f"forward_fraction ({forward_fraction}) must be within [0, 1]")
    if not micro_batches:
        return 0.0
    order = sorted(micro_batches, key=lambda x: -x[0])
    t = np.array([float(x[0]) for x in order])
    d = np.array([int(x[1]) for x in order], dtype=np.int64)
    if t[-1] < 0 or d.min() < 1 or d.max() > pipelines:
        raise ValueError(f"stage times must be >= 0 and ring sizes within 1..{pipelines} "
                         f"(got {t[-1]} s, ring sizes {d.min()}..{d.max()})")
    small = min(forward_fraction, 1.0 - forward_fraction)
    slots = np.cumsum(d)
    best = 0.0
    for i in range(-1, min(longest, len(t) - 1)):
        n1 = int(slots[i]) if i >= 0 else 0
        if n1 > pipelines:  # and for every later i: see the docstring
            break
        tau1 = float(t[i]) if i >= 0 else np.inf
        tau2 = t[i + 1:]
        n2 = slots[i + 1:] - n1
        free = pipelines - n1
        most = np.ceil(n2 / free) if free > 0 else np.full(len(tau2), np.inf)
        value = np.minimum(pp * tau1 + small * tau2, (most + pp - 1) * tau2)
        best = max(best, float(value.max()))
    return best


__all__ = [
    "SPLIT_COSTINGS", "FloorResult", "ScheduleResult", "assignment_floor", "chunk_seconds", "idle_floor", "interleaved_makespan",
    "interleaved_table", "pipeline_stage_ops", "simulate_schedule", "stage_ops", "template_stage_ops", "time_plan",
]
