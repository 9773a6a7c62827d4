"""Execution order of a plan and its deadlock freedom (DESIGN.md D5), by simulation.

Every rank runs its micro-batches in list order (which :meth:`StepPlan.validate` requires to be
increasing ``order``). A ring micro-batch is a rendezvous: it can only run when every member has
reached it. This module simulates that, as a dependency graph processed in topological order
(Kahn), so it both proves a plan deadlock-free and times it:

* **PP = 1.** One node per micro-batch (its global ``order``). A rank's micro-batch depends on
  the rank's previous one; a ring node waits for all members. Node duration = the micro-batch's
  time.
* **PP > 1.** Every HDP rank is one pipeline of ``pp_size`` stages running the non-interleaved
  1F1B schedule on its own micro-batch list (warm-up ``min(pp - 1 - stage, m)`` forwards, then
  one-forward-one-backward, then the cool-down backwards; ``m`` may differ per pipeline). One
  node per (micro-batch, F|B, stage); a ring op at a stage is a rendezvous of the same op on all
  members' pipelines. Edges: each stage's op sequence, F(stage - 1) -> F(stage),
  B(stage + 1) -> B(stage), F(last) -> B(last). Forward takes ``forward_fraction`` of the
  micro-batch's stage time, backward the rest. Activation sends between stages are free.
* **Barriers** (``meta["barrier_after_orders"]``): a barrier after order k is a node that waits
  for every node of orders in (previous barrier, k], and every later node waits for it.

If some node can never run, the plan deadlocks: :func:`check_deadlock_free` raises
:class:`PlanError` naming the stuck ranks and what they wait for.

Timing a PP plan without barriers (what the planner's estimate asks for) runs in wavefronts
(:mod:`.wavefront`: the same floats, vectorised over pipelines) when every ring sits at one
local index on its members, as :meth:`StepPlan.validate` requires; otherwise, and to record node
times, the graph below is walked.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

from .plan import PlanError, StepPlan
from .wavefront import simulate_wavefront

Node = Hashable


def pipeline_ops(num_micro_batches: int, pp_size: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B op sequence of one stage: ``("F", i)`` / ``("B", i)`` with local indices i."""
    m = num_micro_batches
    warmup = min(pp_size - 1 - stage, m)
    ops: list[tuple[str, int]] = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        ops.append(("F", warmup + k))
        ops.append(("B", k))
    ops.extend(("B", i) for i in range(m - warmup, m))
    return ops


@dataclass
class Simulation:
    """Result of :func:`simulate`."""

    rank_finish_s: np.ndarray
    """Per HDP rank: when its last op finishes (its pipeline's makespan with PP)."""
    node_times: dict[Node, tuple[float, float]] = field(default_factory=dict)
    """(start, finish) per node when ``record=True``; nodes are orders (PP = 1) or
    ``(order, "F"|"B", stage)`` (PP > 1)."""


def rank_orders(plan: StepPlan) -> list[list[int]]:
    """The order numbers of every rank's micro-batches, in list (execution) order."""
    return [[mb.order for mb in rp.micro_batches] for rp in plan.ranks]


def _barrier_segments(orders: Sequence[int], barriers: Sequence[int]) -> dict[int, int]:
    """Segment index of every order: the number of barriers strictly before it."""
    bs = sorted(set(int(b) for b in barriers))
    return {o: int(np.searchsorted(bs, o, side="left")) for o in orders}


def simulate(
    plan: StepPlan,
    durations: Mapping[int, float] | None = None,
    *,
    forward_fraction: float = 1.0 / 3.0,
    barriers: Sequence[int] | None = None,
    record: bool = False,
) -> Simulation:
    """Run the plan's dependency graph; raise :class:`PlanError` on a deadlock.

    ``durations`` maps order -> seconds of the micro-batch on one member (per stage with PP);
    missing or None means zero (a pure deadlock check). ``barriers`` defaults to
    ``plan.meta["barrier_after_orders"]``.
    """
    lists = rank_orders(plan)
    if barriers is None:
        barriers = list(plan.meta.get("barrier_after_orders", []) or [])
    dur = durations or {}
    pp = plan.pp_size
    if pp > 1 and not barriers and not record:
        finish = simulate_wavefront(lists, dur, pp, forward_fraction)
        if finish is not None:
            return Simulation(rank_finish_s=finish)
    if pp > 1 and not barriers:
        fast = _simulate_pipelines(lists, dur, pp, forward_fraction, plan.hdp_size, record)
        if fast is not None:
            return fast
    succ: dict[Node, list[Node]] = defaultdict(list)
    indeg: dict[Node, int] = defaultdict(int)
    weight: dict[Node, float] = {}
    rank_nodes: list[list[Node]] = []

    def edge(u: Node, v: Node) -> None:
        succ[u].append(v)
        indeg[v] += 1

    if pp == 1:
        for orders in lists:
            for k, o in enumerate(orders):
                weight.setdefault(o, float(dur.get(o, 0.0)))
                indeg.setdefault(o, 0)
                if k:
                    edge(orders[k - 1], o)
            rank_nodes.append(list(orders))
    else:
        joint_edges: set[tuple[Node, Node]] = set()
        for orders in lists:
            m = len(orders)
            nodes_here: list[Node] = []
            for stage in range(pp):
                prev: Node | None = None
                for phase, i in pipeline_ops(m, pp, stage):
                    o = orders[i]
                    node = (o, phase, stage)
                    t = float(dur.get(o, 0.0))
                    weight.setdefault(node, t * forward_fraction if phase == "F" else t * (1.0 - forward_fraction))
                    indeg.setdefault(node, 0)
                    if prev is not None:
                        edge(prev, node)
                    prev = node
                    nodes_here.append(node)
                    if phase == "F" and stage > 0:
                        joint_edges.add(((o, "F", stage - 1), node))
                    elif phase == "B" and stage < pp - 1:
                        joint_edges.add(((o, "B", stage + 1), node))
                    elif phase == "B":
                        joint_edges.add(((o, "F", stage), node))
            rank_nodes.append(nodes_here)
        for u, v in joint_edges:
            edge(u, v)

    if barriers:
        def order_of(n: Node) -> int:
            return n if pp == 1 else n[0]  # type: ignore[index]

        all_nodes = list(weight)
        seg = _barrier_segments(sorted({order_of(n) for n in all_nodes}), barriers)
        nbar = len(sorted(set(int(b) for b in barriers)))
        for b in range(nbar):
            weight[("barrier", b)] = 0.0
            indeg.setdefault(("barrier", b), 0)
        for n in all_nodes:
            s = seg[order_of(n)]
            if s < nbar:
                edge(n, ("barrier", s))
            if s > 0:
                edge(("barrier", s - 1), n)

    ready_at: dict[Node, float] = defaultdict(float)
    finish: dict[Node, float] = {}
    queue = deque(n for n in weight if indeg[n] == 0)
    times: dict[Node, tuple[float, float]] = {}
    while queue:
        u = queue.popleft()
        start = ready_at[u]
        end = start + weight[u]
        finish[u] = end
        if record:
            times[u] = (start, end)
        for v in succ.get(u, ()):
            if end > ready_at[v]:
                ready_at[v] = end
            indeg[v] -= 1
            if indeg[v] == 0:
                queue.append(v)

    if len(finish) != len(weight):
        raise PlanError(_deadlock_message(plan, lists, rank_nodes, finish, pp))

    out = np.zeros(plan.hdp_size)
    for r, nodes in enumerate(rank_nodes):
        if nodes:
            out[r] = max(finish[n] for n in nodes)
    return Simulation(rank_finish_s=out, node_times=times)


def _simulate_pipelines(lists: list[list[int]], dur: Mapping[int, float], pp: int, forward_fraction: float,
                        hdp_size: int, record: bool) -> Simulation | None:
    """:func:`simulate`'s PP graph without barriers, on integer node ids and flat lists (the
    planner estimates every PP-Balance candidate with it, so it must be fast).

    Node ``(k * 2 + phase) * pp + stage`` is op F (phase 0) or B (1) of the k-th distinct order
    at ``stage``; the edges are the general graph's. Every node's start is the latest finish of
    its predecessors, whatever order Kahn's algorithm meets them in, so the times are the same
    floats. None on a deadlock (the caller's general path then names the stuck ranks).
    """
    orders = sorted({o for ol in lists for o in ol})
    index = {o: k for k, o in enumerate(orders)}
    n_nodes = 2 * pp * len(orders)
    weight: list[float] = []
    for o in orders:
        t = float(dur.get(o, 0.0))
        weight += [t * forward_fraction] * pp + [t * (1.0 - forward_fraction)] * pp
    succ: list[list[int]] = [[] for _ in range(n_nodes)]
    indeg = [0] * n_nodes
    # the fixed edges of every micro-batch: F down the stages, F -> B at the last, B back up
    for k in range(len(orders)):
        f0, b0 = 2 * pp * k, 2 * pp * k + pp
        for stage in range(1, pp):
            succ[f0 + stage - 1].append(f0 + stage)
            succ[b0 + stage].append(b0 + stage - 1)
            indeg[f0 + stage] += 1
            indeg[b0 + stage - 1] += 1
        succ[f0 + pp - 1].append(b0 + pp - 1)
        indeg[b0 + pp - 1] += 1
    rank_last: list[list[int]] = []  # per rank, the last node of every stage
    for ol in lists:
        m = len(ol)
        ids = [2 * pp * index[o] for o in ol]
        last: list[int] = []
        for stage in range(pp):
            seq = _stage_nodes(ids, pp, stage)
            for u, v in zip(seq, seq[1:]):
                succ[u].append(v)
                indeg[v] += 1
            if seq:
                last.append(seq[-1])
        rank_last.append(last)
    ready = [0.0] * n_nodes
    queue = [v for v in range(n_nodes) if indeg[v] == 0]
    pop, push = queue.pop, queue.append
    done = 0
    while queue:
        u = pop()
        end = ready[u] + weight[u]
        done += 1
        for v in succ[u]:
            if end > ready[v]:
                ready[v] = end
            left = indeg[v] - 1
            indeg[v] = left
            if not left:
                push(v)
    if done != n_nodes:
        return None
    finish = [r + w for r, w in zip(ready, weight)]  # the same sums the loop made
    out = np.zeros(hdp_size)
    for r, last in enumerate(rank_last):
        if last:  # a stage's last op finishes after all its others
            out[r] = max(finish[v] for v in last)
    times: dict[Node, tuple[float, float]] = {}
    if record:
        for k, o in enumerate(orders):
            for phase in (0, 1):
                for stage in range(pp):
                    v = (2 * k + phase) * pp + stage
                    times[(o, "FB"[phase], stage)] = (ready[v], finish[v])
    return Simulation(rank_finish_s=out, node_times=times)


def _stage_nodes(ids: list[int], pp: int, stage: int) -> list[int]:
    """The node ids of :func:`pipeline_ops` at ``stage`` for micro-batches whose F node at stage
    0 is ``ids[i]`` (F at ``ids[i] + stage``, B at ``ids[i] + pp + stage``), built by slicing."""
    m = len(ids)
    warmup = min(pp - 1 - stage, m)
    fwd = [x + stage for x in ids]
    bwd = [x + pp + stage for x in ids]
    steady = [0] * (2 * (m - warmup))
    steady[0::2] = fwd[warmup:]
    steady[1::2] = bwd[: m - warmup]
    return fwd[:warmup] + steady + bwd[m - warmup:]


def _deadlock_message(plan: StepPlan, lists: list[list[int]], rank_nodes: list[list[Node]],
                      finish: Mapping[Node, float], pp: int) -> str:
    holders: dict[int, list[int]] = defaultdict(list)
    for r, orders in enumerate(lists):
        for o in orders:
            holders[o].append(r)
    stuck = []
    for r, nodes in enumerate(rank_nodes):
        pending = [n for n in nodes if n not in finish]
        if not pending:
            continue
        n = pending[0]
        o = n if pp == 1 else n[0]  # type: ignore[index]
        what = f"order {o}" if pp == 1 else f"{n[1]} of order {o} at stage {n[2]}"  # type: ignore[index]
        stuck.append(f"rank {r} waits at {what} (ring members {holders[o]})")
    shown = "; ".join(stuck[:8]) + ("; ..." if len(stuck) > 8 else "")
    ranks = [int(s.split()[1]) for s in stuck]
    return f"deadlock: ranks {ranks[:32]}{' ...' if len(ranks) > 32 else ''} can never proceed: {shown}"


def check_deadlock_free(plan: StepPlan) -> None:
    """Raise :class:`PlanError` naming the stuck ranks if the plan cannot run to the end."""
    simulate(plan)
