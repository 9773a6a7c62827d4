"""The one place that knows how megatron-core's signatures differ between versions (D9).

The plugin targets megatron-core 0.16.1 (what installs on Python 3.11); later releases
dropped ``model_type`` from ``schedules.backward_step``. Callers use the wrappers here, never
version checks of their own.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Optional

import torch


@lru_cache(maxsize=1)
def _backward_step_takes_model_type() -> bool:
    from megatron.core.pipeline_parallel import schedules

    return "model_type" in inspect.signature(schedules.backward_step).parameters


def megatron_backward_step(
    output_tensor: torch.Tensor,
    model: Any,
    config: Any,
    *,
    input_tensor: Optional[torch.Tensor] = None,
    output_tensor_grad: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Backward of one micro-batch through ``schedules.backward_step``.

    On the last stage (PP = 1 included) ``output_tensor`` is the loss and there is no
    ``output_tensor_grad``; on other stages it is the stage's output and the gradient came
    from the next stage. Returns the gradient of ``input_tensor`` (None on the first stage).
    """
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_type

    if _backward_step_takes_model_type():
        return schedules.backward_step(
            input_tensor, output_tensor, output_tensor_grad, get_model_type(model), config
        )
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


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
    input_tensor: Optional[torch.Tensor] = None,
    is_last_stage: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward through ``schedules.forward_step`` (CP size 1: rings are the plugin's).

    ``input_tensor`` is what the previous pipeline stage sent (None on the first stage); the
    loss is computed on the last stage only.
    """
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        1,  # cp_group_size: Megatron's CP is 1 under HDP; rings are the plugin's
        is_first_microbatch=is_first_microbatch,
        current_microbatch=current_microbatch,
        is_last_stage=is_last_stage,
    )
