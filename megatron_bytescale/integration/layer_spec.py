"""Megatron GPT layer specs with ``ByteScaleCoreAttention`` in the core-attention slot.

Megatron's ``ModuleSpec`` tree lets a plugin replace one submodule without forking the model:
``spec.submodules.self_attention.submodules.core_attention`` is where the local spec puts
``DotProductAttention`` and the Transformer Engine spec puts ``TEDotProductAttention``. Every
other module (layernorms, QKV and output projections, MLP) stays Megatron's.
"""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from .core_attention import ByteScaleCoreAttention

logger = logging.getLogger(__name__)


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (never true on CPU machines)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # an empty meta-package raises RuntimeError, a missing one ImportError
        return False
    return True


def grouped_gemm_available(use_transformer_engine: bool) -> bool:
    """Whether megatron-core can run the experts as one grouped GEMM here: TE's grouped
    linear on the TE spec, the ``grouped_gemm`` package on the local spec."""
    if use_transformer_engine:
        return transformer_engine_available()
    from .compat import local_spec_grouped_gemm_ok

    return local_spec_grouped_gemm_ok()


def swap_core_attention(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a transformer-layer spec whose self-attention uses ``ByteScaleCoreAttention``.

    Works on any spec shaped like Megatron's GPT layer specs (local, TE, or the user's own).
    Multi-latent attention and specs without a self-attention core slot are refused.
    """
    new_spec = copy.deepcopy(spec)
    attention = getattr(new_spec.submodules, "self_attention", None)
    submodules = getattr(attention, "submodules", None)
    if submodules is None or not hasattr(submodules, "core_attention"):
        raise ValueError(
            "the layer spec has no self_attention.submodules.core_attention slot to fill with "
            "ByteScaleCoreAttention"
        )
    if hasattr(submodules, "linear_kv_down_proj"):
        raise ValueError("multi-latent attention (MLA) is not supported with HDP")
    submodules.core_attention = ByteScaleCoreAttention
    return new_spec


def get_bytescale_layer_spec(
    *,
    use_transformer_engine: Optional[bool] = None,
    **spec_kwargs: Any,
) -> ModuleSpec:
    """Megatron's GPT layer spec with the dynamic-ring core attention.

    Args:
        use_transformer_engine: True takes ``get_gpt_layer_with_transformer_engine_spec``
            (TE linears and norms; raises if TE is missing), False the local spec, None (the
            default) TE where it is installed and the local spec otherwise.
        **spec_kwargs: forwarded to Megatron's spec function (e.g. ``qk_layernorm``,
            ``normalization``, ``num_experts`` and ``moe_grouped_gemm`` for megatron-core's MoE
            layer: router, token dispatcher and experts, ``SequentialMLP`` where grouped GEMM
            is missing; :mod:`.moe` says which MoE settings train under HDP).
    """
    if spec_kwargs.get("multi_latent_attention"):
        raise ValueError("multi-latent attention (MLA) is not supported with HDP")
    use_te = (
        transformer_engine_available() if use_transformer_engine is None else use_transformer_engine
    )
    if spec_kwargs.get("num_experts") and spec_kwargs.get("moe_grouped_gemm"):
        if not grouped_gemm_available(use_te):
            logger.warning("grouped GEMM for the experts needs Transformer Engine or the "
                           "grouped_gemm package; running the experts one by one (SequentialMLP)")
            spec_kwargs["moe_grouped_gemm"] = False
    if use_te:
        if not transformer_engine_available():
            raise ImportError(
                "use_transformer_engine=True needs Transformer Engine "
                "(pip install --no-build-isolation 'transformer-engine[pytorch]'); "
                "pass use_transformer_engine=False for Megatron's local modules"
            )
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        base = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        base = get_gpt_layer_local_spec(**spec_kwargs)
    logger.debug("ByteScale layer spec on %s modules", "TE" if use_te else "local")
    return swap_core_attention(base)
