"""One simulated training step: the planner's timing of a plan plus the step-level terms.

There is one model of time. The micro-batch phase comes from the planner's estimate
(:func:`megatron_bytescale.planner.estimate.simulate_plan`): every micro-batch costs
:meth:`CostModel.ring_time_from_sums` on each member (compute from ``T(s)``, ring P2P
overlapped per ring step, intra- or inter-node rate by where the members sit, exposed offload
transfer), rings start when all members are free, and with PP every rank is a 1F1B pipeline
with rings meeting across pipelines; with expert parallelism (``plan.ep_size`` > 1) the ranks
of an expert group run every slot in lockstep at their slowest member's pace
(:mod:`megatron_bytescale.planner.expert_lockstep`), and that wait shows as ``idle``. This module adds what happens after it
(:mod:`.overheads`: gradient reduction, optimizer, data and plan wait) and splits the time
into what it is spent on with :meth:`CostModel.ring_time_terms`, the same formula's parts.

Timeline of a step::

    [data + plan wait] [micro-batches: slowest rank] [gradient reduction] [optimizer]

Per-rank numbers (``rank_busy_s``, ``rank_finish_s``) are per HDP rank; with PP an HDP rank is
one pipeline and its busy time is one stage's (every stage of a pipeline is equally busy in
this model). GPU-seconds in ``breakdown`` count every stage of every pipeline (one TP rank).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..planner.cost_model import CostModel
from ..planner.estimate import critical_path, simulate_plan
from ..planner.plan import StepPlan
from ..planner.topology import Topology
from .overheads import StepOverheads

BREAKDOWN_TERMS = ("compute", "exposed_comm", "step_overhead", "exposed_offload", "idle")


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one simulated step costs, and where the time goes."""

    name: str
    """The variant (or scheduler) that made the plan."""
    scheduler: str
    hdp_size: int
    pp_size: int
    tensor_parallel_size: int
    tokens: int
    step_time_s: float
    """data wait + micro-batch phase + gradient reduction + optimizer."""
    micro_batch_phase_s: float
    """The slowest rank's finish time (the planner's estimated step time)."""
    grad_reduce_s: float
    optimizer_s: float
    data_wait_s: float
    """Exposed data loading and planning."""
    plan_s: float
    """Modelled planning time of this step on the cluster (an input; exposed or hidden)."""
    lookahead: bool
    rank_busy_s: np.ndarray
    rank_finish_s: np.ndarray
    lower_bound_s: float
    """Busy rank-seconds / ranks: the micro-batch phase with perfect balance."""
    critical_path_s: float
    breakdown: dict[str, float]
    """GPU-seconds of the micro-batch phase by term (:data:`BREAKDOWN_TERMS`), over all HDP
    ranks and PP stages of one TP rank; ``comm`` is all P2P link time, hidden or not."""
    p2p_bytes: float
    inter_node_p2p_bytes: float
    """The part of ``p2p_bytes`` that crosses a node boundary."""
    micro_batch_counts: tuple[int, ...]
    ring_sizes: dict[int, int]
    """Ring size -> number of micro-batches with it."""
    offloaded_micro_batches: int
    meta: dict[str, Any] = field(default_factory=dict)
    planner_wall_s: float | None = None
    """Planner wall time on the machine that ran the simulator (information only: it is in no
    simulated time, which depends on the modelled cluster alone)."""

    @property
    def num_gpus(self) -> int:
        return self.hdp_size * self.pp_size * self.tensor_parallel_size

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.num_gpus if self.num_gpus else 0.0

    @property
    def balance_ratio(self) -> float:
        """Micro-batch phase over the perfect-balance bound."""
        return self.micro_batch_phase_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    def fraction(self, term: str) -> float:
        """Share of the micro-batch phase's GPU-seconds spent on ``term``."""
        total = sum(self.breakdown[t] for t in BREAKDOWN_TERMS)
        return self.breakdown.get(term, 0.0) / total if total > 0 else 0.0

    def to_dict(self, *, per_rank: bool = True) -> dict[str, Any]:
        """Plain JSON-able data (per-rank arrays only with ``per_rank``)."""
        out: dict[str, Any] = {
            "name": self.name, "scheduler": self.scheduler, "hdp_size": self.hdp_size,
            "pp_size": self.pp_size, "tensor_parallel_size": self.tensor_parallel_size,
            "num_gpus": self.num_gpus, "tokens": self.tokens, "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "micro_batch_phase_s": self.micro_batch_phase_s, "grad_reduce_s": self.grad_reduce_s,
            "optimizer_s": self.optimizer_s, "data_wait_s": self.data_wait_s, "plan_s": self.plan_s,
            "planner_wall_s": self.planner_wall_s,
            "lookahead": self.lookahead, "lower_bound_s": self.lower_bound_s,
            "balance_ratio": self.balance_ratio, "critical_path_s": self.critical_path_s,
            "max_rank_busy_s": float(self.rank_busy_s.max()) if len(self.rank_busy_s) else 0.0,
            "mean_rank_busy_s": float(self.rank_busy_s.mean()) if len(self.rank_busy_s) else 0.0,
            "min_rank_busy_s": float(self.rank_busy_s.min()) if len(self.rank_busy_s) else 0.0,
            "breakdown_gpu_s": dict(self.breakdown),
            "p2p_bytes": self.p2p_bytes, "inter_node_p2p_bytes": self.inter_node_p2p_bytes,
            "micro_batches_per_rank": {"min": min(self.micro_batch_counts, default=0),
                                       "max": max(self.micro_batch_counts, default=0)},
            "ring_sizes": {str(k): v for k, v in sorted(self.ring_sizes.items())},
            "offloaded_micro_batches": self.offloaded_micro_batches,
            "meta": dict(self.meta),
        }  # fmt: skip
        if per_rank:
            out["rank_busy_s"] = [float(x) for x in self.rank_busy_s]
            out["rank_finish_s"] = [float(x) for x in self.rank_finish_s]
        return out


def simulate_step(
    plan: StepPlan,
    cost_model: CostModel,
    *,
    overheads: StepOverheads | None = None,
    plan_s: float = 0.0,
    lookahead: bool = False,
    tensor_parallel_size: int = 1,
    topology: Topology | None = None,
    name: str | None = None,
    planner_wall_s: float | None = None,
) -> StepResult:
    """Simulate one training step of ``plan`` (see the module docstring).

    Args:
        plan: a plan from :func:`~megatron_bytescale.planner.make_plan` (a timing-only plan,
            ``pieces=False``, is enough).
        cost_model: the model the times come from (the one the plan was made with, or another
            one to ask "what if this plan ran on that cluster").
        overheads: gradient reduction, optimizer and data terms (default: none of them).
        plan_s: modelled seconds the cluster's planner takes for this step (``overheads.plan_s``
            wins when set); an input, never this machine's measured time.
        lookahead: the plan and data were prepared during the previous step.
        tensor_parallel_size: GPUs per pipeline stage (only for per-GPU throughput).
        topology: where the HDP ranks sit (default: the plan's ``meta["topology"]``, else the
            cost model's ``ranks_per_node``): ring steps and the gradient reduction run at the
            NVLink rate only when all their ranks share a node.
        name: label of the result (default: the plan's scheduler).
        planner_wall_s: how long planning took on this machine; stored for reports only.
    """
    overheads = overheads or StepOverheads()
    if overheads.plan_s is not None:
        plan_s = overheads.plan_s
    topo = Topology.for_plan(plan, cost_model, topology)
    costs, timeline = simulate_plan(plan, cost_model, topology=topo)
    n, pp = plan.hdp_size, plan.pp_size
    finish = np.asarray(timeline.rank_finish_s, dtype=np.float64)
    phase = float(finish.max()) if n else 0.0

    ranks, owners = _holdings(costs)
    busy = np.bincount(ranks, weights=costs.seconds[owners], minlength=n) if len(ranks) else np.zeros(n)
    terms = cost_model.ring_time_terms(
        costs.sum_p, costs.sum_p2, costs.ring_sizes, layers=plan.layers_per_stage,
        offload_ratio=costs.offload, intra_node=costs.intra_node, node_group=costs.node_group,
        num_docs=costs.num_docs if costs.num_docs is not None else 1,
    )
    members = costs.ring_sizes.astype(np.float64) * pp  # GPU-seconds: every member, every stage
    breakdown = {
        "compute": float(np.sum(np.asarray(terms.compute) * members)),
        "exposed_comm": float(np.sum(np.asarray(terms.exposed_comm) * members)),
        "step_overhead": float(np.sum(np.asarray(terms.step_overhead) * members)),
        "exposed_offload": float(np.sum(np.asarray(terms.exposed_offload) * members)),
    }
    breakdown["idle"] = max(0.0, phase * n * pp - sum(breakdown.values()))
    breakdown["comm"] = float(np.sum(np.asarray(terms.comm) * members))

    reduce_s = overheads.grad_reduce_s(n, cost_model, one_node=topo.ring_is_intra_node(range(n)))
    optimizer_s = overheads.optimizer_s(n)
    wait = overheads.data_wait_s(plan_s, phase + reduce_s + optimizer_s, lookahead=lookahead)
    counts = tuple(plan.micro_batch_counts())
    return StepResult(
        name=name or plan.scheduler,
        scheduler=plan.scheduler,
        hdp_size=n,
        pp_size=pp,
        tensor_parallel_size=tensor_parallel_size,
        tokens=plan.total_tokens,
        step_time_s=wait + phase + reduce_s + optimizer_s,
        micro_batch_phase_s=phase,
        grad_reduce_s=reduce_s,
        optimizer_s=optimizer_s,
        data_wait_s=wait,
        plan_s=float(plan_s),
        lookahead=lookahead,
        rank_busy_s=busy,
        rank_finish_s=finish,
        lower_bound_s=float(np.sum(costs.seconds * costs.ring_sizes)) / n if n else 0.0,
        critical_path_s=critical_path(plan, cost_model, costs, topology=topo),
        breakdown=breakdown,
        p2p_bytes=float(np.sum(costs.p2p_bytes)),
        inter_node_p2p_bytes=float(np.sum(costs.inter_node_bytes)),
        micro_batch_counts=counts,
        ring_sizes=dict(sorted(Counter(costs.ring_sizes.tolist()).items())),
        offloaded_micro_batches=int(np.sum(costs.offload > 0)),
        meta={k: plan.meta[k] for k in ("cp_size", "dp_size", "mode", "assignment", "widened_units",
                                        "dropped_tokens", "truncated_tokens") if k in plan.meta},
        planner_wall_s=planner_wall_s,
    )


def _holdings(costs: Any) -> tuple[np.ndarray, np.ndarray]:
    """(rank, micro-batch index) of every rank's every micro-batch."""
    index = {int(o): k for k, o in enumerate(costs.orders.tolist())}
    ranks: list[int] = []
    owners: list[int] = []
    for order, holders in costs.holders.items():
        k = index[int(order)]
        ranks.extend(holders)
        owners.extend([k] * len(holders))
    return np.asarray(ranks, dtype=np.int64), np.asarray(owners, dtype=np.int64)
