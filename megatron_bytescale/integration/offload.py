"""Selective activation offload for megatron-core models: find the layers, keep one offloader.

The offload context itself (:class:`~megatron_bytescale.runtime.ActivationOffloader`) is plain
torch; this module only knows where megatron-core keeps the decoder layers
(``GPTModel.decoder.layers``, under any DDP / ``Float16Module`` wrappers) and keeps one
offloader per model, so its host buffer pool is reused from step to step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from megatron_bytescale.runtime import ActivationOffloader

_OFFLOADERS: "weakref.WeakKeyDictionary[torch.nn.Module, ActivationOffloader]" = weakref.WeakKeyDictionary()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer layers of a megatron-core GPT on this rank, in forward order."""
    inner: Any = model
    for _ in range(8):  # DDP -> Float16Module -> GPTModel
        if hasattr(inner, "decoder"):
            return list(inner.decoder.layers)
        inner = getattr(inner, "module", None)
        if inner is None:
            break
    raise ValueError(
        f"activation offload needs a megatron-core GPT model (with .decoder.layers), got "
        f"{type(model).__name__}; build it with integration.build_gpt_model"
    )


def activation_offloader(model: torch.nn.Module, **options: Any) -> ActivationOffloader:
    """The offloader of ``model`` (created on first use with ``options``, then reused).

    Parameters of the whole model are excluded from offload, not only the layers'. With
    sequence parallelism the offloader also knows the per-TP-rank token rows.
    """
    offloader = _OFFLOADERS.get(model)
    if offloader is None:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "sequence_parallel", False):
            options.setdefault("sequence_parallel_size", int(config.tensor_model_parallel_size))
        offloader = ActivationOffloader(decoder_layers(model), params_of=[model], **options)
        _OFFLOADERS[model] = offloader
    return offloader
