"""Build a megatron-core GPT for HDP: config, model, DDP over the HDP group, optimizer.

These helpers only set what HDP requires and leave everything else to the caller:

* ``calculate_per_token_loss=True`` (token-level loss over the global batch, D6) and
  ``DistributedDataParallelConfig(average_in_collective=False)`` (Megatron requires it with
  per-token loss);
* ``config.no_sync_func`` / ``config.finalize_model_grads_func`` so the schedule driver
  defers gradient sync to the last micro-batch and reduces over the HDP group, and
  ``config.grad_scale_func`` (the optimizer's loss scale: fp16 loss scaling);
* the optimizer: Megatron's **distributed optimizer** (ZeRO-1 sharded over the HDP group,
  paper §5.1) when CUDA is available; on a CPU-only machine plain Megatron DDP + Adam with
  ``clip_grad=0``, because the distributed optimizer rejects CPU tensors ("Wrapped parameters
  must be one of torch.cuda.FloatTensor ...") and gradient clipping asserts CUDA tensors.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from .grad_sync import install_ordered_grad_sync
from .layer_spec import get_bytescale_layer_spec
from .model import ByteScaleGPTModel

logger = logging.getLogger(__name__)


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (needed before building a model).

    On CPU this relies on ``testing.cpu_compat`` having redirected megatron's CUDA RNG calls.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def make_transformer_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: Optional[int] = None,
    ffn_hidden_size: Optional[int] = None,
    **overrides: Any,
) -> TransformerConfig:
    """A ``TransformerConfig`` with the settings HDP needs (per-token loss, no attention dropout).

    On a machine without CUDA the model is initialised on the CPU
    (``use_cpu_initialization=True``; megatron's GPU initialisation asserts CUDA). The TP and
    PP sizes (and virtual stages, and for a MoE model the expert-parallel size) default to those
    Megatron was initialised with (pass ``sequence_parallel=True`` to split the token dimension
    over the TP ranks).
    """
    from megatron.core import parallel_state

    settings: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        calculate_per_token_loss=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        pipeline_dtype=torch.float32,
    )
    if parallel_state.model_parallel_is_initialized():
        settings.update(
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        )
        if overrides.get("num_moe_experts"):
            settings["expert_model_parallel_size"] = (
                parallel_state.get_expert_model_parallel_world_size())
            settings["expert_tensor_parallel_size"] = (
                parallel_state.get_expert_tensor_parallel_world_size())
    settings.update(overrides)
    if not settings["calculate_per_token_loss"]:
        raise ValueError("HDP needs calculate_per_token_loss=True")
    return TransformerConfig(**settings)


def moe_spec_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """The layer-spec arguments of the config's MoE settings (none for a dense model)."""
    if not config.num_moe_experts:
        return {}
    return dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)


def build_gpt_model(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    use_transformer_engine: Optional[bool] = None,
    position_embedding_type: str = "rope",
    vp_stage: Optional[int] = None,
    **model_kwargs: Any,
) -> ByteScaleGPTModel:
    """A :class:`ByteScaleGPTModel` on the ByteScale layer spec: this pipeline stage's layers
    (with interleaved stages, model chunk ``vp_stage``'s).

    ``pre_process`` (embedding) and ``post_process`` (output layer and loss) default to whether
    this rank is the first / last pipeline stage (both with PP = 1); with virtual stages, only
    chunk 0 of the first stage embeds and only the last chunk of the last stage computes the loss.
    """
    from megatron.core import parallel_state

    spec = get_bytescale_layer_spec(use_transformer_engine=use_transformer_engine,
                                    **moe_spec_kwargs(config))
    stages = dict(pre_process=True, post_process=True)
    if parallel_state.model_parallel_is_initialized():
        virtual = vp_stage is not None
        stages = dict(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
                      post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=vp_stage))
    if vp_stage is not None:
        stages["vp_stage"] = vp_stage
    stages.update(model_kwargs)
    model = ByteScaleGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type=position_embedding_type,
        **stages,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def wrap_for_hdp(
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    lr: float,
    weight_decay: float = 0.0,
    adam_beta2: float = 0.95,
    distributed_optimizer: Optional[bool] = None,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    clip_grad: Optional[float] = None,
    bucket_size: Optional[int] = None,
) -> tuple[DistributedDataParallel, Any]:
    """Wrap ``model`` in Megatron DDP over the HDP group and build the optimizer.

    ``model`` may be the list of this stage's model chunks (interleaved pipeline stages): each
    chunk gets its own DDP and one optimizer holds them all; the list is returned.

    Args:
        distributed_optimizer: ZeRO-1 over the HDP group; default on with CUDA, and refused
            without it (see the module docstring).
        overlap_grad_reduce: reduce gradient buckets during the last micro-batch's backward;
            the buckets are issued in one fixed order on every rank, also on a rank without
            micro-batches (:mod:`.grad_sync`).
        overlap_param_gather: all-gather the updated parameters during the next forward
            (needs the distributed optimizer and ``overlap_grad_reduce``).
        clip_grad: gradient-norm clipping; default 1.0 with CUDA, 0 (off) on CPU where
            Megatron's clipping asserts CUDA tensors.
    """
    config = (model[0] if isinstance(model, (list, tuple)) else model).config
    on_cuda = torch.cuda.is_available()
    if distributed_optimizer is None:
        distributed_optimizer = on_cuda
    if distributed_optimizer and not on_cuda:
        raise ValueError(
            "the distributed optimizer (ZeRO-1 over the HDP group) needs CUDA: megatron-core "
            "rejects CPU parameters; use distributed_optimizer=False on CPU"
        )
    if overlap_param_gather and not (distributed_optimizer and overlap_grad_reduce):
        raise ValueError(
            "overlap_param_gather=True needs the distributed optimizer and "
            "overlap_grad_reduce=True (Megatron gathers the parameters its optimizer shards)"
        )
    if clip_grad is None:
        clip_grad = 1.0 if on_cuda else 0.0
    if clip_grad and not on_cuda:
        raise ValueError("gradient clipping needs CUDA in megatron-core; use clip_grad=0 on CPU")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=distributed_optimizer,
        average_in_collective=False,
        bucket_size=bucket_size,
    )
    if config.fp16 or config.bf16:
        # as Megatron-LM's get_model does: half-precision weights, fp32 logits out
        model = Float16Module(config, model)
    if isinstance(model, (list, tuple)):  # interleaved stages: one DDP per model chunk
        chunks = [Float16Module(config, m) if config.fp16 or config.bf16 else m for m in model]
        # as Megatron-LM's get_model: only the first chunk's buckets are split
        ddp_models = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                              disable_bucketing=k > 0) for k, m in enumerate(chunks)]
        config.no_sync_func = [m.no_sync for m in ddp_models]
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(_optimizer_config(config, lr, weight_decay, adam_beta2, clip_grad,
                                                             distributed_optimizer), ddp_models)
        config.grad_scale_func = optimizer.scale_loss
        return ddp_models, optimizer
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    install_ordered_grad_sync(ddp_model)
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = _optimizer_config(config, lr, weight_decay, adam_beta2, clip_grad, distributed_optimizer)
    optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])
    # as Megatron-LM's training loop does: backward_step scales the loss by the optimizer's loss
    # scale, which the fp16 optimizer divides out of the gradients again
    config.grad_scale_func = optimizer.scale_loss
    logger.info(
        "HDP training: DDP over the HDP group, %s optimizer",
        "distributed (ZeRO-1)" if distributed_optimizer else "replicated",
    )
    return ddp_model, optimizer


def _optimizer_config(config: TransformerConfig, lr: float, weight_decay: float, adam_beta2: float,
                      clip_grad: float, distributed_optimizer: bool) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta2=adam_beta2,
        clip_grad=clip_grad,
        use_distributed_optimizer=distributed_optimizer,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
    )
