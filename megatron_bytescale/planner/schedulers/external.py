"""A plan that another system's scheduler made, costed like ByteScale's own (numbers only).

``bytescale plan --compare`` puts Megatron's own hybrid context-parallel scheduler beside
ByteScale's. That scheduler lives in megatron-core, which the planner never imports (DESIGN.md
§2): :mod:`megatron_bytescale.integration.megatron_hybrid_cp` runs it and hands its result
here as plain numbers (which ranks run which sequence, in which order, with barriers between
groups). :func:`plan_from_rank_schedules` turns that into a :class:`StepPlan`, validated and
estimated with the same cost model, topology and estimator as every other row, so the rows
differ only in the schedule.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from ..cost_model import CostModel
from ..estimate import estimate_plan
from ..plan import StepPlan
from ..topology import Topology
from ._common import Placement, build_request, emit_plan


def plan_from_rank_schedules(
    lengths: Any,
    groups: Sequence[Sequence[Sequence[int]]],
    *,
    scheduler: str,
    hdp_size: int,
    capacity: int,
    cost_model: CostModel,
    align: int = 1,
    topology: Topology | None = None,
    context_length: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> StepPlan:
    """The plan in which rank r runs ``groups[g][r]`` (sequence ids, in that order) in group g.

    A sequence listed on several ranks of a group runs as one ring over those ranks (its
    zigzag shares); every sequence runs alone in its micro-batch. Groups run one after the
    other with a barrier between them (``meta["barrier_after_orders"]``). Within a group the
    global order is the one every rank's list agrees with (a topological order; a cycle, which
    would deadlock the ranks, is refused). Every sequence of ``lengths`` must run exactly once.

    Raises:
        ValueError: a rank index out of range, a sequence run twice, lost or unknown, or lists
            whose orders contradict each other (the message names the sequence or rank).
    """
    request = build_request(
        lengths, hdp_size=hdp_size, capacity=capacity, cost_model=cost_model, pp_size=1,
        offload=False, overlong="error", align=align, context_length=context_length,
        delta=0.05, num_buckets=1, topology=topology,
    )
    placements: list[Placement] = []
    barriers: list[int] = []
    seen: set[int] = set()
    for g, per_rank in enumerate(groups):
        if len(per_rank) > hdp_size:
            raise ValueError(f"group {g} lists {len(per_rank)} ranks; there are {hdp_size} HDP ranks")
        order = _group_order(g, per_rank, len(request.lengths))
        for seq, ring in order:
            if seq in seen:
                raise ValueError(f"sequence {seq} runs in two groups (again in group {g})")
            seen.add(seq)
            placements.append(Placement(ring=ring, seqs=(seq,)))
        if order:
            barriers.append(len(placements) - 1)
    lost = sorted(set(range(len(request.lengths))) - seen)
    if lost:
        raise ValueError(f"{len(lost)} sequence(s) never run (ids {lost[:10]}): every sequence of "
                         "the batch must be scheduled exactly once")
    full_meta = {"barrier_after_orders": barriers[:-1], "num_groups": len(barriers),
                 **(meta or {})}
    plan = emit_plan(request, placements, scheduler=scheduler, meta=full_meta,
                     offload_allowed=False)
    return replace(plan, estimate=estimate_plan(plan, request.cost_model, request.topology))


def _group_order(g: int, per_rank: Sequence[Sequence[int]], num_seqs: int
                 ) -> list[tuple[int, tuple[int, ...]]]:
    """(sequence, ring) of one group in an order that agrees with every rank's list."""
    ring_of: dict[int, list[int]] = {}
    for rank, seqs in enumerate(per_rank):
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"group {g}: rank {rank} lists a sequence twice ({list(seqs)[:10]})")
        for s in seqs:
            s = int(s)
            if not 0 <= s < num_seqs:
                raise ValueError(f"group {g}: rank {rank} runs unknown sequence {s} (the batch "
                                 f"has {num_seqs})")
            ring_of.setdefault(s, []).append(rank)
    # Kahn's algorithm over "a before b on some rank"; ties by first appearance (stable).
    after: dict[int, set[int]] = {s: set() for s in ring_of}
    indegree = dict.fromkeys(ring_of, 0)
    for seqs in per_rank:
        for a, b in zip(seqs, seqs[1:]):
            a, b = int(a), int(b)
            if b not in after[a]:
                after[a].add(b)
                indegree[b] += 1
    first = {s: i for i, s in enumerate(ring_of)}
    ready = sorted((s for s, d in indegree.items() if d == 0), key=first.__getitem__)
    out: list[tuple[int, tuple[int, ...]]] = []
    while ready:
        s = ready.pop(0)
        out.append((s, tuple(sorted(ring_of[s]))))
        for b in sorted(after[s], key=first.__getitem__):
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
        ready.sort(key=first.__getitem__)
    if len(out) != len(ring_of):
        stuck = sorted(s for s, d in indegree.items() if d > 0)
        raise ValueError(f"group {g}: the ranks' orders contradict each other for sequences "
                         f"{stuck[:10]} (they would wait on each other forever)")
    return out
