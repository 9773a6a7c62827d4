"""The HDP schedule driver for interleaved (virtual) pipeline stages: PP > 1 with ``v`` model
chunks per stage (``--virtual-pipeline-model-parallel-size``).

Each stage holds ``v`` model chunks; chunk ``c`` of stage ``s`` is virtual stage ``c p + s``,
so a micro-batch goes round the ``p`` stages ``v`` times and 1F1B's fill and drain cross
``p - 1`` chunk ops of ``1 / v`` of a stage instead of whole-stage ops (docs/pipeline.md).
Megatron's ``forward_backward_pipelining_with_interleaving`` is not used for the reason the
plain driver (:mod:`.pipeline_schedule`) gives, and one more: its op table depends on the
pipeline's micro-batch count, so two pipelines of different lengths that share rings would
order them differently and deadlock. This driver runs the program of
:mod:`megatron_bytescale.planner.interleaved_program` instead: the interleaved schedule of the
longest list (rounded up to a multiple of ``p``), restricted to this pipeline's own indices,
with the same megatron-core pieces as the plain driver (``forward_step`` / ``backward_step``
per chunk, ``P2PCommunicator`` between stages).

**Messages and deadlock.** An op's input (forward) or output gradient (backward) is received
right before the op; its own message is sent right after and not waited for until the end of
the step (``P2PCommunicator`` with ``overlap_p2p_comm``, un-batched). So a stage waits only for
messages and ring rendezvous, which follow the template's acyclic dependency graph, and
between two ranks messages match first-in first-out in the order the program gives; both are
checked on random HDP lists with rings by ``tests/planner/test_interleaved_program.py``
(where the 1F1B driver's pairing, a send waiting with the next receive, deadlocks PP 2 x VPP 2
at four micro-batches). Megatron's ranks are taken modulo the pipeline group, so chunk ``c``
of the last stage feeds chunk ``c + 1`` of stage 0 through the same "next" rank.

**Rings, loss and gradients.** Every chunk's forward and backward of a micro-batch bind its
ring (:func:`.schedule.micro_batch_scope`), as in the plain driver; ring members hold the ring
at the same local index, so they reach its ops in the same order. The loss is computed only by
chunk ``v - 1`` of the last stage, the embedding only by chunk 0 of stage 0 (Megatron builds the
chunks with ``pre_process`` / ``post_process`` per virtual stage). Gradient sync is deferred on
every chunk (``no_sync``) until the pipeline's last backward; the caller's
``finalize_model_grads`` gets all chunks.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from megatron_bytescale.planner.interleaved_program import stage_program

from .busy_clock import MicroBatchTiming
from .compat import megatron_backward_step, megatron_forward_step
from .groups import HDPGroupManager
from .schedule import ForwardStepFunc, MicroBatchRecord, hdp_forward_step, micro_batch_rows, micro_batch_scope

if TYPE_CHECKING:
    from megatron_bytescale.data.hdp_iterator import HDPStep
    from megatron_bytescale.runtime import CommCounters, MicroBatchTensors


def run_interleaved_micro_batches(
    step: "HDPStep",
    *,
    model: Sequence[torch.nn.Module],
    config: Any,
    manager: HDPGroupManager,
    forward_step_func: ForwardStepFunc = hdp_forward_step,
    counters: Optional["CommCounters"] = None,
    forward_only: bool = False,
) -> tuple[list[MicroBatchRecord], torch.Tensor, list]:
    """This stage's part of this pipeline's micro-batches of ``step`` over its ``len(model)``
    model chunks, in the interleaved template's order (module docstring).

    Same contract as :func:`.pipeline_schedule.run_pipeline_micro_batches`: one
    :class:`MicroBatchRecord` per micro-batch (busy time = all of this stage's chunk ops of
    it), the loss-token count (non-zero on the last stage only) and Megatron's
    ``forward_data_store``. The gradient reduction is the caller's.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    rank_map = manager.rank_map
    chunks = list(model)
    vpp = len(chunks)
    if rank_map is None or rank_map.pp_size == 1 or vpp < 2:
        raise ValueError("run_interleaved_micro_batches needs a pipeline (PP > 1) and at least 2 model chunks")
    check_plan_interleaved(step, rank_map.pp_size, vpp)
    pp, stage = rank_map.pp_size, rank_map.pp_rank
    last = rank_map.is_last_stage
    count = step.num_micro_batches
    program = stage_program(step.plan.micro_batch_counts(), pp, vpp, stage)[step.hdp_rank]
    if forward_only:
        program = [op for op in program if op.phase == "F"]

    # shapes come from the plan; sends are left in flight (un-batched, overlap) until the end
    comm_config = copy.copy(config)
    comm_config.variable_seq_lengths = False
    comm_config.batch_p2p_comm = False
    p2p = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=comm_config)
    builder = step.micro_batch_tensors()
    tensors: list["MicroBatchTensors"] = []

    def micro_batch(i: int) -> "MicroBatchTensors":
        while len(tensors) <= i:
            tensors.append(next(builder))
        return tensors[i]

    def shape(i: int) -> tuple[int, int, int]:
        rows = micro_batch_rows(micro_batch(i).tokens.numel(), config)
        if getattr(config, "sequence_parallel", False):
            rows //= rank_map.tp_size
        return (rows, 1, config.hidden_size)

    records = [MicroBatchTiming() for _ in range(count)]
    traffic: dict[int, Any] = {}
    forward_data_store: list = []
    device = next((p.device for p in chunks[0].parameters()), torch.device("cpu"))
    local_tokens = torch.zeros([], dtype=torch.int, device=device)
    inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    in_flight: list[tuple[Any, Optional[torch.Tensor]]] = []  # (send handles, output to free after)
    sent: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # forward sends not yet seen done
    no_sync = contextlib.ExitStack()
    if not forward_only:
        for chunk in chunks:
            no_sync.enter_context(chunk.no_sync())
    backwards = sum(1 for op in program if op.phase == "B")
    with no_sync:
        for op in program:
            i, c = op.index, op.chunk
            mb = micro_batch(i)
            _free_sent(in_flight, config)  # finished gradient sends
            if op.phase == "F":
                received = p2p.recv_forward(shape(i), False) if op.receive else None
                if counters is not None and i not in traffic:
                    traffic[i] = counters.start_micro_batch(mb.order)
                with records[i].timed(), micro_batch_scope(manager, mb, counters, phase="forward"):
                    output, num_tokens = megatron_forward_step(
                        forward_step_func, iter([mb]), chunks[c], num_microbatches=count,
                        forward_data_store=forward_data_store, config=config,
                        is_first_microbatch=i == 0, current_microbatch=i,
                        input_tensor=received, is_last_stage=last and c == vpp - 1,
                    )  # fmt: skip
                local_tokens += num_tokens.to(local_tokens.device)
                if not forward_only:  # evaluation keeps nothing for a backward
                    inputs[(i, c)], outputs[(i, c)] = received, output
                if op.send:
                    _, handles = p2p.send_forward_recv_forward(output, False, None, overlap_p2p_comm=True)
                    if forward_only:  # freed as soon as its send is done
                        in_flight.append((handles, output))
                    else:
                        sent[(i, c)] = (handles, output)
                elif forward_only:
                    deallocate_output_tensor(output, config.deallocate_pipeline_outputs)
            else:
                grad_in = p2p.recv_backward(shape(i), False) if op.receive else None
                if (i, c) in sent:
                    # its output went to the op whose backward sent grad_in, so the send is done;
                    # Megatron's backward wants the output freed (deallocate_pipeline_outputs)
                    _free_sent([sent.pop((i, c))], config, wait=True)
                backwards -= 1
                if backwards == 0:
                    no_sync.close()  # the last backward queues the gradient reduction
                with records[i].timed(), micro_batch_scope(manager, mb, counters, phase="backward"):
                    grad_out = megatron_backward_step(
                        outputs.pop((i, c)), chunks[c], config, input_tensor=inputs.pop((i, c)),
                        output_tensor_grad=grad_in,
                    )  # fmt: skip
                if op.send:
                    _, handles = p2p.send_backward_recv_backward(grad_out, False, None, overlap_p2p_comm=True)
                    in_flight.append((handles, None))
        in_flight.extend(sent.values())
        _free_sent(in_flight, config, wait=True)

    out = []
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


def _free_sent(in_flight: list, config: Any, *, wait: bool = False) -> None:
    """Drop finished sends (all of them with ``wait``); a forward's output is deallocated
    (Megatron's ``deallocate_output_tensor``) only once its send is done."""
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    keep = []
    for handles, output in in_flight:
        works = list(handles.values()) if isinstance(handles, dict) else list(handles or [])
        if wait:
            for work in works:
                work.wait()
        elif not all(work.is_completed() for work in works):
            keep.append((handles, output))
            continue
        if output is not None:
            deallocate_output_tensor(output, config.deallocate_pipeline_outputs)
    in_flight[:] = keep


def check_plan_interleaved(step: "HDPStep", pp_size: int, vpp: int) -> None:
    """Refuse a plan made for another pipeline depth or another number of virtual stages."""
    if step.plan.pp_size != pp_size or step.plan.virtual_pipeline_size != vpp:
        raise ValueError(
            f"step {step.index}: the plan was made for {step.plan.pp_size} pipeline stage(s) x "
            f"{step.plan.virtual_pipeline_size} virtual stage(s); this run has "
            f"--pipeline-model-parallel-size {pp_size} and {vpp} model chunks per stage "
            f"(--virtual-pipeline-model-parallel-size); build the planner with pp_size={pp_size}, "
            f"vpp_size={vpp} (make_step_planner)"
        )

