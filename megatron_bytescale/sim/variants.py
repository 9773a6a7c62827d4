"""The systems the simulator compares, and running them on one global batch.

================== ========= ======= ========= ==============================================
variant            scheduler offload lookahead what it is
================== ========= ======= ========= ==============================================
static             static    no      no        Megatron/MegaScale static DP x CP with packing
                                               (the paper's baseline)
pow2               pow2      no      no        Megatron hybrid CP: power-of-two rings on
                                               aligned blocks, barriers between groups
naive              naive     no      no        HDP, Alg. 1: dynamic rings of ceil(s / C) ranks
                                               ("+ dynamic communication")
naive+offload      naive     Eq. 3   no        Alg. 1 with Eq. 3's smaller offloaded rings
                                               ("+ selective offloading")
balance            balance   Eq. 3   no        Alg. 2 ("+ balance strategy")
balance+lookahead  balance   Eq. 3   yes       the next step planned while this one trains
                                               ("+ remote dataloader with CPU prefetch")
================== ========= ======= ========= ==============================================

The last four are the paper's ablation (Fig. 20) in order. Every variant plans the same global
batch with the planner's real scheduler (a timing-only plan, no token pieces) and is timed by
:func:`.step.simulate_step`. The planner's wall time on this machine is measured and reported
(:attr:`.StepResult.planner_wall_s`) but is in no simulated step: a step waits only for the
modelled planning time :attr:`.StepOverheads.plan_s` (0 by default), hidden by lookahead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..planner.cost_model import CostModel
from ..planner.schedulers import check_seq_split, make_plan
from ..planner.topology import Topology
from .overheads import StepOverheads
from .step import StepResult, simulate_step


@dataclass(frozen=True)
class Variant:
    """A scheduler with its offload and lookahead switches."""

    name: str
    scheduler: str
    offload: bool
    lookahead: bool
    label: str


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("static", "static", False, False, "static DPxCP"),
        Variant("pow2", "pow2", False, False, "pow2 (Megatron hybrid CP)"),
        Variant("naive", "naive", False, False, "HDP naive"),
        Variant("naive+offload", "naive", True, False, "HDP naive + offload"),
        Variant("balance", "balance", True, False, "HDP balance"),
        Variant("balance+lookahead", "balance", True, True, "HDP balance + lookahead"),
    )
}
#: The paper's ablation (Fig. 20), cumulative, baseline first.
ABLATION = ("static", "naive", "naive+offload", "balance", "balance+lookahead")


def parse_variants(spec: str | Iterable[str]) -> list[Variant]:
    """Variants from ``"static,naive,balance"`` (or a list of names), in the order given.

    Raises:
        ValueError: an unknown name (the message lists the known ones) or an empty list.
    """
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [s for s in names if s]
    if not names:
        raise ValueError(f"no scheduler variant given; choose from {', '.join(VARIANTS)}")
    out = []
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"unknown scheduler variant {name!r}; choose from {', '.join(VARIANTS)}")
        if VARIANTS[name] not in out:
            out.append(VARIANTS[name])
    return out


@dataclass(frozen=True, kw_only=True)
class ClusterSetup:
    """The cluster, model and scheduler settings every variant of a comparison shares."""

    hdp_size: int
    capacity: int
    cost_model: CostModel
    pp_size: int = 1
    tensor_parallel_size: int = 1
    align: int = 1
    overlong: str = "error"
    delta: float = 0.05
    num_buckets: int = 4
    overheads: StepOverheads = field(default_factory=StepOverheads)
    topology: Topology | None = None
    """Where the HDP ranks sit (None: ``cost_model.ranks_per_node`` consecutive ranks per node)."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline stage: interleaved 1F1B when above 1 (every variant's plan is
    timed with it; the rings are the scheduler's)."""
    seq_split: bool = False
    """Balance variants split their longest rings along the pipeline where it pays and fits
    (``make_plan(seq_split=True)``); PP > 1 and plain 1F1B only."""
    ep_size: int = 1
    """Expert-parallel size the plans must honour (``make_plan``'s ``ep_size``): every ring
    micro-batch at one local index on all its members. ``naive`` and ``pow2`` plans that break
    it come back as errors."""

    def __post_init__(self) -> None:
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1 \
                or self.hdp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size!r}) must be an integer >= 1 that divides hdp_size "
                             f"({self.hdp_size}): expert groups are that many consecutive HDP ranks")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size!r}) must be an integer >= 1")
        if self.seq_split:
            check_seq_split(scheduler="balance", pp_size=self.pp_size, ep_size=self.ep_size,
                            virtual_pipeline_size=self.virtual_pipeline_size, flag="--seq-split")

    @property
    def num_gpus(self) -> int:
        return self.hdp_size * self.pp_size * self.tensor_parallel_size


@dataclass(frozen=True, kw_only=True)
class VariantOutcome:
    """One variant on one batch: its result, or why it does not apply (e.g. pow2 with PP)."""

    variant: Variant
    result: StepResult | None = None
    error: str | None = None


def plan_for(lengths: Any, variant: Variant, setup: ClusterSetup, *, context_length: int | None = None) -> tuple[Any, float]:
    """The variant's timing-only plan of ``lengths`` and the seconds planning took on this
    machine (for reports; a simulated step never contains it)."""
    start = time.perf_counter()
    plan = make_plan(
        lengths, scheduler=variant.scheduler, hdp_size=setup.hdp_size, capacity=setup.capacity,
        cost_model=setup.cost_model, pp_size=setup.pp_size, offload=variant.offload,
        overlong=setup.overlong, align=setup.align, context_length=context_length,
        delta=setup.delta, num_buckets=setup.num_buckets, estimate=False, pieces=False,
        topology=setup.topology, seq_split=setup.seq_split and variant.scheduler == "balance",
        ep_size=setup.ep_size, virtual_pipeline_size=setup.virtual_pipeline_size,
    )
    return plan, time.perf_counter() - start


def simulate_variants(
    lengths: Any,
    variants: Sequence[Variant],
    setup: ClusterSetup,
    *,
    context_length: int | None = None,
    on_result: Callable[[VariantOutcome], None] | None = None,
) -> list[VariantOutcome]:
    """Plan ``lengths`` with every variant and simulate the step; one outcome per variant.

    Variants that share a scheduler and offload setting (``balance`` and
    ``balance+lookahead``) share one plan. A variant the planner refuses (ValueError: e.g.
    ``pow2`` with PP, or a context no static CP size holds) gets ``error`` instead of a result.
    """
    plans: dict[tuple[str, bool], tuple[Any, float] | str] = {}
    out: list[VariantOutcome] = []
    for variant in variants:
        key = (variant.scheduler, variant.offload)
        if key not in plans:
            try:
                plans[key] = plan_for(lengths, variant, setup, context_length=context_length)
            except ValueError as exc:
                plans[key] = str(exc)
        planned = plans[key]
        if isinstance(planned, str):
            outcome = VariantOutcome(variant=variant, error=planned)
        else:
            plan, seconds = planned
            outcome = VariantOutcome(variant=variant, result=simulate_step(
                plan, setup.cost_model, overheads=setup.overheads, planner_wall_s=seconds,
                lookahead=variant.lookahead, tensor_parallel_size=setup.tensor_parallel_size,
                topology=setup.topology, name=variant.name,
            ))
        out.append(outcome)
        if on_result is not None:
            on_result(outcome)
    return out
