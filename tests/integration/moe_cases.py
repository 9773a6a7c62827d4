"""Per-rank body of the MoE-under-HDP test (4 gloo processes, ONE spawn for every check).

Reference: ONE process running megatron-core's own GPT with its own local MoE spec (router,
dispatcher, ``SequentialMLP``; ``DotProductAttention``; RoPE at positions 0..L-1) on every
document of the global batch ALONE, with ``calculate_per_token_loss=True``: the sum of the
documents' token losses divided by the global loss-token count N, plus megatron-core's own
router losses of each document alone (per-token form: aux(document) x its tokens, z-loss summed
over its tokens), also divided by N (``MoEAuxLossAutoScaler`` scale 1 / N). That is the HDP
definition of docs/moe.md, computed by megatron-core's code, not the plugin's.

HDP: 4 HDP ranks (TP = PP = EP = 1), 4 experts, top-2, on
* a manual plan: rings of 1 and 2 ranks, packs of two documents, micro-batch counts 4 / 3 / 2
  and a rank with no micro-batch at all;
* the balance scheduler's plan of the same documents.
Each rank compares every reduced gradient (experts and router included) with the reference.
After each step with router losses, the values Megatron-LM would log for them (recorded as
the Megatron-LM step does, reduced by megatron-core's own tracker) are compared with what
megatron-core logs for each document alone, averaged over the documents by their tokens.
Two negative controls run the manual plan with a deliberate bug (megatron-core's own
per-micro-batch router losses; a ring's expert counts not summed) to show the checks see it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .hdp_cases import (
    CAPACITY,
    CONTEXT,
    VOCAB,
    bytescale_config,
    cost_model,
    grab_grads_before_step,
    relative_error,
)

MOE_LENGTHS = [40, 120, 30, 50, 20, 60, 90, 25]
AUX_COEFF = 0.05
Z_COEFF = 0.01
EXPERTS = 4
TOPK = 2


def moe_config(*, aux: float, z: float | None, dispatcher: str = "alltoall",
               num_query_groups: int = 2, num_layers: int = 2, **overrides: Any):
    """The tiny GPT of ``hdp_cases`` with 4 experts, top-2 in every layer (``overrides``: more
    ``TransformerConfig`` fields, e.g. ``sequence_parallel``). ``num_query_groups`` 4 (one per
    head) lets TP 4 split them; the default 2 keeps grouped-query attention. ``num_layers`` 4
    gives interleaved stages at PP 2 one layer per model chunk."""
    from megatron_bytescale.integration.training import make_transformer_config

    return make_transformer_config(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4,
        num_query_groups=num_query_groups, ffn_hidden_size=64, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=48, moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=aux, moe_z_loss_coeff=z, add_bias_linear=False, **overrides,
    )  # fmt: skip


LOG_NAMES = ["load_balancing_loss", "z_loss"]


def moe_reference(config, state, sequences) -> tuple[float, dict[str, torch.Tensor]]:
    """megatron-core alone: every document on its own, per-token loss and router losses."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    model = reference_model(config, state)
    loss_tokens = sum(len(s) - 1 for s in sequences)
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / loss_tokens))  # as schedules do
    total = torch.zeros([])
    for seq in sequences:
        tokens, labels = tokens_and_labels(seq)
        losses = model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels)
        total = total + losses[0, :-1].sum()
    loss = total / loss_tokens
    loss.backward()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def moe_reference_log(config, state, sequences) -> dict[str, float]:
    """What megatron-core logs for the router losses of each document alone (read from its MoE
    log tracker after each document's forward), averaged over the documents weighted by their
    tokens and over the layers: the HDP definition of the logged values (docs/moe.md)."""
    from megatron_bytescale.integration.compat import clear_moe_log_tracker, moe_log_tracker_values

    model = reference_model(config, state)
    logged = {name: torch.zeros(config.num_layers, dtype=torch.float64) for name in LOG_NAMES}
    for seq in sequences:
        tokens, labels = tokens_and_labels(seq)
        clear_moe_log_tracker()
        model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels)
        for name in LOG_NAMES:
            values = moe_log_tracker_values(name)
            if values is not None:
                logged[name] += values.detach().double() * len(seq)
    clear_moe_log_tracker()
    tokens = sum(len(s) for s in sequences)
    return {name: float(v.sum()) / tokens / config.num_layers for name, v in logged.items()}


def reference_model(config, state):
    """megatron-core's own GPT with its own local MoE spec, holding ``state``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS),
                     vocab_size=VOCAB, max_sequence_length=CONTEXT, position_embedding_type="rope")
    model.load_state_dict(state)
    return model


def tokens_and_labels(seq) -> tuple[torch.Tensor, torch.Tensor]:
    """One document as a batch of one, with its next-token labels (the last one unused)."""
    tokens = torch.as_tensor(seq, dtype=torch.long)[None]
    labels = torch.zeros_like(tokens)
    labels[0, :-1] = tokens[0, 1:]
    return tokens, labels


def manual_plan():
    """Rings of 1 and 2, a pack of two documents, counts 4 / 3 / 2 / 0 (rank 3 idle)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=4, capacity=CAPACITY, lengths=dict(enumerate(MOE_LENGTHS)))
    builder.add([0], [0])
    builder.add([1, 2], [1])
    builder.add([0], [2, 4])
    builder.add([1], [3])
    builder.add([0], [5])
    builder.add([1, 2], [6])
    builder.add([0], [7])
    return builder.build(scheduler="manual")


def moe_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.integration.training import (
        build_gpt_model,
        seed_model_parallel,
        wrap_for_hdp,
    )
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    manager = initialize_hdp_model_parallel()
    seed_model_parallel(1234)
    rng = np.random.default_rng(19)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in MOE_LENGTHS]
    configs = {"aux 0": dict(aux=0.0, z=None), "aux": dict(aux=AUX_COEFF, z=Z_COEFF)}
    state = build_gpt_model(moe_config(**configs["aux 0"]), vocab_size=VOCAB,
                            max_sequence_length=CONTEXT).state_dict()
    references: list[Any] = [None]
    if rank == 0:
        references[0] = {name: moe_reference(moe_config(**c), state, sequences)
                         for name, c in configs.items()}
        references[0]["log"] = moe_reference_log(moe_config(**configs["aux"]), state, sequences)
    dist.broadcast_object_list(references, src=0)
    references = references[0]
    reference_log = references.pop("log")
    out: dict[str, Any] = {"rank": rank, "hdp_size": manager.size,
                           "reference_loss": {k: v[0] for k, v in references.items()},
                           "reference_log": reference_log}
    if rank == 0:  # the aux loss must change the router's gradient, or the test proves nothing
        router = [n for n in references["aux"][1] if "router" in n]
        out["aux_effect"] = max(relative_error(references["aux"][1][n], references["aux 0"][1][n])
                                for n in router)
    balance = make_step_planner(bytescale_config(scheduler="balance"), hdp_size=manager.size,
                                cost_model=cost_model())
    runs = {
        "manual alltoall aux 0": ("aux 0", "alltoall", lambda _: manual_plan()),
        "manual allgather aux": ("aux", "allgather", lambda _: manual_plan()),
        "balance alltoall aux": ("aux", "alltoall", balance),
    }
    # negative controls (the checks must catch them): megatron-core's own router losses over
    # each micro-batch instead of per document, and a ring member's counts left unsummed
    from megatron_bytescale.integration import moe
    from megatron_bytescale.integration.compat import clear_moe_log_tracker, report_moe_log

    controls = {
        "control: megatron's per-micro-batch aux": ("install_hdp_router_losses", lambda m: 0),
        "control: ring counts not summed": ("ring_sum", lambda t, ring, hdp: t),
    }
    out["runs"] = {}
    for name, (case, dispatcher, planner) in [
        *runs.items(), *((c, ("aux", "alltoall", lambda _: manual_plan())) for c in controls)
    ]:
        saved = None
        if name in controls:
            attribute, replacement = controls[name]
            saved = (attribute, getattr(moe, attribute))
            setattr(moe, attribute, replacement)
        try:
            config = moe_config(**configs[case], dispatcher=dispatcher)
            model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT)
            model.load_state_dict(state)
            ddp, optimizer = wrap_for_hdp(model, lr=1e-3)
            step = next(HDPDataIterator([sequences], planner=planner, hdp=manager.hdp))
            grads = grab_grads_before_step(ddp, optimizer)
            clear_moe_log_tracker()
            record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
            # what Megatron-LM's log line would show: the step's values through megatron-core's
            # own reduction (as hdp_forward_backward records them, with one micro-batch nominal)
            log = {}
            if name in runs and case == "aux":
                moe.record_router_loss_logs(ddp, scale=1.0 / step.total_tokens)
                log = report_moe_log(LOG_NAMES, num_layers=config.num_layers)
        finally:
            if saved is not None:
                setattr(moe, *saved)
        ref = references[case][1]
        out["runs"][name] = {
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "micro_batch_counts": step.plan.micro_batch_counts(),
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "names_match": set(grads) == set(ref),
            "log": log,
            "grad_errors": {n: relative_error(grads[n], ref[n]) for n in ref if n in grads},
        }
    parallel_state.destroy_model_parallel()
    return out
