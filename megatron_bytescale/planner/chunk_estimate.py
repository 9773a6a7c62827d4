"""The estimate of plans with split micro-batches, and the split a scheduler keeps only if it pays.

A chunk ``(i, k)`` of a split ring micro-batch (``MicroBatch.chunk``) costs what
:func:`.pipeline_floor.chunk_seconds` gives chunk ``i`` of the whole micro-batch under the
``cached`` costing, which is what the runtime builds (:mod:`megatron_bytescale.runtime.chunked_attention`):
its own K/V rotate behind ``(2 i + 1) / k^2`` of the attention, and the prefix's dK/dV ride
the owner's ring accumulator. Its P2P bytes are ``1 / k`` of the whole micro-batch's. The
pipeline is timed with each group's backwards reversed (:func:`.pipeline_floor.simulate_schedule`
with ``chunk_groups``), as the driver runs it. The chunks are assumed even, whereas a real
chunk's tokens differ by at most one per document.

:func:`split_where_faster` is the decision: it splits the longest ring micro-batches one by one
into 2, 4 or 8 chunks and keeps a split only where the estimated step gets shorter, so the
result is never slower than the plan it was given, in the estimate. A split is tried only
where the kept prefix fits the plan's capacity (:mod:`.chunk_memory`), so it never claims memory
the unsplit plan did not have.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .cost_model import CostModel
from .pipeline_floor import chunk_seconds, simulate_schedule
from .plan import PlanError, StepPlan

if TYPE_CHECKING:
    from .estimate import MicroBatchCosts
    from .topology import Topology

CHUNK_OPTIONS = (2, 4, 8)


def has_chunks(plan: StepPlan) -> bool:
    return any(mb.chunk is not None for rp in plan.ranks for mb in rp.micro_batches)


def chunk_costs(plan: StepPlan, cost_model: CostModel, costs: "MicroBatchCosts") -> "MicroBatchCosts":
    """``costs`` with every chunk's seconds and bytes those of its place in its group.

    :func:`.estimate.micro_batch_costs` sees a chunk's sequences at their whole lengths, which
    is the whole micro-batch's cost; this takes chunk ``i``'s share of it.
    """
    chunk_of = {mb.order: mb.chunk for rp in plan.ranks for mb in rp.micro_batches if mb.chunk is not None}
    if not chunk_of:
        return costs
    # a group's last chunk carries every sequence: its sums are the whole micro-batch's
    index = {int(o): k for k, o in enumerate(costs.orders.tolist())}
    seconds, p2p, inter = costs.seconds.copy(), costs.p2p_bytes.copy(), costs.inter_node_bytes.copy()
    for order, (i, k) in chunk_of.items():
        whole = index[order - i + k - 1]
        t = chunk_seconds(
            cost_model, sum_p=float(costs.sum_p[whole]), sum_p2=float(costs.sum_p2[whole]),
            ring_size=int(costs.ring_sizes[whole]), layers=plan.layers_per_stage,
            seconds=float(costs.seconds[whole]), chunks=k, costing="cached",
            intra_node=bool(costs.intra_node[whole]), node_group=float(costs.node_group[whole]),
            num_docs=float(costs.num_docs[whole]),
        )  # fmt: skip
        seconds[index[order]] = float(t[i])
        p2p[index[order]] = costs.p2p_bytes[whole] / k
        inter[index[order]] = costs.inter_node_bytes[whole] / k
    return dataclasses.replace(costs, seconds=seconds, p2p_bytes=p2p, inter_node_bytes=inter)


def simulate_chunked(plan: StepPlan, costs: "MicroBatchCosts", forward_fraction: float) -> np.ndarray:
    """Every pipeline's finish time, each chunk group's backwards reversed."""
    if plan.virtual_pipeline_size > 1:
        raise PlanError("split micro-batches are modelled with plain 1F1B only; plan with virtual_pipeline_size 1")
    lists = [[mb.order for mb in rp.micro_batches] for rp in plan.ranks]
    groups = {mb.order: mb.order - mb.chunk[0] for rp in plan.ranks for mb in rp.micro_batches
              if mb.chunk is not None}  # fmt: skip
    durations = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
    result = simulate_schedule(lists, durations, pp=plan.pp_size, forward_fraction=forward_fraction,
                               chunk_groups=groups)
    if result is None:
        raise PlanError("the 1F1B schedule of this plan with split micro-batches deadlocks")
    return result.rank_finish_s


def split_where_faster(plan: StepPlan, cost_model: CostModel, *, candidates: int = 4,
                       options: Sequence[int] = CHUNK_OPTIONS, topology: "Topology | None" = None,
                       fit_memory: bool = True) -> StepPlan:
    """``plan`` with its ``candidates`` longest ring micro-batches (of 2+ members) split into the
    number of chunks in ``options`` that shortens the estimated step most, each only if it does
    and only where the split's kept prefix fits the capacity (:func:`.chunk_memory.split_fits`).

    Never slower than ``plan`` in the estimate (a split is kept only when the step shrinks).
    Plans without PP, with virtual stages or already split come back unchanged. ``topology``
    is passed to the estimate (the plan's own nodes; None: the cost model's). ``fit_memory``
    False skips the memory rule: what the split would gain if memory were free, for reports
    only (such a plan may not fit the devices it is meant for).
    """
    from .chunk_memory import split_fits
    from .chunk_split import split_micro_batch
    from .estimate import estimate_plan, micro_batch_costs

    if plan.pp_size < 2 or plan.virtual_pipeline_size > 1 or has_chunks(plan):
        return plan
    best = plan
    best_s = estimate_plan(plan, cost_model, topology).step_time_s
    costs = micro_batch_costs(plan, cost_model, topology)
    rings = [(float(costs.seconds[k]), int(o)) for k, o in enumerate(costs.orders.tolist())
             if costs.ring_sizes[k] > 1 and costs.offload[k] == 0]
    for _, order in sorted(rings, reverse=True)[:candidates]:
        target = order + _shift(best, order)
        trial_best = None
        for k in options:
            if fit_memory and not split_fits(best, target, k, cost_model):
                continue
            try:
                trial = split_micro_batch(best, target, k)
            except ValueError:
                continue
            seconds = estimate_plan(trial, cost_model, topology).step_time_s
            if seconds < best_s and (trial_best is None or seconds < trial_best[0]):
                trial_best = (seconds, trial)
        if trial_best is not None:
            best_s, best = trial_best
    return dataclasses.replace(best, estimate=estimate_plan(best, cost_model, topology)) if best is not plan else plan


def _shift(now: StepPlan, order: int) -> int:
    """How far ``order`` of the unsplit plan has moved in ``now`` (earlier splits add k - 1 each)."""
    extra = 0
    seen = set()
    for rp in now.ranks:
        for mb in rp.micro_batches:
            if mb.chunk is not None and mb.chunk[0] == 0 and mb.order not in seen:
                seen.add(mb.order)
    # every split group that started before `order` (in the unsplit numbering) shifts it
    for start in sorted(seen):
        k = next(mb.chunk[1] for rp in now.ranks for mb in rp.micro_batches if mb.order == start)
        if start - extra < order:
            extra += k - 1
    return extra
