"""MoE with interleaved stages: TP 2 x PP 2 x VPP 2 x ETP 1 x EP 2 in the MoE TP / PP spawn.

Run by ``moe_parallel_cases.moe_parallel_rank_body`` in the same 4 processes (HDP 1). At each
stage the expert group is that stage's TP pair (lockstep block ``ETP x EP / TP`` = 1), whose
ranks always run the same micro-batches in the same order, so the interleaved driver needs no
slot rule for it (with a block over several HDP ranks it is refused). Four MoE layers, one per
model chunk (chunk c of stage s holds layer 2c + s); the reference is megatron-core's own MoE of
the same 4-layer model at TP = PP = EP = 1, every document alone, router losses on
(``references["vpp aux"]``, computed in the spawn's reference phase). The plan is the TP x PP
manual plan (six micro-batches, two packs) with two virtual stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

VPP_LAYERS = 4
VPP_RUN = "tpp vpp2 etp1 ep2 manual aux"


def vpp_tp_pp_plan(lengths: list[int]):
    """``moe_parallel_cases.tp_pp_plan`` with two virtual stages per stage (one layer each)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    from .moe_parallel_cases import TPP_CAPACITY, TPP_ROW

    builder = PlanBuilder(hdp_size=1, capacity=TPP_CAPACITY, lengths=dict(enumerate(lengths)))
    for seqs in TPP_ROW:
        builder.add([0], list(seqs))
    plan = builder.build(scheduler="manual", pp_size=2, layers_per_stage=VPP_LAYERS // 2)
    return dataclasses.replace(plan, virtual_pipeline_size=2).validate()


def run_vpp_layout(out: dict[str, Any], references, sequences, lengths: list[int],
                   record_run: Callable, cases: dict[str, dict]) -> None:
    """The interleaved run into ``out["runs"][VPP_RUN]`` (``record_run``: the spawn's own),
    with every chunk's gradient errors, the chunks' layers and the expert sizes."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp

    from .hdp_cases import CONTEXT, VOCAB
    from .moe_cases import moe_config
    from .parallel_cases import gradient_errors, load_reference_weights, switch_layout

    reference = references["vpp aux"]
    manager = switch_layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                            expert_tensor_parallel_size=1)
    chunks = []
    for c in range(2):
        config = moe_config(**cases["aux"], num_layers=VPP_LAYERS, sequence_parallel=True)
        chunk = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT, vp_stage=c)
        load_reference_weights(chunk, reference["state"])
        chunks.append(chunk)
    ddps, optimizer = wrap_for_hdp(chunks, lr=1e-3)
    grads: list[dict[str, torch.Tensor]] = [{} for _ in ddps]
    opt_step = optimizer.step

    def capture():  # every chunk's reduced gradients, right before the optimizer's step
        for g, ddp in zip(grads, ddps):
            for name, param in ddp.module.named_parameters():
                g[name] = param.main_grad.detach().clone()
        optimizer.step = opt_step
        return opt_step()

    optimizer.step = capture
    manual = vpp_tp_pp_plan(lengths)
    step = next(HDPDataIterator([sequences], planner=lambda _: manual, hdp=manager.hdp))
    record = run_hdp_step(step, model=ddps, optimizer=optimizer, manager=manager)
    errors = {}
    for c, (ddp, g) in enumerate(zip(ddps, grads)):
        errors.update({f"chunk{c}.{k}": v
                       for k, v in gradient_errors(ddp.module, g, reference).items()})
    record_run(VPP_RUN, step, record, errors, manager, config)
    out["runs"][VPP_RUN].update(
        ep_size=manager.ep_size, plan_ep_size=step.plan.ep_size,
        vpp=step.plan.virtual_pipeline_size,
        expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
        expert_model_parallel_size=manager.expert_model_parallel_size,
        expert_group=[int(r) for r in manager.rank_map.tp_ep_global_ranks],
        layers=[[int(layer.layer_number) for layer in d.module.decoder.layers] for d in ddps])
