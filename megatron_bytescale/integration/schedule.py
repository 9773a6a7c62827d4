"""The HDP schedule driver (pipeline-parallel size 1; PP > 1 in :mod:`.pipeline_schedule`).

Megatron's ``forward_backward_no_pipelining`` assumes every data-parallel rank runs at least
one micro-batch (it always runs "the last one" outside ``no_sync``). Under the balance
scheduler a rank may run any number of micro-batches in a step, zero included, so this driver
runs the loop itself on megatron-core's own building blocks:

* every micro-batch goes through ``schedules.forward_step`` / ``schedules.backward_step`` with
  the micro-batch bound to the HDP group manager (its ring and layout), in plan order;
* all but the last run under DDP's ``no_sync``; the last one's backward queues the gradient
  reduction. A rank with no micro-batch skips straight to the reduction and contributes zero
  gradients and zero tokens: it still joins every collective, so nobody waits forever;
* there are no barriers: ranks meet only where the plan makes them meet (ring P2P, in the
  deadlock-free plan order) and in the gradient reduction at the end;
* token-level loss (D6): the loss function returns the *sum* of per-token losses and the
  number of loss tokens, ``calculate_per_token_loss=True`` stops Megatron from dividing by the
  micro-batch count, and ``finalize_model_grads`` all-reduces the token count over the HDP
  group and scales the reduced gradients by 1 / (loss tokens of the whole global batch);
* then the optimizer steps (Megatron's distributed optimizer, ZeRO-1 over the HDP group, on
  GPUs; plain Megatron DDP + Adam on CPU, see :mod:`.training`).

Busy time is CPU time (:func:`.busy_clock.busy_clock`: this thread's with one intra-op thread,
else the process's): on the CPU demo several ranks share a core, so wall time would hide the
imbalance between ranks, and the communication library's own threads are not compute.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional

import torch

from megatron_bytescale.runtime.offload import offload_micro_batch

from .busy_clock import busy_clock
from .compat import megatron_backward_step, megatron_forward_step
from .expert_layout import expert_block_words
from .grad_sync import gather_params_without_forward, install_ordered_grad_sync
from .groups import HDPGroupManager
from .step_metrics import HDPStepMetrics, gather_step_metrics

if TYPE_CHECKING:
    from megatron_bytescale.data.hdp_iterator import HDPStep
    from megatron_bytescale.runtime import ActivationOffloader, CommCounters, MicroBatchTensors, OffloadStats

logger = logging.getLogger(__name__)

ForwardStepFunc = Callable[[Iterator[Any], torch.nn.Module], tuple[torch.Tensor, Callable]]


# ----------------------------------------------------------------------------- forward step


def token_level_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of masked per-token losses and the number of loss tokens (Megatron's 3-tuple form).

    Never averaged here: Megatron divides the reduced gradients by the global token count.
    """
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def micro_batch_rows(num_tokens: int, config: Any) -> int:
    """Rows of a micro-batch of ``num_tokens`` as the model sees it.

    With sequence parallelism Megatron splits the token dimension of the packed row across the
    TP ranks (embedding output, layernorms, dropout; attention and MLP gather it back), so the
    row must divide by the TP size: it is padded at the end with tokens that carry no loss
    (loss mask 0), attend to nothing and are attended by nothing (``ByteScaleCoreAttention``
    leaves them out of the ring), so they change no gradient.
    """
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if not getattr(config, "sequence_parallel", False) or tp == 1:
        return num_tokens
    return -(-num_tokens // tp) * tp


def hdp_forward_step(data_iterator: Iterator["MicroBatchTensors"], model: torch.nn.Module):
    """Megatron-style ``forward_step_func`` for one HDP micro-batch (a packed row, b = 1).

    Feeds the model the micro-batch's tokens, original-sequence ``position_ids`` (RoPE) and
    next-token labels; no attention mask (the ring attention builds causal masks per sequence).
    With sequence parallelism the row is padded to a multiple of the TP size
    (:func:`micro_batch_rows`). On a pipeline stage after the first the model takes its input
    from the previous stage (``set_input_tensor``) and ignores the tokens; every stage needs
    the positions (RoPE in each layer) and the last one the labels.
    """
    from megatron.core.utils import get_model_config

    micro_batch = next(data_iterator)
    rows = micro_batch_rows(micro_batch.tokens.numel(), get_model_config(model))
    tokens, position_ids, labels, loss_mask = (
        _pad_to(t, rows).reshape(1, -1)
        for t in (micro_batch.tokens, micro_batch.position_ids, micro_batch.labels,
                  micro_batch.loss_mask)
    )
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(token_level_loss, loss_mask)


def _pad_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.numel() == rows else torch.nn.functional.pad(t, (0, rows - t.numel()))


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True, kw_only=True)
class MicroBatchRecord:
    """What one micro-batch cost this rank."""

    order: int
    ring_size: int
    tokens: int
    loss_tokens: int
    p2p_bytes: int
    busy_s: float
    wall_s: float
    offload_ratio: float = 0.0
    """The plan's activation offload ratio for this micro-batch."""


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One training step on this rank.

    ``busy_s`` is the CPU time of the micro-batch phase; ``reduce_wall_s`` the wall time spent
    in the gradient reduction (where a fast rank waits for the slowest); the ``*_at`` fields
    are ``time.time()`` stamps for cross-rank timelines.
    """

    step: int
    hdp_rank: int
    loss_sum: float
    loss_tokens: int
    global_loss_tokens: int
    micro_batches: tuple[MicroBatchRecord, ...]
    busy_s: float
    reduce_wall_s: float
    optimizer_wall_s: float
    started_at: float
    micro_batches_done_at: float
    reduced_at: float
    finished_at: float
    update_successful: bool
    offload: Optional["OffloadStats"] = None
    """Activation offload of the step (bytes offloaded / reloaded, peak resident saved bytes,
    reload waits); None when the step ran without an offloader."""
    hdp: Optional[HDPStepMetrics] = None
    """The step's HDP metrics, the same on every rank (rings, micro-batches per rank, balance,
    slowest / fastest busy time, P2P bytes, plan wait, offloaded micro-batches)."""

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.micro_batches)

    @property
    def p2p_bytes(self) -> int:
        return sum(r.p2p_bytes for r in self.micro_batches)


# ----------------------------------------------------------------------------- driver


def run_hdp_step(
    step: "HDPStep",
    *,
    model: torch.nn.Module,
    optimizer: Any,
    manager: HDPGroupManager,
    forward_step_func: ForwardStepFunc = hdp_forward_step,
    counters: Optional["CommCounters"] = None,
    offloader: Optional["ActivationOffloader"] = None,
) -> StepRecord:
    """Train one planned step on this rank: micro-batches, gradient reduction, optimizer step.

    Args:
        step: this rank's view of the step (from ``HDPDataIterator``).
        model: the Megatron ``DistributedDataParallel``-wrapped model; its config must have
            ``calculate_per_token_loss=True`` and ``finalize_model_grads_func`` set. With
            interleaved pipeline stages, the list of this stage's model chunks (each wrapped;
            :mod:`.pipeline_interleaved`).
        optimizer: a Megatron optimizer (``get_megatron_optimizer``).
        manager: the HDP group manager the core attention reads.
        forward_step_func: Megatron-style ``(data_iterator, model) -> (output, loss_func)``
            whose loss function returns ``(loss_sum, num_tokens, report)``.
        counters: the runtime's ``CommCounters`` to charge ring traffic to (a fresh one by
            default); the step is closed on it (``end_step``) before returning.
        offloader: the model's ``ActivationOffloader`` (``integration.activation_offloader``):
            every micro-batch's forward offloads its planned ``offload_ratio``; its step totals
            land in ``StepRecord.offload``. Without one, planned ratios are not applied.
    """
    from megatron.core.utils import get_model_config

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    config = get_model_config(chunks[0])
    check_model_config(config, manager)
    if counters is None:
        from megatron_bytescale.runtime import CommCounters

        counters = CommCounters()

    if offloader is None:
        _warn_about_offload(step)
    started_at = time.time()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    records, local_tokens, forward_data_store = run_micro_batches(
        step, model=model, config=config, manager=manager,
        forward_step_func=forward_step_func, counters=counters, offloader=offloader,
    )  # fmt: skip
    busy_s = sum(r.busy_s for r in records)
    micro_batches_done_at = time.time()
    counters.end_step()
    check_trained_loss_tokens(step, records, manager)

    total_tokens = local_tokens
    reduce0 = time.perf_counter()
    config.finalize_model_grads_func(chunks, total_tokens)
    reduce_wall_s = time.perf_counter() - reduce0  # on CUDA: until the reduction is queued
    reduced_at = time.time()

    opt0 = time.perf_counter()
    update_successful, _grad_norm, _zeros = optimizer.step()
    optimizer_wall_s = time.perf_counter() - opt0

    # read device values back only now, once, after the optimizer step (D12)
    trained_tokens = int(total_tokens)
    if trained_tokens != step.global_loss_tokens:
        raise RuntimeError(
            f"step {step.index}: the HDP ranks trained {trained_tokens} loss tokens, the "
            f"global batch has {step.global_loss_tokens}; the plan or the micro-batch builder "
            "lost or duplicated tokens"
        )

    offload_stats = offloader.end_step() if offloader is not None else None  # no device read-back
    hdp = HDPStepMetrics.from_tensors(step, gather_step_metrics(
        step, busy_s=busy_s, p2p_bytes=sum(r.p2p_bytes for r in records),
        group=manager.hdp.group, offload=offload_stats))  # fmt: skip
    loss_sum = (
        float(torch.stack([d["lm loss"][0] for d in forward_data_store]).sum())
        if forward_data_store
        else 0.0
    )
    return StepRecord(
        step=step.index,
        hdp_rank=step.hdp_rank,
        loss_sum=loss_sum,
        loss_tokens=sum(r.loss_tokens for r in records),
        global_loss_tokens=step.global_loss_tokens,
        micro_batches=tuple(records),
        busy_s=busy_s,
        reduce_wall_s=reduce_wall_s,
        optimizer_wall_s=optimizer_wall_s,
        started_at=started_at,
        micro_batches_done_at=micro_batches_done_at,
        reduced_at=reduced_at,
        finished_at=time.time(),
        update_successful=bool(update_successful),
        offload=offload_stats,
        hdp=hdp,
    )


def run_micro_batches(
    step: "HDPStep",
    *,
    model: torch.nn.Module,
    config: Any,
    manager: HDPGroupManager,
    forward_step_func: ForwardStepFunc = hdp_forward_step,
    counters: Optional["CommCounters"] = None,
    forward_only: bool = False,
    offloader: Optional["ActivationOffloader"] = None,
) -> tuple[list[MicroBatchRecord], torch.Tensor, list]:
    """This rank's micro-batches of ``step`` in plan order, through megatron-core's step functions.

    Forward (and, unless ``forward_only``, backward) of every micro-batch inside
    :func:`micro_batch_scope` (the micro-batch bound to ``manager`` so the core attention finds
    its ring). Gradient sync is deferred with ``config.no_sync_func`` (when set; without
    overlapped reduction there is nothing to defer) to the last micro-batch; the reduction
    itself is the caller's (``finalize_model_grads``). With pipeline parallelism this stage's
    part runs in 1F1B order instead (:mod:`.pipeline_schedule`). With overlapped reduction the
    bucket groups are issued in one fixed order on every rank, and a rank without micro-batches
    still takes part in every parameter gather (:mod:`.grad_sync`). Nothing here reads a device
    value back to the host (D12).

    With an ``offloader``, each micro-batch's forward runs in its offload context with the
    plan's ratio (:func:`~megatron_bytescale.runtime.offload_micro_batch`).

    Returns one :class:`MicroBatchRecord` per micro-batch, this rank's loss-token count, and
    Megatron's ``forward_data_store`` (the loss reports; with PP, on the last stage only).
    """
    if isinstance(model, (list, tuple)):
        return _run_interleaved(step, model=model, config=config, manager=manager,
                                forward_step_func=forward_step_func, counters=counters,
                                forward_only=forward_only, offloader=offloader)
    slots = check_plan_experts(step, manager)
    if not forward_only:
        install_ordered_grad_sync(model)
        if slots == 0:
            gather_params_without_forward(model)
    if manager.pp_size > 1:
        from .pipeline_schedule import run_pipeline_micro_batches

        return run_pipeline_micro_batches(
            step, model=model, config=config, manager=manager,
            forward_step_func=forward_step_func, counters=counters, forward_only=forward_only,
            offloader=offloader,
        )  # fmt: skip
    check_plan_pipeline(step, 1)
    from .chunk_schedule import refuse_chunks_without_pipeline

    refuse_chunks_without_pipeline(step)
    count = slots
    no_sync = config.no_sync_func or contextlib.nullcontext
    records: list[MicroBatchRecord] = []
    forward_data_store: list = []
    local_tokens = torch.zeros([], dtype=torch.int, device=_grad_device(model))
    for index, (planned, tensors) in enumerate(_slot_micro_batches(step, slots, manager, model)):
        deferred = not forward_only and index < count - 1
        traffic = (counters.start_micro_batch(planned.order)
                   if counters is not None and planned is not None else None)
        clock = busy_clock()
        busy0, wall0 = clock(), time.perf_counter()
        with no_sync() if deferred else contextlib.nullcontext():
            with micro_batch_scope(manager, tensors, counters, phase="forward", offloader=offloader):
                output, num_tokens = megatron_forward_step(
                    forward_step_func,
                    iter([tensors]),
                    model,
                    num_microbatches=count,
                    forward_data_store=forward_data_store,
                    config=config,
                    is_first_microbatch=index == 0,
                    current_microbatch=index,
                )
            if not forward_only:
                with micro_batch_scope(manager, tensors, counters, phase="backward"):
                    megatron_backward_step(output, model, config)
        local_tokens += num_tokens.to(local_tokens.device, non_blocking=True)
        if planned is None:  # an empty slot (expert parallelism): nothing to record
            continue
        records.append(
            MicroBatchRecord(
                order=planned.order,
                ring_size=planned.ring_size,
                tokens=planned.num_tokens,
                loss_tokens=tensors.num_loss_tokens,
                p2p_bytes=int(traffic.bytes_sent) if traffic is not None else 0,
                busy_s=clock() - busy0,
                wall_s=time.perf_counter() - wall0,
                offload_ratio=planned.offload_ratio,
            )
        )
    return records, local_tokens, forward_data_store


def manager_block_words(manager: Any) -> str:
    """``expert groups of B HDP ranks (...)`` for the run's lockstep block
    (:func:`.expert_layout.expert_block_words`), with the sizes where the manager knows them:
    ETP follows from the block, TP and EP (``ETP = B x TP / EP`` when B > 1)."""
    block = getattr(manager, "ep_size", 1)
    tp = getattr(manager, "tp_size", None)
    ep = getattr(manager, "expert_model_parallel_size", None)
    if tp and ep and block > 1 and (block * tp) % ep == 0:
        return expert_block_words(block, tp=tp, etp=block * tp // ep, ep=ep)
    return expert_block_words(block)


def check_plan_experts(step: "HDPStep", manager: HDPGroupManager) -> int:
    """How many slots this rank runs (its micro-batches, then empty ones up to the busiest rank
    of its expert group); refuses a plan made for another expert-parallel size than the run's.
    """
    from megatron_bytescale.planner.plan import expert_slots

    ep = getattr(manager, "ep_size", 1)
    if step.plan.ep_size != ep:
        raise ValueError(
            f"step {step.index}: the plan was made for expert groups of {step.plan.ep_size} HDP "
            f"rank(s), this run's span {ep} (--expert-tensor-parallel-size x "
            "--expert-model-parallel-size / TP); build the planner with "
            f"ep_size={ep} (make_step_planner(..., ep_size=manager.ep_size))"
        )
    return expert_slots(step.plan, step.hdp_rank)


def _slot_micro_batches(step: "HDPStep", slots: int, manager: HDPGroupManager,
                        model: torch.nn.Module) -> Iterator[tuple[Any, "MicroBatchTensors"]]:
    """``(planned micro-batch, tensors)`` for every slot; ``(None, empty)`` past this rank's own
    micro-batches (:func:`~megatron_bytescale.runtime.layout.empty_micro_batch`)."""
    from megatron_bytescale.runtime.layout import empty_micro_batch

    yield from zip(step.micro_batches, step.micro_batch_tensors())
    for _ in range(step.num_micro_batches, slots):
        yield None, empty_micro_batch(manager.hdp, device=_grad_device(model))


def _run_interleaved(step: "HDPStep", *, model: Any, config: Any, manager: HDPGroupManager,
                     forward_step_func: ForwardStepFunc, counters: Optional["CommCounters"],
                     forward_only: bool, offloader: Optional["ActivationOffloader"]):
    """A list of model chunks: interleaved pipeline stages (:mod:`.pipeline_interleaved`)."""
    from .pipeline_interleaved import run_interleaved_micro_batches

    if getattr(manager, "ep_size", 1) > 1:
        raise ValueError(f"{manager_block_words(manager)} do not run with interleaved pipeline "
                         "stages (--virtual-pipeline-model-parallel-size) under HDP: the "
                         "interleaved driver keeps no slot rule across an expert group's HDP "
                         "ranks; train without virtual stages, or with an expert group inside one "
                         "TP group (ETP x EP <= TP, e.g. --expert-model-parallel-size 1)")
    if offloader is not None:
        raise ValueError("activation offload does not run with interleaved pipeline stages "
                         "(--virtual-pipeline-model-parallel-size); turn off --bytescale-offload or "
                         "train without virtual stages")
    for chunk in model:
        if getattr(getattr(chunk, "ddp_config", None), "overlap_grad_reduce", False):
            raise ValueError("--overlap-grad-reduce does not run with interleaved pipeline stages "
                             "(--virtual-pipeline-model-parallel-size) under HDP; drop one of them")
    if len(model) == 1:
        raise ValueError("a list of model chunks needs interleaved pipeline stages (at least 2 chunks "
                         "per stage); pass the single model itself")
    split = sorted({mb.order - mb.chunk[0] for mb in step.micro_batches if mb.chunk is not None})
    if split:
        raise ValueError(f"step {step.index}: the plan splits ring micro-batches (orders {split[:5]}) "
                         "into sequence chunks, which interleaved pipeline stages do not run; plan "
                         "without chunks or train without virtual stages")
    return run_interleaved_micro_batches(step, model=model, config=config, manager=manager,
                                         forward_step_func=forward_step_func, counters=counters,
                                         forward_only=forward_only)


@contextlib.contextmanager
def micro_batch_scope(
    manager: HDPGroupManager,
    micro_batch: "MicroBatchTensors",
    counters: Optional["CommCounters"],
    *,
    phase: Literal["forward", "backward"],
    offloader: Optional["ActivationOffloader"] = None,
) -> Iterator["MicroBatchTensors"]:
    """What wraps the forward, and separately the backward, of one micro-batch in every driver.

    Both drivers (PP = 1 here, 1F1B in :mod:`.pipeline_schedule`, where other micro-batches run
    between a micro-batch's forward and its backward) enter it, so per-micro-batch hooks
    belong here. It binds the micro-batch to the HDP group manager: the core attention reads
    its ring and layout, in the backward too (activation recomputation reruns the forward).
    With an ``offloader`` the forward runs in the micro-batch's offload context (its plan ratio;
    the backward reloads through the hooks packed in forward, wherever it runs).
    """
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase ({phase!r}) must be 'forward' or 'backward'")
    offload = offload_micro_batch(offloader, micro_batch) if phase == "forward" else contextlib.nullcontext()
    with manager.bind(micro_batch, counters), offload:
        yield micro_batch


def check_plan_pipeline(step: "HDPStep", pp_size: int) -> None:
    """Refuse a plan made for another pipeline depth than the run's.

    PP-Balance keeps a ring micro-batch at the same local index in every member pipeline,
    which keeps 1F1B deadlock-free; a plan made for PP = 1 does not (and its estimate has no
    bubbles). A PP plan at PP = 1 would train, but its estimate would describe another run.
    """
    if step.plan.pp_size != pp_size:
        raise ValueError(
            f"step {step.index}: the plan was made for {step.plan.pp_size} pipeline stage(s), "
            f"this run has --pipeline-model-parallel-size {pp_size}; build the planner with "
            f"pp_size={pp_size} (make_step_planner(..., pp_size=...))"
        )
    if step.plan.virtual_pipeline_size != 1:
        raise ValueError(
            f"step {step.index}: the plan is made for {step.plan.virtual_pipeline_size} virtual "
            "pipeline stages, but this run has one model chunk per stage; plan with "
            "virtual_pipeline_size 1, or train with --virtual-pipeline-model-parallel-size "
            f"{step.plan.virtual_pipeline_size} (a list of model chunks)"
        )


_OFFLOAD_WARNED = False


def _warn_about_offload(step: "HDPStep") -> None:
    """A plan asks for activation offload but the step has no offloader (say so once)."""
    global _OFFLOAD_WARNED
    if _OFFLOAD_WARNED:
        return
    offloaded = [mb.order for mb in step.micro_batches if mb.offload_ratio > 0]
    if offloaded:
        _OFFLOAD_WARNED = True
        logger.warning(
            "step %d: micro-batches %s are planned with activation offload, but the step runs "
            "without an offloader, so their activations stay resident; pass "
            "offloader=integration.activation_offloader(model) (or plan with offload=False)",
            step.index,
            offloaded[:5],
        )


def planned_loss_tokens(step: "HDPStep") -> int:
    """Loss tokens this rank's micro-batches carry according to the plan (host arithmetic).

    Every real token has a label except the last of its sequence, wherever it is placed.
    """
    lengths = step.plan.sequence_lengths()
    return sum(
        piece.end - piece.start - (piece.end == lengths[piece.seq])
        for micro_batch in step.micro_batches
        for piece in micro_batch.pieces
    )


def check_trained_loss_tokens(
    step: "HDPStep", records: list[MicroBatchRecord], manager: Optional[HDPGroupManager] = None
) -> None:
    """Raise if the micro-batches built on this rank carry other loss tokens than planned.

    Host integers only (the micro-batch builder counts its loss mask on the host), so the
    check costs no device synchronisation; the plan's own total is checked by
    ``StepPlan.validate``. With pipeline parallelism only the last stage counts loss tokens.
    """
    rank_map = getattr(manager, "rank_map", None)
    if rank_map is not None and not rank_map.is_last_stage:
        return
    trained, planned = sum(r.loss_tokens for r in records), planned_loss_tokens(step)
    if trained != planned:
        raise RuntimeError(
            f"step {step.index}: HDP rank {step.hdp_rank} trained {trained} loss tokens, its "
            f"micro-batches in the plan carry {planned}; the micro-batch builder lost or "
            "duplicated tokens"
        )


def check_model_config(config: Any, manager: Optional[HDPGroupManager] = None) -> None:
    """Refuse model configs with which the HDP step would compute the wrong gradients.

    With ``manager``, the model's pipeline depth must also be the one Megatron runs (a model
    built for other stages would hold the wrong layers and send or wait for the wrong peers).
    """
    if not config.calculate_per_token_loss:
        raise ValueError(
            "HDP needs calculate_per_token_loss=True (--calculate-per-token-loss): ranks train "
            "different numbers of tokens and micro-batches, so the loss must be normalised by "
            "the token count of the whole global batch"
        )
    if config.finalize_model_grads_func is None:
        raise ValueError(
            "config.finalize_model_grads_func is not set; set it to "
            "megatron.core.distributed.finalize_model_grads so gradients are reduced over the "
            "HDP group"
        )
    model_ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    run_ep = (getattr(manager, "expert_model_parallel_size", getattr(manager, "ep_size", 1))
              if manager is not None else model_ep)
    if getattr(config, "num_moe_experts", None) and model_ep != run_ep:
        raise ValueError(
            f"the model is built for expert_model_parallel_size {model_ep}, but Megatron runs "
            f"--expert-model-parallel-size {run_ep}: its experts would be reduced over the wrong "
            "group; build the config after initialize_hdp_model_parallel (make_transformer_config "
            "reads the layout)"
        )
    model_pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if manager is not None and model_pp != manager.pp_size:
        raise ValueError(
            f"the model is built for pipeline_model_parallel_size {model_pp}, but Megatron runs "
            f"{manager.pp_size} pipeline stage(s); build the config after "
            "initialize_hdp_model_parallel (make_transformer_config reads the layout)"
        )


def _grad_device(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")
