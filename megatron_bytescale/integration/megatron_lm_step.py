"""The HDP training step as Megatron-LM's ``train_step`` and ``evaluate`` call it.

:func:`hdp_forward_backward` has the signature of megatron-core's ``forward_backward_func``.
Megatron's ``train_step`` zeroes the gradient buffers, calls it once per step, steps the
optimizer and averages the returned loss reports over the data-parallel (= HDP) group;
``evaluate`` calls it with ``forward_only=True``. Each call takes ONE planned global batch
(:class:`~megatron_bytescale.data.hdp_iterator.HDPStep`) from the data iterator and runs this
rank's micro-batches of it through megatron-core's ``schedules.forward_step`` /
``backward_step``, in plan order (ring members meet in the same order, D5), with the micro-batch
bound to the HDP group manager so that ``ByteScaleCoreAttention`` finds its ring and layout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

import torch

from .config import ByteScaleConfig
from .groups import HDPGroupManager
from .schedule import check_trained_loss_tokens, run_micro_batches

logger = logging.getLogger(__name__)


def hdp_manager(args: Any) -> HDPGroupManager:
    """The HDP group manager over Megatron's (already initialised) data-parallel group."""
    from .groups import get_hdp_manager, initialize_hdp_model_parallel

    with contextlib.suppress(RuntimeError):
        return get_hdp_manager()
    config = ByteScaleConfig.from_args(args)
    return initialize_hdp_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        attention_backend=config.ring_attention_backend,
        dkv_wire=config.dkv_wire_dtype,
        # Megatron initialised its groups already (it is not initialised again); this sets the
        # ring groups' wait for a peer to the same --distributed-timeout-minutes
        distributed_timeout_minutes=getattr(args, "distributed_timeout_minutes", 30),
    )


def forward_step(data_iterator: Iterator[Any], model: Any, return_schedule_plan: bool = False):
    """``pretrain_gpt``'s forward step for one HDP micro-batch (one packed row, b = 1).

    Tokens at their original-document positions, next-token labels, token-level loss (sum and
    count, Megatron's 3-tuple form), and Megatron's NaN / Inf loss checks when enabled.
    """
    from .schedule import hdp_forward_step

    if return_schedule_plan:
        raise ValueError("--overlap-moe-expert-parallel-comm is not supported with --bytescale-hdp")
    timers = megatron_timers()
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    output, loss_func = hdp_forward_step(data_iterator, model)
    if timers is not None:
        timers("batch-generator").stop()
    return output, functools.partial(_checked_loss, loss_func)


def _checked_loss(loss_func: Callable[..., Any], output_tensor: torch.Tensor):
    loss, num_tokens, report = loss_func(output_tensor)
    args = megatron_args()
    if args is not None and getattr(args, "check_for_nan_in_loss_and_grad", False):
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0,
                                    message=f"found {what} in local forward loss calculation",
                                    fatal=True)
    return loss, num_tokens, report


def hdp_forward_backward(*, forward_step_func: Callable[..., Any], data_iterator: Any, model: Any,
                         num_microbatches: int, forward_only: bool = False,
                         collect_non_loss_data: bool = False, force_all_reduce: bool = False,
                         **_megatron_kwargs: Any) -> list[dict[str, torch.Tensor]]:
    """Megatron's ``forward_backward_func`` for HDP (with PP > 1: this stage's part, 1F1B).

    Takes the step's :class:`HDPStep` from ``data_iterator`` (one ``next()`` per step) and
    runs this rank's planned micro-batches, ignoring ``num_microbatches`` (Megatron's fixed
    count). Gradients are reduced once, after the last micro-batch, by
    ``config.finalize_model_grads_func`` with this rank's loss-token count (all-reduced there
    over the HDP group). Returns the per-micro-batch ``{'lm loss': [loss_sum, tokens]}``
    reports; a rank without micro-batches returns one zero report, so it still joins
    ``train_step``'s all-reduce of the loss. In training, every report also carries the step's
    HDP metrics (:mod:`.megatron_lm_metrics`), which Megatron logs with the loss.
    """
    from megatron.core.utils import get_model_config

    from megatron_bytescale.data.hdp_iterator import HDPStep

    from .groups import get_hdp_manager

    if collect_non_loss_data:
        raise ValueError("collecting non-loss data is not supported with --bytescale-hdp")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    # interleaved stages: one model chunk each, one HDP step (chunk 0's iterator; the rest None)
    model = chunks[0] if len(chunks) == 1 else chunks
    data_iterator = data_iterator[0] if isinstance(data_iterator, (list, tuple)) else data_iterator
    if data_iterator is None:
        raise ValueError("no HDP data iterator for this phase (is its --split share empty? "
                         "then pass --eval-iters 0)")
    step = next(data_iterator)
    if not isinstance(step, HDPStep):
        raise TypeError(
            f"the HDP schedule needs HDPStep items from its data iterator, got "
            f"{type(step).__name__}; build the iterators with megatron_lm.wrap_datasets_provider"
        )
    config = get_model_config(chunks[0])
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    from megatron_bytescale.runtime import CommCounters

    manager = get_hdp_manager()
    offloader = None if forward_only or len(chunks) > 1 else _offloader(model)
    records, tokens, store = run_micro_batches(step, model=model, config=config,
                                               manager=manager,
                                               forward_step_func=forward_step_func,
                                               forward_only=forward_only,
                                               counters=CommCounters(), offloader=offloader)
    check_trained_loss_tokens(step, records, manager)  # on the host: no device read-back (D12)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            chunks, tokens if config.calculate_per_token_loss else None,
            force_all_reduce=force_all_reduce,
        )  # fmt: skip
    offload = None
    if offloader is not None:  # the step's offload totals (also starts the next step's)
        offload = offloader.end_step()
        logger.debug("activation offload: %s", offload.as_dict())
    if config.timers is not None:
        config.timers("forward-backward").stop()
    if not store:
        store.append({"lm loss": torch.zeros(2, device=tokens.device)})
    if not forward_only:  # the step's HDP metrics: Megatron's log line, TensorBoard, W&B
        from .megatron_lm_metrics import report_step_metrics

        if getattr(config, "num_moe_experts", None):  # the router losses' log values
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            from .moe import record_router_loss_logs

            record_router_loss_logs(chunks, scale=get_num_microbatches() / max(step.total_tokens, 1))

        report_step_metrics(step, records, store, manager=manager, args=megatron_args(),
                            offload=offload)
    return store


def _offloader(model: Any) -> Any:
    """The model's activation offloader when ``--bytescale-offload`` is on (one per model)."""
    args = megatron_args()
    if args is None or not getattr(args, "bytescale_offload", False):
        return None
    from .offload import activation_offloader

    # the pinned host pool stays within the host budget the planner used (Eq. 3)
    host_gb = getattr(args, "bytescale_host_memory_gb", None)
    return activation_offloader(model, host_memory_bytes=host_gb * 1e9 if host_gb else None)


def megatron_args() -> Any:
    """Megatron's global args, or None outside a Megatron-LM run (megatron-core only)."""
    try:
        from megatron.training.global_vars import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except AssertionError:
        return None


def megatron_timers() -> Any:
    """Megatron's global timers, or None outside a Megatron-LM run."""
    try:
        from megatron.training.global_vars import get_timers

        return get_timers()
    except (ImportError, AssertionError):
        return None
