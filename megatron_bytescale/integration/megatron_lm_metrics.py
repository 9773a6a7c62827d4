"""The per-step HDP metrics in Megatron-LM's own log line, TensorBoard and W&B.

No patch line is needed: Megatron's ``train_step`` averages every key of the loss reports that
``forward_backward_func`` returns, and ``training_log`` prints every key in its iteration line
and writes it to its TensorBoard writer (and W&B, when enabled). So
:func:`report_step_metrics` adds the step's metrics (:mod:`.step_metrics`) to each report as
1-element tensors with the same value on every report and rank (Megatron's one-element
branch takes their mean: the value itself); the log line then shows, like the loss, their mean
over the log interval. The rings of each size, which vary in number, go to TensorBoard/W&B
directly, and a one-line summary of the step (``[ByteScale HDP] iteration N | rings 1x8 2x1 |
...``) is printed just before Megatron's line at every ``--log-interval``.

Megatron also logs "setting number of microbatches to constant N" at start-up. Under HDP that
count is not what runs, so :func:`explain_micro_batch_count` rewrites that line to say so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .step_metrics import METRIC_NAMES, OFFLOAD_METRIC_NAMES, HDPStepMetrics, gather_step_metrics

if TYPE_CHECKING:
    from megatron_bytescale.data.hdp_iterator import HDPStep
    from megatron_bytescale.runtime.offload import OffloadStats

    from .groups import HDPGroupManager
    from .schedule import MicroBatchRecord

__all__ = ["explain_micro_batch_count", "report_step_metrics"]

CALCULATOR_LOGGER = "megatron.core.num_microbatches_calculator"


def report_step_metrics(step: "HDPStep", records: list["MicroBatchRecord"], reports: list[dict],
                        *, manager: "HDPGroupManager", args: Any = None,
                        offload: "OffloadStats | None" = None) -> HDPStepMetrics | None:
    """Add the step's HDP metrics to Megatron's loss ``reports`` and log them (see above).

    Every rank of the HDP group calls it once per training step. ``args`` are Megatron's
    (for the iteration and the log intervals; None outside Megatron-LM: nothing is printed);
    ``offload``: this rank's activation offload totals of the step (with offload on; adds
    ``hdp offload MB`` and ``hdp peak saved MB``).
    Returns the metrics on the ranks that print or write them, else None (no host sync).
    """
    values = gather_step_metrics(step, busy_s=sum(r.busy_s for r in records),
                                 p2p_bytes=sum(r.p2p_bytes for r in records),
                                 group=manager.hdp.group, offload=offload)
    device = reports[0]["lm loss"].device if reports else None
    names = {**METRIC_NAMES, **OFFLOAD_METRIC_NAMES}
    named = {names[k]: v.to(device) for k, v in values.items()}
    for report in reports:
        report.update(named)
    if args is None or not _is_last_rank():
        return None
    iteration = int(getattr(args, "curr_iteration", step.index)) + 1
    log_now = iteration % max(int(getattr(args, "log_interval", 1) or 1), 1) == 0
    writer, wandb = _writers()
    write_now = writer is not None and iteration % max(
        int(getattr(args, "tensorboard_log_interval", 1) or 1), 1) == 0
    if not (log_now or write_now):
        return None
    metrics = HDPStepMetrics.from_tensors(step, values)
    if log_now:
        print(f" [ByteScale HDP] iteration {iteration:8d} | {metrics.summary()}", flush=True)
    if write_now:
        for size, count in metrics.rings_by_size:
            writer.add_scalar(f"hdp rings of size {size}", count, iteration)
        if wandb is not None:
            wandb.log({f"hdp rings of size {size}": count
                       for size, count in metrics.rings_by_size}, iteration)
    return metrics


def _is_last_rank() -> bool:
    """Megatron prints its iteration line and holds its writers on the last rank."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def _writers() -> tuple[Any, Any]:
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return None, None
    return get_tensorboard_writer(), get_wandb_writer()


class _MicroBatchCountNote(logging.Filter):
    """Appends what HDP runs instead to Megatron's constant micro-batch count line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("setting number of microbatches to constant"):
            record.msg = (f"{message} (Megatron's fixed count; with --bytescale-hdp each rank "
                          "runs the micro-batches its step plan gives it, a number that differs "
                          "between ranks and steps: see 'hdp mb/rank min/mean/max' in the "
                          "iteration lines)")
            record.args = ()
        return True


def explain_micro_batch_count() -> None:
    """Rewrite Megatron's "setting number of microbatches to constant N" line (idempotent)."""
    logger = logging.getLogger(CALCULATOR_LOGGER)
    if not any(isinstance(f, _MicroBatchCountNote) for f in logger.filters):
        logger.addFilter(_MicroBatchCountNote())

