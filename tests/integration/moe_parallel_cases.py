"""Per-rank body of the MoE-under-TP / PP test (4 gloo processes, ONE spawn for all layouts).

Reference: as in ``moe_cases`` (megatron-core's own local MoE GPT at TP = PP = 1 on every
document alone, per-token loss, megatron-core's router losses of each document alone), computed
once by rank 0 with Megatron initialised at TP = PP = 1. Then, in the same processes, Megatron
is re-initialised (``parallel_cases.switch_layout``) with

* TP 2 x HDP 2 with sequence parallelism (the experts split over the TP ranks, as Megatron does
  by default): a TP rank routes only its half of every micro-batch row, so the per-expert counts
  of a document must be summed over the TP ranks as well as over the ring;
* PP 2 x HDP 2 (one MoE layer per stage): the router losses of a stage's layer are attached in
  that stage's forward and reach the router in its backward, with 1F1B keeping several
  micro-batches in flight;
* TP 2 x PP 2 (HDP 1, sequence parallelism): both at once, each stage's TP pair summing its
  counts over its own TP group; one HDP rank, so no rings: :func:`tp_pp_plan`'s packs and
  documents alone, and the balance scheduler's plan.

Each rank compares every reduced gradient (router and experts included) of its TP shard /
pipeline stage with the matching slice of the reference. Negative controls run the TP and the
TP x PP layouts with the TP ranks' counts left unsummed. Then the same processes run TP 2 x EP 2
and PP 2 x EP 2 (``moe_epp_cases``), expert-tensor parallelism other than TP, with PP too
(``moe_etp_cases``), TP 4 (``moe_tp4_cases``) and interleaved stages (``moe_vpp_cases``); the
last two need models of their own (one query group per head; 4 layers), whose references the
reference phase computes as well.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

from .hdp_cases import (
    CONTEXT,
    VOCAB,
    bytescale_config,
    cost_model,
    grab_grads_before_step,
)
from .moe_cases import LOG_NAMES, MOE_LENGTHS, moe_config, moe_reference, moe_reference_log
from .moe_tp4_cases import TP4_QUERY_GROUPS
from .moe_vpp_cases import VPP_LAYERS
from .parallel_cases import (
    fresh_model,
    gradient_errors,
    pipeline_plan,
    switch_layout,
    two_rank_config,
)

CASES = {"aux 0": dict(aux=0.0, z=None), "aux": dict(aux=0.05, z=0.01)}

# PP 2 x HDP 2: pipeline 0 runs 6 micro-batches, pipeline 1 four; documents 1 and 6 (120 and
# 90 tokens > capacity 80) are rings of both pipelines, the rest run alone
PP_ROWS = [
    [("local", 0), ("ring", 1), ("local", 2), ("ring", 6), ("local", 4), ("local", 5)],
    [("local", 3), ("ring", 1), ("local", 7), ("ring", 6)],
]


# TP 2 x PP 2 leaves one HDP rank, so no rings: its capacity holds the longest document (120)
# and its six micro-batches are documents alone and packs of two
TPP_CAPACITY = 128
TPP_ROW = [(1,), (2, 4), (0, 3), (5,), (6,), (7,)]


def tp_pp_plan(lengths: list[int]):
    """The PP-2 plan of ``TPP_ROW`` on the one HDP rank that TP 2 x PP 2 leaves of 4 ranks."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=1, capacity=TPP_CAPACITY, lengths=dict(enumerate(lengths)))
    for seqs in TPP_ROW:
        builder.add([0], list(seqs))
    return builder.build(scheduler="manual", pp_size=2, layers_per_stage=1).validate()


def _reference_phase(sequences) -> dict[str, dict[str, Any]]:
    """Megatron at TP = PP = 1: initial MoE weights and rank 0's reference of each case."""
    from megatron.core import parallel_state

    from megatron_bytescale.integration.compat import forget_moe_log_tracker
    from megatron_bytescale.integration.training import build_gpt_model, seed_model_parallel

    parallel_state.initialize_model_parallel()
    seed_model_parallel(1234)
    state = build_gpt_model(moe_config(**CASES["aux 0"]), vocab_size=VOCAB,
                            max_sequence_length=CONTEXT).state_dict()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload[0] = {}
        for name, case in CASES.items():
            loss, grads = moe_reference(moe_config(**case), state, sequences)
            payload[0][name] = {"state": state, "loss": loss, "grads": grads}
        payload[0]["aux"]["log"] = moe_reference_log(moe_config(**CASES["aux"]), state, sequences)
    # TP 4 splits the query groups too: the same model with one group per head (its own weights)
    tp4_config = moe_config(**CASES["aux"], num_query_groups=TP4_QUERY_GROUPS)
    tp4_state = build_gpt_model(tp4_config, vocab_size=VOCAB,
                                max_sequence_length=CONTEXT).state_dict()
    # interleaved stages at PP 2: the same model with 4 layers, one per model chunk
    # (megatron-core's log tracker is sized by the first model that logs: forgotten around it)
    vpp_config = moe_config(**CASES["aux"], num_layers=VPP_LAYERS)
    vpp_state = build_gpt_model(vpp_config, vocab_size=VOCAB,
                                max_sequence_length=CONTEXT).state_dict()
    if dist.get_rank() == 0:
        for name, config, weights in (("tp4 aux", tp4_config, tp4_state),
                                      ("vpp aux", vpp_config, vpp_state)):
            forget_moe_log_tracker()
            loss, grads = moe_reference(config, weights, sequences)
            payload[0][name] = {"state": weights, "loss": loss, "grads": grads}
    forget_moe_log_tracker()
    dist.broadcast_object_list(payload, src=0)
    parallel_state.destroy_model_parallel()
    return payload[0]


def _step(config, reference, sequences, planner, manager, *, keep: dict | None = None
          ) -> tuple[Any, Any, dict[str, float]]:
    """One HDP step of a fresh model with the reference weights: (step, record, gradient
    errors); ``keep["model"]`` receives the DDP model when ``keep`` is given."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step

    ddp, optimizer = fresh_model(config, reference)
    if keep is not None:
        keep["model"] = ddp
    step = next(HDPDataIterator([sequences], planner=planner, hdp=manager.hdp))
    grads = grab_grads_before_step(ddp, optimizer)
    record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
    return step, record, gradient_errors(ddp.module, grads, reference)


def logged_router_losses(model, step, config, *, hdp_group_only: bool = False
                         ) -> dict[str, float]:
    """What Megatron-LM's log line shows for the step's router losses (recorded as the
    Megatron-LM step does, one micro-batch nominal, through megatron-core's own reduction).
    ``hdp_group_only``: reduce over the HDP group instead of TP x HDP (a negative control)."""
    from megatron.core import parallel_state

    from megatron_bytescale.integration import moe
    from megatron_bytescale.integration.compat import report_moe_log

    saved = parallel_state.get_tensor_and_data_parallel_group
    if hdp_group_only:
        parallel_state.get_tensor_and_data_parallel_group = (
            lambda *a, **k: parallel_state.get_data_parallel_group())
    try:
        moe.record_router_loss_logs(model, scale=1.0 / step.total_tokens)
    finally:
        parallel_state.get_tensor_and_data_parallel_group = saved
    return report_moe_log(LOG_NAMES, num_layers=config.num_layers)


def moe_parallel_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron_bytescale.integration import moe
    from megatron_bytescale.integration.compat import clear_moe_log_tracker
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    rng = np.random.default_rng(19)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in MOE_LENGTHS]
    references = _reference_phase(sequences)
    out: dict[str, Any] = {"rank": rank,
                           "reference_loss": {k: v["loss"] for k, v in references.items()},
                           "reference_log": references["aux"]["log"], "runs": {}}

    def record_run(name, step, record, errors, manager, config) -> None:
        out["runs"][name] = {
            "tp": manager.rank_map.tp_rank, "pp": manager.rank_map.pp_rank,
            "tp_size": config.tensor_model_parallel_size,
            "pp_size": config.pipeline_model_parallel_size,
            "sequence_parallel": config.sequence_parallel,
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "micro_batch_counts": step.plan.micro_batch_counts(),
            "packs": sum(len(mb.seqs) > 1 for mb in step.plan.ranks[0].micro_batches),
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "grad_errors": errors,
        }

    # TP 2 x HDP 2, sequence parallelism (Megatron requires it for MoE with TP)
    manager = switch_layout(tensor_model_parallel_size=2)
    balance = make_step_planner(two_rank_config(scheduler="balance"), hdp_size=manager.size,
                                cost_model=cost_model())
    tp_runs = [("tp alltoall aux 0", "aux 0", "alltoall"), ("tp alltoall aux", "aux", "alltoall"),
               ("tp allgather aux", "aux", "allgather"),
               ("control: TP counts not summed", "aux", "alltoall")]
    kept: dict[str, Any] = {}
    for name, case, dispatcher in tp_runs:
        config = moe_config(**CASES[case], dispatcher=dispatcher, sequence_parallel=True)
        saved = moe.tp_sum
        if name.startswith("control"):
            moe.tp_sum = lambda tensor, group: tensor
        try:
            clear_moe_log_tracker()
            step, record, errors = _step(config, references[case], sequences, balance, manager,
                                         keep=kept)
        finally:
            moe.tp_sum = saved
        record_run(name, step, record, errors, manager, config)
        if case == "aux" and not name.startswith("control"):
            # Megatron-LM's logged router losses; the all-gather run logs as a negative control
            # through the HDP group alone (each TP rank's rows' share left unsummed)
            out["runs"][name]["log"] = logged_router_losses(
                kept["model"], step, config, hdp_group_only=dispatcher == "allgather")

    # PP 2 x HDP 2: the balance scheduler's plan and a manual one with uneven counts and a ring
    manager = switch_layout(pipeline_model_parallel_size=2)
    pp_balance = make_step_planner(two_rank_config(scheduler="balance"), hdp_size=manager.size,
                                   cost_model=cost_model(), pp_size=2)
    manual = pipeline_plan(MOE_LENGTHS, PP_ROWS)
    for name, case, planner in (("pp balance aux", "aux", pp_balance),
                                ("pp manual aux 0", "aux 0", lambda _: manual),
                                ("pp manual aux", "aux", lambda _: manual)):
        config = moe_config(**CASES[case])
        step, record, errors = _step(config, references[case], sequences, planner, manager)
        record_run(name, step, record, errors, manager, config)

    # TP 2 x PP 2 (HDP 1), sequence parallelism: one pipeline of two TP pairs runs every
    # micro-batch of the manual plan (packs included), and the balance scheduler's own plan
    manager = switch_layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tpp_balance = make_step_planner(
        bytescale_config(capacity=TPP_CAPACITY, context_length=TPP_CAPACITY, scheduler="balance"),
        hdp_size=manager.size, cost_model=cost_model(), pp_size=2)
    tpp_manual = tp_pp_plan(MOE_LENGTHS)
    for name, case, planner in (("tpp manual aux 0", "aux 0", lambda _: tpp_manual),
                                ("tpp manual aux", "aux", lambda _: tpp_manual),
                                ("tpp balance aux", "aux", tpp_balance),
                                ("control: TP x PP counts not summed", "aux",
                                 lambda _: tpp_manual)):
        config = moe_config(**CASES[case], sequence_parallel=True)
        saved = moe.tp_sum
        if name.startswith("control"):
            moe.tp_sum = lambda tensor, group: tensor
        try:
            step, record, errors = _step(config, references[case], sequences, planner, manager)
        finally:
            moe.tp_sum = saved
        record_run(name, step, record, errors, manager, config)

    # TP 2 x EP 2 and PP 2 x EP 2 (and a PP x EP stress) in the same processes
    from .moe_epp_cases import run_ep_layouts

    run_ep_layouts(out, references, sequences, MOE_LENGTHS, record_run, _step, CASES)

    # expert-tensor parallelism other than TP (TP 2 x ETP 1 x EP 2 / 4, TP 1 x ETP 2 x EP 2)
    from .moe_etp_cases import run_etp_layouts

    run_etp_layouts(out, references, sequences, MOE_LENGTHS, record_run, _step, CASES)

    # TP 4 (HDP 1): TP 4 x EP 1, TP 4 x ETP 1 x EP 4, TP 4 x ETP 2 x EP 2
    from .moe_tp4_cases import run_tp4_layouts

    run_tp4_layouts(out, references, sequences, MOE_LENGTHS, record_run, _step, CASES)

    # TP 2 x PP 2 x VPP 2 x ETP 1 x EP 2 (HDP 1): interleaved stages, each stage's TP pair its
    # expert group
    from .moe_vpp_cases import run_vpp_layout

    run_vpp_layout(out, references, sequences, MOE_LENGTHS, record_run, CASES)

    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return out
