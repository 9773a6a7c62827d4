"""Turn a :class:`ByteScaleConfig` and a cost model into the planner function the iterator calls."""

from __future__ import annotations

from typing import Callable, Optional

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.plan import StepPlan

from .config import ByteScaleConfig


def make_step_planner(
    config: ByteScaleConfig,
    *,
    hdp_size: int,
    cost_model: CostModel,
    scheduler: Optional[str] = None,
) -> Callable[[list[int]], StepPlan]:
    """``lengths -> StepPlan`` with the config's scheduler (or ``scheduler``), capacity, etc.

    The function is deterministic (same lengths, same plan on every rank), which the
    ``every_rank`` plan mode relies on.
    """
    from megatron_bytescale.planner.schedulers import make_plan

    capacity = config.require_capacity()
    chosen = scheduler or config.scheduler
    if config.context_length is not None and not config.offload:
        if config.context_length > hdp_size * capacity:
            raise ValueError(
                f"--bytescale-capacity {capacity} is too small: a sequence of the context length "
                f"(--bytescale-context-length {config.context_length}) needs "
                f"{-(-config.context_length // capacity)} ranks, and there are {hdp_size} HDP "
                "ranks; raise the capacity, use more ranks, shorten the context, or enable "
                "--bytescale-offload"
            )

    def plan(lengths: list[int]) -> StepPlan:
        return make_plan(
            lengths,
            scheduler=chosen,
            hdp_size=hdp_size,
            capacity=capacity,
            cost_model=cost_model,
            pp_size=1,
            offload=config.offload,
            overlong=config.overlong,
            align=config.align,
            context_length=config.context_length,
        )

    return plan
