"""Timing a PP candidate without building its plan.

``balance`` times about a dozen candidate assignments per step with the full 1F1B estimate
and keeps one. Building each into a :class:`~..plan.StepPlan` first (one ``MicroBatch`` per
ring member, tens of thousands per candidate) cost as much as timing it, and all but the winner
are thrown away. :func:`finish_times` reads the placements directly: orders are numbered in
placement order as :func:`._common.emit_plan` numbers them, each micro-batch is costed by
:func:`..estimate.costs_of` (the code :func:`..estimate.micro_batch_costs` runs on a built plan)
and the pipelines are timed by :func:`..wavefront.simulate_wavefront_flat` (what
:func:`..order.simulate` runs for such a plan), or with virtual stages by
:func:`..wavefront_interleaved.simulate_interleaved_flat` (what the estimate runs for an interleaved
plan). So it returns the same floats as ``estimate_plan(emit_plan(request, placements),
cost_model).rank_time_s``, which the tests check on seeded batches.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np

from ..cost_model import CostModel
from ..estimate import costs_of
from ..topology import Topology
from ..wavefront import simulate_wavefront_flat
from ..wavefront_interleaved import simulate_interleaved_flat
from ._common import Placement, PlanRequest


def times_without_plan(request: PlanRequest) -> bool:
    """Whether :func:`finish_times` times ``request``'s candidates: plain 1F1B (PP > 1, one
    virtual stage, no barriers) without expert groups in lockstep, which the estimate times
    another way."""
    return request.pp_size > 1 and request.ep_size == 1 and not request.meta.get("barrier_after_orders")


def time_key(p: Placement, topology: Topology, two_level: bool = False) -> tuple:
    """What sets a micro-batch's stage time in :func:`finish_times`' cache: its sequences, its
    offload ratio and, for a ring, its size, whether its members share a node and, for two-level
    rings (``two_level``), its members per node. Those are all :func:`..estimate.costs_of` hands
    the cost model for the seconds (a ring's links set its bytes, not its time), so one unit on
    other members of the same kind (inside a node, across nodes) is costed once for all
    candidates that place it so."""
    ring = p.ring
    if len(ring) == 1:
        return p.seqs, p.offload_ratio, 1, True, 1
    return (p.seqs, p.offload_ratio, len(ring), topology.ring_is_intra_node(ring),
            topology.two_level_group(ring) if two_level else 1)


def finish_times(request: PlanRequest, placements: Sequence[Placement], cost_model: CostModel,
                 seconds: dict[tuple, float] | None = None,
                 stop_above: float | None = None, vpp: int = 1) -> np.ndarray | None:
    """Per HDP rank, when its pipeline finishes under the estimate, for a request where
    :func:`times_without_plan` holds; None when a ring's micro-batch is not at one local index
    on all its members (build the plan and estimate it instead).

    ``seconds`` (optional, filled in) holds each micro-batch's stage time by what sets it
    (:func:`time_key`: a unit alone costs the same on every rank, a ring the same on any members
    of one kind). Candidates share most of them: reorderings move the
    same placements, and the assignments of one unit set put the same single-rank units on
    other ranks. A micro-batch's time does not depend on the others costed with it (the cost
    model's array arithmetic is elementwise), so a cached time is the float a fresh costing
    gives. Use one per cost model and request.

    ``stop_above``: ``inf`` for every rank as soon as the step is known to exceed it (a
    candidate that cannot beat the best so far; :func:`..wavefront.simulate_wavefront_flat`, or
    with virtual stages :func:`..wavefront_interleaved.simulate_interleaved_flat`). ``vpp`` > 1:
    timed with that many virtual stages per stage, as the plan emitted with
    ``virtual_pipeline_size = vpp`` is estimated."""
    n = request.hdp_size
    topo = Topology.of(request.cost_model, request.topology)
    topo.check_size(n)
    cache = {} if seconds is None else seconds
    two_level = cost_model.two_level_ring
    keys = [time_key(p, topo, two_level) for p in placements]
    times = [cache.get(k) for k in keys]
    seen: dict[int, tuple[tuple[int, ...], tuple[int, ...], float]] = {}
    for order, t in enumerate(times):
        if t is None:
            p = placements[order]
            seen[order] = (tuple(map(int, p.ring)), tuple(map(int, p.seqs)), p.offload_ratio)
    if seen:  # only the seconds are read: no holders (they go into the byte counts)
        costs = costs_of(seen, {}, dict(zip(request.ids, request.lengths)), cost_model, topo,
                         align=request.align, layers_per_stage=request.layers, pp_size=request.pp_size)
        for order, t in zip(costs.orders.tolist(), costs.seconds.tolist()):
            times[order] = t
            cache[keys[order]] = t
    # orders number the placements (as emit_plan numbers them); each member's list in placement order
    rings = [p.ring for p in placements]
    pipeline = np.fromiter(chain.from_iterable(rings), dtype=np.int64)
    index = np.repeat(np.arange(len(rings)), np.fromiter(map(len, rings), dtype=np.int64, count=len(rings)))
    if vpp > 1:
        return simulate_interleaved_flat(pipeline, index, np.array(times, dtype=float), n, pp=request.pp_size,
                                         vpp=vpp, forward_fraction=cost_model.forward_fraction, stop_above=stop_above)
    return simulate_wavefront_flat(pipeline, index, np.array(times, dtype=float), n, request.pp_size,
                                   cost_model.forward_fraction, stop_above)
