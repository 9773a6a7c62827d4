"""The schedulers and the planner's single entry point, :func:`make_plan`.

===========  ==================================================================  =========
name         what                                                                 offload
===========  ==================================================================  =========
``naive``    paper Alg. 1: Eq. 3 rings + packs, simple time-step fill             Eq. 3
``balance``  paper Alg. 2: DP-Balance (pp = 1) / PP-Balance (pp > 1)             Eq. 3
``static``   Megatron/MegaScale static DP x CP with packing (paper's baseline)    never
``pow2``     Megatron hybrid CP: power-of-two rings on aligned blocks, barriers   never
===========  ==================================================================  =========
"""

from __future__ import annotations

import gc
import logging
from dataclasses import replace
from typing import Any, Callable, Mapping

from ..chunk_estimate import split_where_faster
from ..cost_model import CostModel
from ..estimate import estimate_plan
from ..plan import StepPlan
from ..topology import Topology
from ._common import OVERLONG_MODES, PlanRequest, build_request, check_seq_split, seq_split_conflicts
from .balance import plan_balance
from .naive import plan_naive
from .pow2 import plan_pow2
from .static import plan_static, static_cp_size

logger = logging.getLogger(__name__)

SCHEDULERS: Mapping[str, Callable[[PlanRequest], StepPlan]] = {
    "naive": plan_naive,
    "balance": plan_balance,
    "static": plan_static,
    "pow2": plan_pow2,
}

DEFAULT_DELTA = 0.05
DEFAULT_NUM_BUCKETS = 4


def make_plan(
    lengths: Any,
    *,
    scheduler: str,
    hdp_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    offload: bool = True,
    overlong: str = "error",
    align: int = 1,
    context_length: int | None = None,
    delta: float = DEFAULT_DELTA,
    num_buckets: int = DEFAULT_NUM_BUCKETS,
    estimate: bool = True,
    topology: Topology | None = None,
    pieces: bool = True,
    ep_size: int = 1,
    seq_split: bool = False,
    even_expert_slots: bool = True,
    virtual_pipeline_size: int = 1,
) -> StepPlan:
    """Plan one global batch of sequences with ``lengths`` over ``hdp_size`` HDP ranks.

    Args:
        lengths: token count of every sequence (ints >= 1); sequence ids are the indices.
        scheduler: one of :data:`SCHEDULERS` (``naive``, ``balance``, ``static``, ``pow2``).
        hdp_size: HDP ranks (Megatron's DP x CP group size).
        capacity: C, tokens of resident activations one rank holds per micro-batch.
        cost_model: per-layer time/memory model (:mod:`..presets` or :meth:`CostModel.fit`).
        pp_size: pipeline stages; must divide ``cost_model.num_layers``.
        offload: let ``naive``/``balance`` use Eq. 3's selective offload.
        overlong: ``"error"``, ``"drop"`` or ``"truncate"`` for sequences that cannot fit even on
            all ranks (with full offload), or are longer than ``context_length``.
        align: zigzag padding alignment of every part (e.g. 8 or 16 for some kernels).
        context_length: longest allowed sequence; the static baseline's context (default: the
            longest sequence of the batch).
        delta: Alg. 2's threshold as a fraction of the max rank time.
        num_buckets: Alg. 2's equal-work buckets (PP-Balance).
        estimate: attach :func:`..estimate.estimate_plan`'s estimate to the plan.
        topology: which node every HDP rank is on (:class:`..topology.Topology`); default the
            cost model's ``ranks_per_node`` consecutive ranks per node. ``balance`` keeps rings
            that fit a node inside one and spreads larger rings over the fewest nodes; the
            estimate reports the P2P bytes that cross nodes. Recorded in ``meta["topology"]``.
        pieces: False builds a timing-only plan: the same rings, sequences and orders, but no
            token pieces (``meta["pieces"] = False``; ``validate()`` rejects it and the runtime
            cannot train it). The simulator uses it: splitting every document of a 2M-token
            static bin over 256 ranks costs more than the whole schedule at scale.
        ep_size: HDP ranks one expert group spans (must divide ``hdp_size``): the run's
            lockstep block ``ETP x EP / TP`` (EP when ETP = TP; 1 when the expert group lies
            inside one TP group, as for a dense model). Above 1 every ring micro-batch then
            sits at the same local index on all its members (``StepPlan.ep_size``); ``balance``
            plans it with PP-Balance's count groups, the other schedulers are checked.
        seq_split: after ``balance`` has chosen its PP plan, split its longest rings into 2, 4
            or 8 causal chunks that follow each other through the pipeline (Seq1F1B-style), each
            only where the estimated step shrinks and the chunks' kept prefix K/V fits the
            capacity (:func:`..chunk_estimate.split_where_faster`). ``balance`` with PP > 1 and
            ep_size 1 only; the plan must then run plain 1F1B (no virtual stages).
        even_expert_slots: with ``ep_size`` > 1, ``balance`` sorts every member's single-rank
            micro-batches by time into its non-ring slots where the estimate says the expert
            groups then wait less (:mod:`.ep_slots`); False keeps PP-Balance's order (to
            measure what sorting gains).
        virtual_pipeline_size: model chunks per pipeline stage when training runs Megatron's
            interleaved 1F1B (``--virtual-pipeline-model-parallel-size``); 1 for plain 1F1B. The
            plan carries it and its estimate times that schedule. ``balance`` ranks its
            candidates by plain 1F1B as always, then times every one within
            :data:`.pp_vpp.INTERLEAVED_SLACK` of the fastest interleaved and keeps the fastest
            (``meta["interleaved_timed"]``, ``meta["interleaved_rank"]``): its reorderings fill
            the 1F1B window, which virtual stages shrink. Needs ``pp_size`` > 1 and a divisor
            of the layers per stage.

    Returns:
        A :class:`StepPlan` whose invariants hold (``validate()`` passes), with ``meta`` naming the
        context length, cost model, ring count and anything dropped or truncated.

    Raises:
        ValueError: bad input (the message names the value and what to do).
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(SCHEDULERS)}")
    request = build_request(
        lengths, hdp_size=hdp_size, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
        offload=offload, overlong=overlong, align=align, context_length=context_length,
        delta=delta, num_buckets=num_buckets, topology=topology, pieces=pieces, ep_size=ep_size,
        seq_split=seq_split, scheduler=scheduler, even_expert_slots=even_expert_slots,
        virtual_pipeline_size=virtual_pipeline_size,
    )
    # A plan is tens of thousands of small acyclic objects; the cyclic garbage collector would
    # rescan them (and the caller's heap) several times while they are built, for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        plan = SCHEDULERS[scheduler](request)
        if request.seq_split:
            plan = split_where_faster(plan, request.cost_model, topology=request.topology)
            plan = replace(plan, meta={**plan.meta, "seq_split": True})
        if ep_size > 1:  # before the estimate, which times expert groups slot by slot
            check_expert_slots(plan, scheduler)
        if estimate and plan.estimate is None:
            plan = replace(plan, estimate=estimate_plan(plan, request.cost_model, request.topology))
        elif not estimate and plan.estimate is not None:  # PP-Balance estimates its candidates
            plan = replace(plan, estimate=None)
    finally:
        if was_enabled:
            gc.enable()
    return plan


def check_expert_slots(plan: StepPlan, scheduler: str) -> None:
    """Raise ValueError unless every ring micro-batch of ``plan`` sits at the same local index on
    all its members (what expert parallelism needs; ``StepPlan.validate`` checks the same) and
    the plan has no barriers between micro-batches (an expert group's slots cannot wait for
    them: a member's slot k may sit on either side of a barrier)."""
    if plan.meta.get("barrier_after_orders"):
        raise ValueError(f"scheduler {scheduler!r} cannot plan for expert parallelism (ep_size {plan.ep_size}): "
                         "it puts barriers between groups of micro-batches, which expert groups meeting "
                         "slot by slot cannot honour; use --bytescale-scheduler balance")
    for rank_plan in plan.ranks:
        for local, mb in enumerate(rank_plan.micro_batches):
            for member in mb.ring:
                theirs = plan.ranks[member].micro_batches
                if local >= len(theirs) or theirs[local].order != mb.order:
                    raise ValueError(
                        f"scheduler {scheduler!r} cannot plan for expert parallelism "
                        f"(ep_size {plan.ep_size}): its ring micro-batch {mb.order} sits at "
                        "different local indices on its members; use --bytescale-scheduler balance"
                    )


__all__ = ["SCHEDULERS", "OVERLONG_MODES", "check_seq_split", "make_plan", "seq_split_conflicts",
           "static_cp_size"]
