"""Per-rank body of the interleaved-stage test: PP 2 x VPP 2 x HDP 2 on 4 gloo processes.

As in ``parallel_cases`` (whose helpers it reuses): Megatron first runs at TP = PP = 1 so rank 0
computes the single-process reference (megatron's own local GPT, every sequence alone, token
losses summed and divided by the global loss-token count) from one set of initial weights; then
Megatron is re-initialised with PP 2 x 2 virtual stages, each rank builds its two model chunks
(4 layers: chunk c of stage s holds layer 2c + s), loads the same weights, runs one HDP step
through the interleaved driver, and compares every chunk's reduced gradients (``main_grad``
right before the optimizer step) with the reference's.

Before each training step, the same step is evaluated as Megatron-LM's ``evaluate()`` does:
``hdp_forward_backward(forward_only=True)`` under ``torch.no_grad()``. Its loss reports are
mapped to the plan's micro-batches (the last stage's last chunk reports them in the program's
order) and compared, summed over ring members, with each micro-batch's sequences' loss sums of
the reference's forward; every gradient buffer is checked untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .hdp_cases import VOCAB, CONTEXT, cost_model, reference_loss_and_grads
from .parallel_cases import CAPACITY, gradient_errors, load_reference_weights, switch_layout, two_rank_config

LAYERS = 4


def model_config():
    from megatron_bytescale.integration.training import make_transformer_config

    # Megatron-LM's default: stage outputs are freed after their send, backward_step asserts it
    return make_transformer_config(num_layers=LAYERS, hidden_size=32, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=64, deallocate_pipeline_outputs=True)


def references(batches) -> list[dict[str, Any]]:
    """Initial weights (tied embeddings) and rank 0's reference loss and gradients per batch."""
    from megatron.core import parallel_state

    from megatron_bytescale.integration.training import build_gpt_model, seed_model_parallel

    parallel_state.initialize_model_parallel()
    seed_model_parallel(1234)
    config = model_config()
    state = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT,
                            share_embeddings_and_output_weights=True).state_dict()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload[0] = []
        for sequences in batches:
            loss, grads = reference_loss_and_grads(config, state, sequences,
                                                   share_embeddings_and_output_weights=True)
            payload[0].append({"state": state, "loss": loss, "grads": grads,
                               "seq_losses": reference_sequence_losses(config, state, sequences)})
    dist.broadcast_object_list(payload, src=0)
    parallel_state.destroy_model_parallel()
    return payload[0]


def reference_sequence_losses(config, state, sequences) -> list[float]:
    """Each sequence's token-loss sum from the single-process reference model, forward only."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=CONTEXT, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True)
    model.load_state_dict(state)
    sums = []
    with torch.no_grad():
        for seq in sequences:
            tokens = torch.as_tensor(seq, dtype=torch.long)[None]
            labels = torch.zeros_like(tokens)
            labels[0, :-1] = tokens[0, 1:]
            losses = model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels)
            sums.append(float(losses[0, :-1].sum()))
    return sums


def evaluate_step(step, ddps, manager) -> dict[str, Any]:
    """One forward-only pass of ``step`` the way Megatron-LM's ``evaluate()`` runs it: its loss
    sums per plan micro-batch (``order``), whether any gradient buffer changed, the report count."""
    from megatron_bytescale.integration.megatron_lm_step import hdp_forward_backward
    from megatron_bytescale.integration.schedule import hdp_forward_step
    from megatron_bytescale.planner.interleaved_program import stage_program

    params = [p for ddp in ddps for p in ddp.module.parameters()]
    before = [(p.main_grad.detach().clone(), p.grad) for p in params]
    with torch.no_grad():
        store = hdp_forward_backward(forward_step_func=hdp_forward_step, data_iterator=[iter([step]), None],
                                     model=ddps, num_microbatches=1, forward_only=True)
    touched = [i for i, (p, (g, grad)) in enumerate(zip(params, before))
               if not torch.equal(p.main_grad, g) or p.grad is not grad]
    rank_map = manager.rank_map
    losses: dict[int, float] = {}
    if rank_map.is_last_stage and step.num_micro_batches:
        program = stage_program(step.plan.micro_batch_counts(), rank_map.pp_size, len(ddps),
                                rank_map.pp_rank)[step.hdp_rank]
        last_chunk = [op.index for op in program if op.phase == "F" and op.chunk == len(ddps) - 1]
        for index, report in zip(last_chunk, store, strict=True):
            losses[step.micro_batches[index].order] = float(report["lm loss"][0])
    return {"losses": losses, "touched": touched, "reports": len(store),
            "seqs": {mb.order: list(mb.seqs) for mb in step.micro_batches}}


def vpp_plan(lengths: list[int], rows: list[list[tuple[str, int]]]):
    """A PP 2 x VPP 2 plan over 2 HDP ranks from per-pipeline rows of ``("ring" | "local", seq)``
    (row j of both pipelines before row j + 1; a ring sits at the same index in both rows)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=2, capacity=CAPACITY, lengths=dict(enumerate(lengths)))
    for j in range(max(len(r) for r in rows)):
        for rank, row in enumerate(rows):
            if j < len(row):
                kind, seq = row[j]
                if kind == "local":
                    builder.add([rank], [seq])
                elif rank == 0:
                    builder.add([0, 1], [seq])
    plan = builder.build(scheduler="manual", pp_size=2, layers_per_stage=LAYERS // 2)
    return dataclasses.replace(plan, virtual_pipeline_size=2).validate()


def vpp_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    rng = np.random.default_rng(21)
    # run 1: a ring across both pipelines at index 0 and 1, then 5 against 1 local sequences:
    # counts 7 and 3 (neither a multiple of PP), the rings ordered by the template on both
    ring_lengths = [150, 120, 40, 31, 20, 13, 60, 45]
    rows_rings = [[("ring", 0), ("ring", 1), ("local", 2), ("local", 3), ("local", 4), ("local", 5),
                   ("local", 6)], [("ring", 0), ("ring", 1), ("local", 7)]]
    # run 2: pipeline 1 runs no micro-batch at all
    idle_lengths = [40, 30, 61, 25, 77]
    rows_idle = [[("local", i) for i in range(5)], []]
    # run 3: the balance scheduler with virtual stages (its own counts and rings)
    balance_lengths = [int(x) for x in np.clip(rng.lognormal(3.6, 0.9, 11), 2, 2 * CAPACITY)]
    batches = [[rng.integers(0, VOCAB, n).tolist() for n in lens]
               for lens in (ring_lengths, idle_lengths, balance_lengths)]
    refs = references(batches)

    manager = switch_layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = model_config()
    balance = make_step_planner(two_rank_config(), hdp_size=2, cost_model=cost_model().with_(num_layers=LAYERS),
                                pp_size=2, vpp_size=2)
    plans = {"rings": lambda _l: vpp_plan(ring_lengths, rows_rings),
             "idle pipeline": lambda _l: vpp_plan(idle_lengths, rows_idle),
             "balance": balance}
    out: dict[str, Any] = {"rank": rank, "stage": manager.rank_map.pp_rank, "hdp": manager.rank_map.hdp_rank,
                           "runs": {}}
    for (name, planner), sequences, ref in zip(plans.items(), batches, refs):
        chunks = []
        for c in range(2):
            chunk = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT, vp_stage=c,
                                    share_embeddings_and_output_weights=True)
            load_reference_weights(chunk, ref["state"])
            chunks.append(chunk)
        ddps, optimizer = wrap_for_hdp(chunks, lr=1e-3)
        grads: list[dict[str, torch.Tensor]] = [{} for _ in ddps]
        opt_step = optimizer.step

        def capture(grads=grads, ddps=ddps, optimizer=optimizer, opt_step=opt_step):
            for g, ddp in zip(grads, ddps):
                for pname, param in ddp.module.named_parameters():
                    g[pname] = param.main_grad.detach().clone()
            optimizer.step = opt_step
            return opt_step()

        optimizer.step = capture
        step = next(HDPDataIterator([sequences], planner=planner, hdp=manager.hdp))
        evaluation = evaluate_step(step, ddps, manager)  # with the reference's weights, as trained next
        record = run_hdp_step(step, model=ddps, optimizer=optimizer, manager=manager)
        errors = {}
        for c, (ddp, g) in enumerate(zip(ddps, grads)):
            errors.update({f"chunk{c}.{k}": v for k, v in gradient_errors(ddp.module, g, ref).items()})
        out["runs"][name] = {
            "counts": step.plan.micro_batch_counts(),
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "vpp": step.plan.virtual_pipeline_size,
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "reference_loss": ref["loss"],
            "reference_seq_losses": ref["seq_losses"],
            "eval": evaluation,
            "grad_errors": errors,
            "layers": [[int(layer.layer_number) for layer in d.module.decoder.layers] for d in ddps],
        }
    return out
