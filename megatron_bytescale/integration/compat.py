"""The one place that knows how megatron-core and Megatron-LM differ between versions (D9).

Supported: megatron-core / Megatron-LM **0.16.1** (tag ``core_v0.16.1``; Python 3.10-3.11, the
newest release that installs there) and **0.19.x** (tag ``core_v0.19.0``; Python 3.12+). The
version is read from ``megatron.core.package_info`` (for a Megatron-LM checkout on
``PYTHONPATH`` that is the checkout's own ``megatron/core``), never guessed from which imports
work. Anything else is refused at start-up by :func:`require_supported_megatron`, with the list.

What differs, and who asks here (callers never check versions themselves):

* ``schedules.backward_step`` lost its ``model_type`` argument after 0.16
  (:func:`megatron_backward_step`);
* Megatron-LM's ``pretrain_gpt.py`` builds the model from a config container
  (``gpt_config_from_args``) in 0.19, from ``model_provider`` in 0.16.1: the patch for each tag
  hands the plugin's builder over its own way (:func:`megatron_lm_patch_tag` names the patch);
* megatron-core 0.19 ships its own dynamic ("hybrid") context-parallel scheduler, the baseline
  row of ``bytescale plan --compare`` (:func:`has_megatron_hybrid_cp_scheduler`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Optional

import torch

#: (major, minor) -> (the oldest patch release supported, the Megatron-LM tag of its patch)
SUPPORTED_MEGATRON = {(0, 16): (1, "core_v0.16.1"), (0, 19): (0, "core_v0.19.0")}


class UnsupportedMegatronVersion(RuntimeError):
    """megatron-core / Megatron-LM at a version the plugin was not built and tested for."""


def supported_megatron_versions() -> str:
    """The supported versions as users read them: ``0.16.1 (core_v0.16.1), 0.19.x (...)``."""
    parts = []
    for (major, minor), (patch, tag) in sorted(SUPPORTED_MEGATRON.items()):
        shown = f"{major}.{minor}.{patch}" if (major, minor) == (0, 16) else f"{major}.{minor}.x"
        parts.append(f"{shown} (Megatron-LM {tag})")
    return ", ".join(parts)


def parse_megatron_version(text: str) -> tuple[int, int, int]:
    """``"0.19.1rc0"`` -> ``(0, 19, 1)``; a string that is not ``MAJOR.MINOR.PATCH...`` raises."""
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", str(text))
    if match is None:
        raise UnsupportedMegatronVersion(
            f"cannot read the megatron-core version {text!r} (megatron.core.package_info); "
            f"megatron_bytescale supports {supported_megatron_versions()}"
        )
    return int(match[1]), int(match[2]), int(match[3])


@lru_cache(maxsize=1)
def megatron_core_version() -> tuple[int, int, int]:
    """The version of the ``megatron.core`` that imports here, from its ``package_info``."""
    from megatron.core import package_info

    return parse_megatron_version(package_info.__version__)


def require_supported_megatron(version: Optional[tuple[int, int, int]] = None
                               ) -> tuple[int, int, int]:
    """``version`` (default: the installed one) if supported, else a one-line refusal.

    Raises :class:`UnsupportedMegatronVersion` naming the version found, the supported list and
    what to do.
    """
    found = megatron_core_version() if version is None else tuple(version)
    entry = SUPPORTED_MEGATRON.get(tuple(found[:2]))
    if entry is None or found[2] < entry[0]:
        shown = ".".join(map(str, found))
        raise UnsupportedMegatronVersion(
            f"megatron-core / Megatron-LM {shown} is not supported; megatron_bytescale supports "
            f"{supported_megatron_versions()}. Install a supported megatron-core "
            "(scripts/setup_env.sh picks the one for your Python) or check out a supported "
            "Megatron-LM tag"
        )
    return found  # type: ignore[return-value]


def megatron_lm_patch_tag(version: Optional[tuple[int, int, int]] = None) -> str:
    """The Megatron-LM tag whose patch fits ``version`` (default: the installed megatron-core)."""
    found = require_supported_megatron(version)
    return SUPPORTED_MEGATRON[tuple(found[:2])][1]


def is_megatron_019(version: Optional[tuple[int, int, int]] = None) -> bool:
    """True on megatron-core 0.19.x (the config-container ``pretrain``, hybrid CP scheduler)."""
    return tuple(require_supported_megatron(version)[:2]) >= (0, 19)


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

    if megatron_core_version() < (0, 17, 0):  # 0.16.1: (..., model_type, config)
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


def has_megatron_hybrid_cp_scheduler() -> bool:
    """True where megatron-core ships its hybrid CP scheduler (0.19.x; not 0.16.1)."""
    return megatron_core_version() >= (0, 19, 0)
