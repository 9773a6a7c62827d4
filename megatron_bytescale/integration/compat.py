"""The one place that knows how megatron-core's signatures differ between versions (D9).

The plugin targets megatron-core 0.16.1 (what installs on Python 3.11); later releases
dropped ``model_type`` from ``schedules.backward_step``. Callers use the wrappers here, never
version checks of their own.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=1)
def _backward_step_takes_model_type() -> bool:
    from megatron.core.pipeline_parallel import schedules

    return "model_type" in inspect.signature(schedules.backward_step).parameters


def megatron_backward_step(output_tensor: torch.Tensor, model: Any, config: Any) -> None:
    """Backward of one last-stage micro-batch through ``schedules.backward_step``."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_type

    if _backward_step_takes_model_type():
        schedules.backward_step(None, output_tensor, None, get_model_type(model), config)
    else:
        schedules.backward_step(None, output_tensor, None, config)


def megatron_forward_step(
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    *,
    num_microbatches: int,
    forward_data_store: list,
    config: Any,
    is_first_microbatch: bool,
    current_microbatch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One last-stage forward through ``schedules.forward_step`` (PP = 1, CP size 1)."""
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        None,
        forward_data_store,
        config,
        1,  # cp_group_size: Megatron's CP is 1 under HDP; rings are the plugin's
        is_first_microbatch=is_first_microbatch,
        current_microbatch=current_microbatch,
        is_last_stage=True,
    )
