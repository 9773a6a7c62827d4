"""Per-rank bodies of the TP / PP tests under HDP (4 gloo processes = 2 x 2).

Each test module runs ONE spawn. Inside it, Megatron is first initialised with TP = PP = 1 so
that rank 0 can compute the reference: ONE process running megatron's own local GPT (TP 1,
``DotProductAttention``, RoPE at positions 0..L-1) on every sequence of the global batch alone,
summing token losses and dividing by the global number of loss tokens (``hdp_cases``). Then
Megatron is re-initialised with the layout under test, the same weights are cut into this
rank's TP shard and pipeline stage, one HDP step runs, and each rank compares its reduced
gradients (``main_grad`` right before the optimizer step) with the matching slice of the
reference: relative error = max|HDP - reference| / max|reference| per parameter, fp32.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .hdp_cases import (
    CONTEXT,
    VOCAB,
    bytescale_config,
    cost_model,
    grab_grads_before_step,
    reference_loss_and_grads,
    relative_error,
    transformer_config,
)

# on 2 HDP ranks: lengths above the capacity get rings of 2; the rest are packed on one rank
CAPACITY = 80
TP_LENGTHS = [150, 100, 40, 31, 20, 13, 60, 45, 90, 25, 71, 33]


def two_rank_config(**changes: Any):
    """The HDP config of these tests: capacity 80, context 160 (= 2 ranks' capacity)."""
    return bytescale_config(capacity=CAPACITY, context_length=2 * CAPACITY, **changes)


def reference_phase(*batches, share_embeddings: bool = False) -> list[dict[str, Any]]:
    """Megatron at TP = PP = 1: initial weights (same on every rank) and rank 0's reference.

    Returns one ``{"state", "loss", "grads"}`` per batch of sequences on every rank
    (broadcast from rank 0), all from the same initial weights.
    """
    from megatron.core import parallel_state

    from megatron_bytescale.integration.training import build_gpt_model, seed_model_parallel

    parallel_state.initialize_model_parallel()
    seed_model_parallel(1234)
    config = transformer_config()
    model_kwargs = dict(share_embeddings_and_output_weights=share_embeddings)
    state = build_gpt_model(
        config, vocab_size=VOCAB, max_sequence_length=CONTEXT, **model_kwargs
    ).state_dict()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload[0] = []
        for sequences in batches:
            loss, grads = reference_loss_and_grads(config, state, sequences, **model_kwargs)
            payload[0].append({"state": state, "loss": loss, "grads": grads})
    dist.broadcast_object_list(payload, src=0)
    parallel_state.destroy_model_parallel()
    return payload[0]


def switch_layout(**layout: Any):
    """Re-initialise Megatron (and the HDP group manager) with another TP / PP layout."""
    from megatron.core import parallel_state

    from megatron_bytescale.integration.groups import (
        initialize_hdp_model_parallel,
        set_hdp_manager,
    )
    from megatron_bytescale.integration.training import seed_model_parallel

    set_hdp_manager(None)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    manager = initialize_hdp_model_parallel(**layout)
    seed_model_parallel(1234)
    return manager


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def reference_name(model, name: str, full: dict[str, torch.Tensor]) -> str:
    """The TP-1 / PP-1 name of parameter ``name`` of this stage's model.

    Layers are numbered per stage; the LM head of a last stage with tied embeddings is the
    reference's word embedding.
    """
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    match = _LAYER.match(name)
    if match:
        name = f"decoder.layers.{int(match.group(1)) + offset}." + name[match.end():]
    if name not in full and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return global_expert_name(model, name)


_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def global_expert_name(model, name: str) -> str:
    """With expert parallelism, local expert i of expert rank r is global expert
    ``r x (experts per rank) + i`` (megatron-core's numbering); other names are unchanged."""
    from megatron.core import parallel_state

    match = _LOCAL_EXPERT.search(name)
    ep = parallel_state.get_expert_model_parallel_world_size() if match else 1
    if ep == 1:
        return name
    per_rank = model.config.num_moe_experts // ep
    index = parallel_state.get_expert_model_parallel_rank() * per_rank + int(match.group(1))
    return f"{name[:match.start()]}.local_experts.{index}.{name[match.end():]}"


def shard(param: torch.nn.Parameter, full: torch.Tensor, *, expert: bool = False) -> torch.Tensor:
    """This TP rank's slice of a full (TP 1) tensor, as Megatron splits ``param`` (an expert's
    weights: over the expert tensor-parallel group, whose size may differ from TP)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    if expert:
        tp, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    else:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=param.partition_dim)[rank]


def load_reference_weights(model, state: dict[str, torch.Tensor]) -> None:
    """Copy the TP-1 / PP-1 weights into this rank's shard of this stage's model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = shard(param, state[reference_name(model, name, state)],
                          expert=".mlp.experts." in name)
            if value.shape != param.shape:
                raise AssertionError(f"{name}: reference slice {tuple(value.shape)} vs "
                                     f"{tuple(param.shape)}")
            param.copy_(value)


def gradient_errors(model, grads: dict[str, torch.Tensor], reference) -> dict[str, float]:
    """Relative error of every reduced gradient against the matching reference slice."""
    out = {}
    for name, param in model.named_parameters():
        ref = shard(param, reference["grads"][reference_name(model, name, reference["grads"])],
                    expert=".mlp.experts." in name)
        out[name] = relative_error(grads[name], ref)
    return out


def fresh_model(config, reference, *, share_embeddings: bool = False, **wrap: Any):
    """This rank's shard / stage of a model with the reference weights, in DDP + optimizer
    (``wrap``: more arguments of ``wrap_for_hdp``)."""
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp

    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT,
                            share_embeddings_and_output_weights=share_embeddings)
    load_reference_weights(model, reference["state"])
    return wrap_for_hdp(model, lr=1e-3, **wrap)


def hdp_step(config, reference, sequences, *, scheduler: str, manager, planner=None,
             wrap: dict[str, Any] | None = None, inspect=None, offload=None):
    """One HDP step of a fresh model with the reference weights; its record and errors.

    ``planner`` defaults to ``scheduler`` on 2 HDP ranks for the run's pipeline depth;
    ``wrap`` goes to ``wrap_for_hdp``; ``inspect(ddp)`` is called after the step;
    ``offload`` (options of ``integration.activation_offloader``) runs it with an offloader.
    """
    from megatron_bytescale.integration.offload import activation_offloader
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step

    ddp, optimizer = fresh_model(config, reference, share_embeddings=manager.pp_size > 1,
                                 **(wrap or {}))
    if planner is None:
        planner = make_step_planner(two_rank_config(scheduler=scheduler), hdp_size=manager.size,
                                    cost_model=cost_model(), pp_size=manager.pp_size)
    step = next(HDPDataIterator([sequences], planner=planner, hdp=manager.hdp))
    grads = grab_grads_before_step(ddp, optimizer)
    offloader = activation_offloader(ddp, **offload) if offload is not None else None
    record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager, offloader=offloader)
    if inspect is not None:
        inspect(ddp)
    return step, record, gradient_errors(ddp.module, grads, reference)


def layout_config(**overrides: Any):
    """``hdp_cases``' tiny GPT config for the TP / PP layout Megatron now runs."""
    from megatron_bytescale.integration.training import make_transformer_config

    base = transformer_config()
    return make_transformer_config(
        num_layers=base.num_layers, hidden_size=base.hidden_size,
        num_attention_heads=base.num_attention_heads, num_query_groups=base.num_query_groups,
        ffn_hidden_size=base.ffn_hidden_size, **overrides,
    )  # fmt: skip


# ----------------------------------------------------------------------------- TP 2 x HDP 2


def tp_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    """TP 2 x HDP 2: gradients equal the TP-1 reference with and without sequence parallelism."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator, PlanMismatchError
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    rng = np.random.default_rng(11)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in TP_LENGTHS]
    (reference,) = reference_phase(sequences)
    out: dict[str, Any] = {"rank": rank, "reference_loss": reference["loss"]}

    manager = switch_layout(tensor_model_parallel_size=2)
    rank_map = manager.rank_map
    out["map"] = dict(hdp=rank_map.hdp_rank, tp=rank_map.tp_rank, pp=rank_map.pp_rank,
                      hdp_ranks=rank_map.hdp_global_ranks, tp_ranks=rank_map.tp_global_ranks)
    out["runs"] = {}
    for name, sequence_parallel, scheduler in (
        ("tp", False, "balance"),
        ("tp+sp", True, "balance"),
        ("tp+sp static", True, "static"),
    ):
        config = layout_config(sequence_parallel=sequence_parallel)
        step, record, errors = hdp_step(config, reference, sequences, scheduler=scheduler,
                                        manager=manager)
        out["runs"][name] = {
            "tp_size": config.tensor_model_parallel_size,
            "sequence_parallel": config.sequence_parallel,
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "micro_batch_counts": step.plan.micro_batch_counts(),
            "odd_micro_batches": sum(mb.num_tokens % 2 for mb in step.micro_batches),
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "plan_hash": step.plan_hash,
            "grad_errors": errors,
        }

    # every rank checks the plan hash across the world: a TP rank that plans differently from
    # its replica partner (a different HDP group) is caught on every rank
    skewed = make_step_planner(
        two_rank_config(align=2 if rank_map.tp_rank == 1 else 1),
        hdp_size=manager.size, cost_model=cost_model(),
    )  # fmt: skip
    try:
        next(HDPDataIterator([sequences], planner=skewed, hdp=manager.hdp))
        out["mismatch"] = None
    except PlanMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


# ----------------------------------------------------------------------------- PP 2 x HDP 2

STRESS_PLANS = 30


def with_offload_ratio(plan, ratio: float):
    """``plan`` with every micro-batch offloading ``ratio`` of its activations."""
    import dataclasses

    ranks = tuple(dataclasses.replace(rp, micro_batches=tuple(
        dataclasses.replace(mb, offload_ratio=ratio) for mb in rp.micro_batches)) for rp in plan.ranks)
    return dataclasses.replace(plan, ranks=ranks).validate()


def pipeline_plan(lengths: list[int], rows: list[list[tuple[str, int]]]):
    """A PP-2 plan over 2 HDP ranks from per-pipeline rows of ``("ring" | "local", seq)``.

    Row j of both pipelines is added before row j + 1, so orders increase along every list
    and a ring (named in both rows at the same index) gets one order (D5).
    """
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
    return builder.build(scheduler="manual", pp_size=2, layers_per_stage=1).validate()


def random_pipeline_plan(rng: np.random.Generator):
    """Random counts (zero included) per pipeline, rings at the same index in both."""
    counts = [int(c) for c in rng.integers(0, 5, size=2)]
    rows: list[list[tuple[str, int]]] = [[], []]
    lengths: list[int] = []
    for j in range(max(counts)):
        if j < min(counts) and rng.random() < 0.4:
            lengths.append(int(rng.integers(CAPACITY + 1, 2 * CAPACITY + 1)))
            for row in rows:
                row.append(("ring", len(lengths) - 1))
            continue
        for rank in range(2):
            if j < counts[rank]:
                lengths.append(int(rng.integers(2, CAPACITY + 1)))
                rows[rank].append(("local", len(lengths) - 1))
    if not lengths:
        lengths.append(int(rng.integers(2, CAPACITY + 1)))
        rows[0].append(("local", 0))
    return lengths, pipeline_plan(lengths, rows)


def stress_batches(seed: int, *, hdp_size: int = 2, pp_size: int = 2, count: int = STRESS_PLANS):
    """``count`` (tokens, planner) pairs: PP-Balance plans of random long-tailed batches
    and, every third, a random aligned plan with random counts per pipeline (zero included).
    For another layout than HDP 2 x PP 2 every plan is the balance scheduler's."""
    from megatron_bytescale.integration.planning import make_step_planner

    rng = np.random.default_rng(seed)
    balance = make_step_planner(two_rank_config(), hdp_size=hdp_size, cost_model=cost_model(),
                                pp_size=pp_size)  # fmt: skip
    random_plans = (hdp_size, pp_size) == (2, 2)
    for index in range(count):
        if random_plans and index % 3 == 2:
            lengths, plan = random_pipeline_plan(rng)
            planner = lambda _lengths, plan=plan: plan  # noqa: E731 - one fixed plan
        else:
            count = int(rng.integers(3, 10))
            lengths = [int(x) for x in np.clip(rng.lognormal(3.5, 0.9, count), 2, 2 * CAPACITY)]
            planner = balance
        yield [rng.integers(0, VOCAB, n).tolist() for n in lengths], planner


def pp_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    """PP 2 x HDP 2: gradients equal TP-1 / PP-1 (tied embeddings), a pipeline without
    micro-batches, the plan's pp_size checked, and random plans that must not deadlock."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    rng = np.random.default_rng(12)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in TP_LENGTHS]
    idle_lengths = [40, 30, 61, 25, 77]
    idle_sequences = [rng.integers(0, VOCAB, n).tolist() for n in idle_lengths]
    reference, idle_reference = reference_phase(sequences, idle_sequences, share_embeddings=True)
    out: dict[str, Any] = {"rank": rank, "reference_loss": reference["loss"],
                           "idle_reference_loss": idle_reference["loss"]}

    manager = switch_layout(pipeline_model_parallel_size=2)
    rank_map = manager.rank_map
    out["map"] = dict(hdp=rank_map.hdp_rank, tp=rank_map.tp_rank, pp=rank_map.pp_rank,
                      hdp_ranks=rank_map.hdp_global_ranks, pp_ranks=rank_map.pp_global_ranks)
    config = layout_config()
    out["runs"] = {}

    def run(name: str, batch, ref, **kwargs) -> None:
        sync: dict[str, int] = {}

        def inspect(ddp) -> None:  # with overlap: bucket groups of this stage, and how many ran
            gate = getattr(ddp, "_bytescale_ordered_grad_sync", None)
            if gate is not None:
                sync.update(bucket_groups=len(gate.groups), issued=gate.issued)

        step, record, errors = hdp_step(config, ref, batch, manager=manager, inspect=inspect,
                                        **kwargs)
        out["runs"][name] = {
            "grad_sync": sync,
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "micro_batch_counts": step.plan.micro_batch_counts(),
            "pp_size": step.plan.pp_size,
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "grad_errors": errors,
            "offloaded_bytes": record.offload.offloaded_bytes if record.offload else 0,
        }

    # 1. PP-Balance: rings across both pipelines, different counts, lengths vary
    run("balance", sequences, reference, scheduler="balance")
    # 1b. the same with activation offload: 1F1B keeps several forwards in flight, each with its
    # own offload state (one layer per stage here, so no layer is kept resident)
    balance = make_step_planner(two_rank_config(scheduler="balance"), hdp_size=2,
                                cost_model=cost_model(), pp_size=2)
    run("balance offload", sequences, reference, scheduler="balance",
        planner=lambda lengths: with_offload_ratio(balance(lengths), 0.5),
        offload={"keep_resident_layers": 0, "min_tensor_bytes": 0})
    # 2. pipeline 1 runs no micro-batch at all
    rows = [[("local", i) for i in range(len(idle_lengths))], []]
    idle_plan = pipeline_plan(idle_lengths, rows)
    run("idle pipeline", idle_sequences, idle_reference, scheduler="manual",
        planner=lambda _: idle_plan)
    # 1-2 with overlapped gradient reduction (--overlap-grad-reduce): small buckets give each
    # stage several bucket groups, issued in one order by both pipelines, the idle one included
    overlap = dict(overlap_grad_reduce=True, bucket_size=2000)
    run("balance overlap", sequences, reference, scheduler="balance", wrap=overlap)
    run("idle pipeline overlap", idle_sequences, idle_reference, scheduler="manual",
        planner=lambda _: idle_plan, wrap=overlap)
    # 3. a plan made for PP = 1 is refused before anything runs
    flat = make_step_planner(two_rank_config(), hdp_size=2, cost_model=cost_model(), pp_size=1)
    ddp, optimizer = fresh_model(config, reference, share_embeddings=True)
    try:
        step = next(HDPDataIterator([sequences], planner=flat, hdp=manager.hdp))
        run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        out["pp_mismatch"] = None
    except ValueError as exc:
        out["pp_mismatch"] = str(exc)

    # 4. stress: random plans, one model training on through all of them
    stress = []
    for tokens, planner in stress_batches(seed=5):
        step = next(HDPDataIterator([tokens], planner=planner, hdp=manager.hdp))
        record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        stress.append({
            "counts": step.plan.micro_batch_counts(),
            "rings": sum(1 for r in step.plan.ring_sizes() if r > 1),
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "scheduler": step.plan.scheduler,
        })  # fmt: skip
    out["stress"] = stress

    # 5. TP 2 x PP 2 (HDP 1) with sequence parallelism: stage-to-stage shapes are [s / TP, 1, h]
    manager = switch_layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    one_rank = make_step_planner(
        bytescale_config(capacity=2 * CAPACITY, context_length=2 * CAPACITY), hdp_size=1,
        cost_model=cost_model(), pp_size=2,
    )  # fmt: skip
    step, record, errors = hdp_step(layout_config(sequence_parallel=True), reference, sequences,
                                    scheduler="balance", manager=manager, planner=one_rank)
    out["tp_pp"] = {"loss_sum": record.loss_sum, "global_loss_tokens": record.global_loss_tokens,
                    "micro_batch_counts": step.plan.micro_batch_counts(), "grad_errors": errors,
                    "stage": manager.rank_map.pp_rank}
    return out
