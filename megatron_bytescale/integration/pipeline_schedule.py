"""The HDP schedule driver for pipeline parallelism (PP > 1): 1F1B over each pipeline's own list.

Under HDP every pipeline (one HDP rank, all of its stages and TP ranks) runs its own planned
micro-batches: the balance scheduler gives pipelines different counts, zero included, and a
long sequence's ring joins pipelines. Megatron's ``forward_backward_pipelining_without_
interleaving`` runs a fixed count through a data iterator and offers no place to bind each
micro-batch (its ring and layout, the same micro-batch hooks as the PP = 1 driver) around its
forward *and* its backward, which 1F1B separates by other micro-batches. So this module runs
the 1F1B loop itself, on megatron-core's pieces: ``schedules.forward_step`` /
``backward_step`` for the compute (loss on the last stage, ``set_input_tensor`` elsewhere) and
``P2PCommunicator`` for the activations and gradients between stages.

**Order.** A stage runs :func:`megatron_bytescale.planner.order.pipeline_ops`: ``min(PP - 1 -
stage, m)`` warm-up forwards, then one forward / one backward, then the cool-down backwards,
exactly Megatron's 1F1B and exactly what the planner's deadlock check simulates. The
communication after each op pairs as Megatron pairs it: a forward followed by a backward sends
its output and receives the backward's gradient in one batched exchange with the next stage; a
backward followed by a forward sends its input gradient and receives the forward's input in
one exchange with the previous stage; otherwise the send comes first, then the receive.

**Why no deadlock, without any barrier (D5, D11).** Give op F(i) at stage s the number
``2i + s`` and op B(i) the number ``2i + 2 PP - 1 - s``. Along every stage's op list the
number rises, and so it does along every dependency between ranks: the next stage's F(i)
after this stage's F(i), the previous stage's B(i) after this stage's B(i), and the wait of a
blocking send for the receiver (the receiver posts it right before its own op, whose number is
one higher). The planner puts a ring micro-batch at the same local index in every member
pipeline, so the members' ring ops have the same number. Hence every op waits only on ops with
smaller numbers, and the ops with the smallest number not yet run can always run: nothing
waits in a cycle. ``tests/integration/test_pp_training.py`` runs random PP-Balance plans
through this driver to check it.

**Expert parallelism.** The pipelines of an expert group (E consecutive HDP ranks) meet at
every stage in the MoE all-to-alls of every forward and backward. They all run 1F1B over the
same number of micro-batches, the busiest member's (:func:`pipeline_slots`); a pipeline with
fewer runs empty micro-batches after its own (``runtime.layout.empty_micro_batch``: one padding
token, loss mask 0, no attention slot) through all its stages, so every stage of every member
issues the same sequence of ops and slot ``i`` meets slot ``i``. The numbering above covers
the all-to-alls like the rings (all members' F(i) at stage s carry the same number). An empty
slot carries no loss token, adds no router loss and leaves no record; the loss and gradients
are scaled by the global loss-token count as always, so it changes nothing.

**Shapes without a host sync.** Every stage knows every micro-batch's token count from the
plan, so the receive buffers are sized locally (``[rows / TP if SP, 1, hidden]``) and Megatron's
per-message shape exchange (``variable_seq_lengths``) is not used.

**Gradients and loss.** Grad sync is deferred (``no_sync``) until the last backward, as in
Megatron. Only the last stage computes the loss, so only it counts loss tokens; the caller's
``finalize_model_grads`` broadcasts that count from the last stage over the pipeline, all-reduces
it over the HDP group and divides the gradients by it, and all-reduces the tied word-embedding
gradient between the first and last stage.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_bytescale.runtime.layout import empty_micro_batch

from .busy_clock import MicroBatchTiming
from .chunk_schedule import share_chunk_prefixes, stage_ops
from .compat import megatron_backward_step, megatron_forward_step
from .groups import HDPGroupManager
from .schedule import (
    ForwardStepFunc,
    MicroBatchRecord,
    check_plan_pipeline,
    hdp_forward_step,
    micro_batch_rows,
    micro_batch_scope,
)

if TYPE_CHECKING:
    from megatron_bytescale.data.hdp_iterator import HDPStep
    from megatron_bytescale.runtime import ActivationOffloader, CommCounters, MicroBatchTensors

logger = logging.getLogger(__name__)


def run_pipeline_micro_batches(
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
    """This stage's part of this pipeline's micro-batches of ``step``, in 1F1B order.

    Same contract as :func:`.schedule.run_micro_batches` (the PP = 1 driver): returns one
    :class:`MicroBatchRecord` per micro-batch (busy time = this stage's forward + backward),
    the loss-token count (non-zero on the last stage only) and Megatron's
    ``forward_data_store`` (loss reports, last stage only). The gradient reduction is the
    caller's. With an ``offloader`` every forward offloads its plan ratio of this stage's layers
    (several micro-batches are in flight: each keeps its own offload state).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    rank_map = manager.rank_map
    if rank_map is None or rank_map.pp_size == 1:
        raise ValueError("run_pipeline_micro_batches needs a pipeline (PP > 1) HDP group manager")
    check_plan_pipeline(step, rank_map.pp_size)
    pp, stage = rank_map.pp_size, rank_map.pp_rank
    first, last = rank_map.is_first_stage, rank_map.is_last_stage
    count = pipeline_slots(step, manager)
    # 1F1B; the chunks of a split micro-batch run their backwards reversed (chunk_schedule)
    ops = [op for op in stage_ops(step, pp, stage, count)
           if not (forward_only and op[0] == "B")]

    # shapes come from the plan (see the module docstring), so no shape exchange
    comm_config = copy.copy(config)
    comm_config.variable_seq_lengths = False
    p2p = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(),
                          config=comm_config)
    builder = step.micro_batch_tensors()
    tensors: list["MicroBatchTensors"] = []
    prefixes: dict[int, dict] = {}  # kept K/V per split micro-batch, alive across its chunks
    device = next((param.device for param in model.parameters()), torch.device("cpu"))

    def micro_batch(i: int) -> "MicroBatchTensors":
        while len(tensors) <= i:
            if len(tensors) < step.num_micro_batches:
                tensors.append(share_chunk_prefixes(next(builder), prefixes))
            else:  # an empty slot of this pipeline's expert group (see pipeline_slots)
                tensors.append(empty_micro_batch(manager.hdp, device=device))
        return tensors[i]

    def shape(i: int) -> tuple[int, int, int]:
        rows = micro_batch_rows(micro_batch(i).tokens.numel(), config)
        if getattr(config, "sequence_parallel", False):
            rows //= rank_map.tp_size
        return (rows, 1, config.hidden_size)

    records = [MicroBatchTiming() for _ in range(count)]
    traffic: dict[int, Any] = {}
    forward_data_store: list = []
    local_tokens = torch.zeros([], dtype=torch.int, device=device)
    inputs: dict[int, Optional[torch.Tensor]] = {}
    outputs: dict[int, torch.Tensor] = {}
    received: Optional[torch.Tensor] = None  # input of the next forward
    grad_in: Optional[torch.Tensor] = None  # output gradient of the next backward
    no_sync = contextlib.ExitStack()
    if config.no_sync_func is not None and not forward_only:
        no_sync.enter_context(config.no_sync_func())
    backwards = sum(1 for phase, _ in ops if phase == "B")
    with no_sync:
        if ops and ops[0][0] == "F" and not first:
            received = p2p.recv_forward(shape(ops[0][1]), False)
        for k, (phase, i) in enumerate(ops):
            mb = micro_batch(i)
            if phase == "F":
                if counters is not None and i < step.num_micro_batches:  # not an empty slot
                    traffic[i] = counters.start_micro_batch(mb.order)
                with records[i].timed(), micro_batch_scope(  # chunks are not offloaded
                    manager, mb, counters, phase="forward",
                    offloader=offloader if mb.chunk is None else None,
                ):
                    output, num_tokens = megatron_forward_step(
                        forward_step_func, iter([mb]), model, num_microbatches=count,
                        forward_data_store=forward_data_store, config=config,
                        is_first_microbatch=i == 0, current_microbatch=i,
                        input_tensor=received, is_last_stage=last,
                    )  # fmt: skip
                local_tokens += num_tokens.to(local_tokens.device)
                inputs[i], outputs[i] = received, output
                received = None
            else:
                backwards -= 1
                if backwards == 0:
                    no_sync.close()  # the last backward queues the gradient reduction
                with records[i].timed(), micro_batch_scope(manager, mb, counters, phase="backward"):
                    grad_out = megatron_backward_step(
                        outputs.pop(i), model, config, input_tensor=inputs.pop(i),
                        output_tensor_grad=grad_in,
                    )  # fmt: skip
                grad_in = None
            following = ops[k + 1] if k + 1 < len(ops) else None
            if phase == "F":
                received, grad_in = _after_forward(p2p, output, following, shape, first, last)
                deallocate_output_tensor(output, config.deallocate_pipeline_outputs)
            else:
                received, grad_in = _after_backward(p2p, grad_out, following, shape, first, last)

    out = []  # empty slots carry no tokens and leave no record
    for i, planned in enumerate(step.micro_batches):
        if i >= len(tensors):
            break
        out.append(MicroBatchRecord(
            order=planned.order, ring_size=planned.ring_size, tokens=planned.num_tokens,
            loss_tokens=int(tensors[i].num_loss_tokens) if last else 0,
            p2p_bytes=int(traffic[i].bytes_sent) if i in traffic else 0,
            busy_s=records[i].busy_s, wall_s=records[i].wall_s,
        ))  # fmt: skip
    return out, local_tokens, forward_data_store


def pipeline_slots(step: "HDPStep", manager: HDPGroupManager) -> int:
    """How many micro-batches this pipeline runs: its own, then empty ones up to the busiest
    pipeline of its expert group (``planner.plan.expert_slots``; its own count at EP 1).

    With expert parallelism every stage's MoE layers meet the same stage of the other
    pipelines of the expert group in an all-to-all, in every forward and backward. All of
    them run 1F1B over the same number of slots, so every stage issues the same sequence of
    forwards and backwards, and slot ``i`` meets slot ``i``. A split micro-batch (chunks) would
    reorder one pipeline's backwards and not the others', so such plans are refused when an
    expert group spans several HDP ranks (``manager.ep_size`` > 1; inside one TP group the
    ranks of the group run the same chunks in the same order, so they pass).
    """
    from .schedule import check_plan_experts, manager_block_words

    slots = check_plan_experts(step, manager)
    if manager.ep_size > 1:
        split = sorted({mb.order - mb.chunk[0] for mb in step.micro_batches if mb.chunk is not None})
        if split:
            raise ValueError(
                f"step {step.index}: the plan splits ring micro-batches (orders {split[:5]}) into "
                f"chunks, which {manager_block_words(manager)} do not run (the pipelines of an "
                "expert group must run their backwards in the same order); plan without chunks "
                "(no --bytescale-seq-split), or with an expert group inside one TP group "
                "(ETP x EP <= TP)"
            )
    return slots


def _after_forward(p2p, output, following, shape, first: bool, last: bool):
    """Send a forward's output; receive what the next op needs (paired as Megatron pairs it)."""
    if following is not None and following[0] == "B":
        if last:
            return None, None
        return None, p2p.send_forward_recv_backward(output, shape(following[1]), False)
    p2p.send_forward(output, last)
    if following is not None and not first:  # the next op is a forward
        return p2p.recv_forward(shape(following[1]), False), None
    return None, None


def _after_backward(p2p, grad, following, shape, first: bool, last: bool):
    """Send a backward's input gradient; receive what the next op needs."""
    if following is not None and following[0] == "F":
        if first:
            return None, None
        return p2p.send_backward_recv_forward(grad, shape(following[1]), False), None
    p2p.send_backward(grad, first)
    if following is not None and not last:  # the next op is a backward
        return None, p2p.recv_backward(shape(following[1]), False)
    return None, None

