"""The Megatron glue: the only layer that imports ``megatron.core`` (DESIGN.md §2).

Public API (imported lazily, so ``import megatron_bytescale.integration`` stays cheap):

====================================  =====================================================
``initialize_hdp_model_parallel``     Megatron with CP = 1, DP = d_hdp; installs the HDP group
``HDPGroupManager`` / ``get_hdp_manager``  HDP group + the micro-batch the attention runs now
``HDPParallelLayout``                 refuses layouts HDP cannot serve (CP > 1, hybrid CP, virtual PP)
``HDPRankMap``                        this rank's HDP / TP / PP place, from Megatron's groups
``ByteScaleConfig`` / ``add_bytescale_args``  the ``--bytescale-*`` flags (extra_args_provider)
``get_bytescale_layer_spec`` / ``swap_core_attention``  GPT layer spec with the ring attention
``ByteScaleCoreAttention``            Megatron core-attention slot -> ``runtime.ring_attention``
``ByteScaleGPTModel``                 GPTModel with RoPE at each token's original position
``make_transformer_config`` / ``build_gpt_model`` / ``wrap_for_hdp``  model, DDP, optimizer
``make_step_planner``                 ByteScaleConfig + cost model -> ``lengths -> StepPlan``
``run_hdp_step`` / ``hdp_forward_step`` / ``token_level_loss``  the schedule driver (PP = 1 and 1F1B)
``run_pipeline_micro_batches``        one stage's 1F1B over its pipeline's planned micro-batches
``calibrate_cost_model``              fit the planner's cost model on the model being trained
``activation_offloader``              the model's selective activation offloader (one per model)
``measure_layer_costs`` / ``time_decoder`` / ``measure_host_link``  calibration's measurements
``install_ordered_grad_sync``         overlapped gradient reduction safe for ranks without micro-batches
``HDPStepMetrics``                    a step's HDP metrics (``StepRecord.hdp``, Megatron's log)
====================================  =====================================================
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "initialize_hdp_model_parallel": "groups",
    "HDPGroupManager": "groups",
    "HDPParallelLayout": "groups",
    "HDPRankMap": "groups",
    "get_hdp_manager": "groups",
    "set_hdp_manager": "groups",
    "ByteScaleConfig": "config",
    "add_bytescale_args": "config",
    "get_bytescale_layer_spec": "layer_spec",
    "swap_core_attention": "layer_spec",
    "ByteScaleCoreAttention": "core_attention",
    "ByteScaleGPTModel": "model",
    "make_transformer_config": "training",
    "build_gpt_model": "training",
    "wrap_for_hdp": "training",
    "seed_model_parallel": "training",
    "run_micro_batches": "schedule",
    "make_step_planner": "planning",
    "run_hdp_step": "schedule",
    "run_pipeline_micro_batches": "pipeline_schedule",
    "hdp_forward_step": "schedule",
    "token_level_loss": "schedule",
    "StepRecord": "schedule",
    "HDPStepMetrics": "step_metrics",
    "calibrate_cost_model": "calibration",
    "activation_offloader": "offload",
    "decoder_layers": "offload",
    "measure_layer_costs": "calibration",
    "time_decoder": "calibration",
    "measure_host_link": "calibration",
    "install_ordered_grad_sync": "grad_sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
