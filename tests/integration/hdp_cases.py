"""Per-rank bodies of the HDP training tests (module level so that spawned processes import them).

One 4-process gloo spawn runs every check: megatron-core's start-up dominates on 2 cores.

Correctness metric: relative error = max|HDP - reference| / max|reference| per parameter
gradient (and for the loss), where the reference is ONE process running megatron's own local
GPT (``DotProductAttention``, RoPE at positions 0..L-1) on every sequence of the global batch
separately with full causal attention, summing token losses and dividing by the global number
of loss tokens. fp32 throughout.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

CAPACITY = 64
CONTEXT = 256
GRAD_LENGTHS = [150, 100, 40, 30, 20, 12, 60, 45, 90, 25, 70, 33]
VOCAB = 256
TRAIN_STEPS = 20
RESUME_AT = 5  # the own-loop resume test saves after this many training steps
SLEEP_S = 0.6


def cost_model():
    from megatron_bytescale.planner.cost_model import CostModel

    return CostModel(
        num_layers=2,
        alpha1=2e-8,
        beta1=2e-5,
        gamma=1e-4,
        alpha2=1000.0,
        d2h_bandwidth=1e10,
        h2d_bandwidth=1e10,
        kv_bytes_per_token=64.0,
        p2p_bandwidth_intra=5e8,
        p2p_bandwidth_inter=5e8,
        ranks_per_node=4,
    )


def bytescale_config(**changes: Any):
    from megatron_bytescale.integration.config import ByteScaleConfig

    values = dict(hdp=True, capacity=CAPACITY, context_length=CONTEXT, offload=False)
    values.update(changes)
    return ByteScaleConfig(**values)


def transformer_config():
    from megatron_bytescale.integration.training import make_transformer_config

    return make_transformer_config(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
    )


def fresh_model(config, initial_state):
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp

    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT)
    model.load_state_dict(initial_state)
    return wrap_for_hdp(model, lr=1e-3)


def grab_grads_before_step(ddp, optimizer) -> dict[str, torch.Tensor]:
    """Capture the reduced, token-scaled gradients right before the optimizer uses them."""
    grads: dict[str, torch.Tensor] = {}
    step = optimizer.step

    def capturing_step():
        for name, param in ddp.module.named_parameters():
            grads[name] = param.main_grad.detach().clone()
        optimizer.step = step
        return step()

    optimizer.step = capturing_step
    return grads


def reference_loss_and_grads(
    config, initial_state, sequences, **model_kwargs: Any
) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, megatron's own local GPT, every sequence alone with full causal attention."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=CONTEXT,
        position_embedding_type="rope",
        **model_kwargs,
    )
    model.load_state_dict(initial_state)
    total = torch.zeros([])
    loss_tokens = sum(len(s) - 1 for s in sequences)
    for seq in sequences:
        tokens = torch.as_tensor(seq, dtype=torch.long)[None]
        labels = torch.zeros_like(tokens)
        labels[0, :-1] = tokens[0, 1:]
        positions = torch.arange(tokens.shape[1])[None]
        losses = model(tokens, positions, None, labels=labels)
        total = total + losses[0, :-1].sum()
    loss = total / loss_tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def slow_rank0_forward_step(data_iterator, model):
    """``hdp_forward_step`` that sleeps on global rank 0: a deliberately slow rank."""
    from megatron_bytescale.integration.schedule import hdp_forward_step

    if dist.get_rank() == 0:
        time.sleep(SLEEP_S)
    return hdp_forward_step(data_iterator, model)


def _entry_point_refusals() -> dict[str, str]:
    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel

    out = {}
    for name, kwargs in {
        "cp": dict(context_parallel_size=2),
        "hybrid": dict(hybrid_context_parallel=True),
        "vpp": dict(virtual_pipeline_model_parallel_size=2),  # needs PP > 1
    }.items():
        try:
            initialize_hdp_model_parallel(**kwargs)
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _attention_refusals(config, manager) -> dict[str, str]:
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bytescale.integration.core_attention import ByteScaleCoreAttention

    out = {}
    try:
        ByteScaleCoreAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.1)
    except ValueError as exc:
        out["dropout"] = str(exc)
    try:
        ByteScaleCoreAttention(config, 1, AttnMaskType.padding, "self")
    except ValueError as exc:
        out["mask"] = str(exc)
    attention = ByteScaleCoreAttention(config, 1, AttnMaskType.causal, "self")
    q = torch.zeros(8, 1, 4, 8)
    kv = torch.zeros(8, 1, 2, 8)
    try:
        attention(q, kv, kv, None, packed_seq_params=object())
    except ValueError as exc:
        out["packed"] = str(exc)
    try:
        attention(q, kv, kv, None)
    except RuntimeError as exc:
        out["unbound"] = str(exc)
    return out


def hdp_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    """Everything the integration tests check, on one rank of a 4-process gloo group."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_bytescale.data.corpus import stdlib_documents
    from megatron_bytescale.data.global_batches import global_batches
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator, PlanMismatchError
    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.planner.plan import PlanBuilder
    from megatron_bytescale.planner.topology import Topology
    from megatron_bytescale.runtime import CommCounters
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    out: dict[str, Any] = {"rank": rank}
    enable_cpu_megatron()
    enable_cpu_megatron()  # idempotent
    out["refusals"] = _entry_point_refusals()
    assert not parallel_state.model_parallel_is_initialized()
    manager = initialize_hdp_model_parallel()
    out["hdp_size"] = manager.size
    out["megatron_cp"] = parallel_state.get_context_parallel_world_size()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = transformer_config()
    from megatron_bytescale.integration.training import build_gpt_model

    initial_state = build_gpt_model(
        config, vocab_size=VOCAB, max_sequence_length=CONTEXT
    ).state_dict()
    cm = cost_model()

    # -- 1. gradient equivalence: balance, naive, static vs one process -----------------------
    rng = np.random.default_rng(7)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in GRAD_LENGTHS]
    if rank == 0:
        out["reference"] = reference_loss_and_grads(config, initial_state, sequences)
    out["grad"] = {}
    for scheduler in ("balance", "naive", "static", "balance-two-level"):
        ddp, optimizer = fresh_model(config, initial_state)
        # "balance-two-level": the 4 ranks as 2 nodes of 2, long rings two-level
        two_level = Topology(ranks_per_node=2) if scheduler == "balance-two-level" else None
        manager.two_level_topology = two_level
        planner = make_step_planner(
            bytescale_config(scheduler=scheduler.split("-")[0], two_level_ring=two_level is not None),
            hdp_size=manager.size, cost_model=cm, topology=two_level,
        )
        step = next(HDPDataIterator([sequences], planner=planner, hdp=manager.hdp))
        grads = grab_grads_before_step(ddp, optimizer)
        if scheduler == "balance":
            out["grad_scale_func"] = ddp.config.grad_scale_func == optimizer.scale_loss
        counters = CommCounters()
        record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager, counters=counters)
        info = {
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "micro_batch_counts": step.plan.micro_batch_counts(),
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "p2p_bytes": record.p2p_bytes,
            "busy_s": record.busy_s,
            "plan_wait_s": step.plan_wait_s,
            "hdp": dataclasses.asdict(record.hdp),
            "two_level_rings": 0 if two_level is None else sum(
                two_level.two_level_group(r) > 1 for r in {mb.ring for mb in step.plan.ranks[rank].micro_batches}),
            "bytes_by_level": (counters.steps[-1].total.intra_node_bytes_sent,
                               counters.steps[-1].total.inter_node_bytes_sent),
        }
        manager.two_level_topology = None
        if rank == 0:  # compare here: tensors do not survive the trip back through the queue
            _, ref_grads = out["reference"]
            info["grad_names_match"] = set(grads) == set(ref_grads)
            info["grad_errors"] = {n: relative_error(grads[n], ref_grads[n]) for n in ref_grads}
        out["grad"][scheduler] = info

    if rank == 0:
        out["reference"] = out["reference"][0]

    # -- 2. training: HDP balance vs static, 20 steps on real text ---------------------------
    batches = list(
        global_batches(
            stdlib_documents(seed=3),
            tokens_per_batch=4 * CAPACITY * 3,
            context_length=CONTEXT,
            max_batches=TRAIN_STEPS,
        )
    )
    out["train"] = {}
    for scheduler in ("balance", "static"):
        ddp, optimizer = fresh_model(config, initial_state)
        planner = make_step_planner(
            bytescale_config(scheduler=scheduler), hdp_size=manager.size, cost_model=cm
        )
        iterator = HDPDataIterator(batches, planner=planner, hdp=manager.hdp)
        losses, counts, hashes, checkpoint = [], [], [], None
        for step in iterator:
            record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
            losses.append(record.loss_sum)
            counts.append(step.num_micro_batches)
            hashes.append(step.plan_hash)
            if scheduler == "balance" and RESUME_AT <= step.index < RESUME_AT + 5:
                out.setdefault("resumed_reference_tokens", []).append(
                    [mb.tokens.tolist() for mb in step.micro_batch_tensors()])
            if step.index == RESUME_AT - 1 and scheduler == "balance":  # "save" after 5 steps
                checkpoint = copy.deepcopy((ddp.state_dict(), optimizer.state_dict(),
                                            iterator.state_dict()))
        out["train"][scheduler] = {
            "loss_sums": losses,
            "loss_tokens": [sum(n - 1 for n in b.lengths) for b in batches],
            "micro_batch_counts": counts,
            "plan_hashes": hashes,
        }
        if checkpoint is not None:
            out["resume"] = _resume_training(checkpoint, batches, planner, config, initial_state,
                                             manager)

    # -- 3. no barriers: a slow rank, a rank without micro-batches ---------------------------
    lengths = {0: 40, 1: 120, 2: 30, 3: 50, 4: 20, 5: 60}
    builder = PlanBuilder(hdp_size=4, capacity=CAPACITY, lengths=lengths)
    builder.add([0], [0])
    builder.add([1, 2], [1])
    builder.add([0], [2])
    builder.add([1], [3])
    builder.add([0], [4])
    builder.add([2], [5])
    manual_plan = builder.build(scheduler="manual")
    tokens = [rng.integers(0, VOCAB, lengths[i]).tolist() for i in range(len(lengths))]
    ddp, optimizer = fresh_model(config, initial_state)
    step = next(HDPDataIterator([tokens], planner=lambda _: manual_plan, hdp=manager.hdp))
    record = run_hdp_step(
        step,
        model=ddp,
        optimizer=optimizer,
        manager=manager,
        forward_step_func=slow_rank0_forward_step,
    )
    out["timeline"] = {
        "micro_batches": step.num_micro_batches,
        "done_at": record.micro_batches_done_at,
        "reduced_at": record.reduced_at,
        "reduce_wall_s": record.reduce_wall_s,
        "loss_tokens": record.loss_tokens,
    }

    out["guards"] = _step_guards(step, config, initial_state, manager, cm, rank)

    # -- 4. the core attention refuses what it cannot do --------------------------------------
    out["attention_refusals"] = _attention_refusals(config, manager)

    # -- 5. plan agreement: rank-0 broadcast, and a mismatch detected on every rank ---------
    good = make_step_planner(bytescale_config(), hdp_size=manager.size, cost_model=cm)

    def only_rank0(lengths_: list[int]):
        if rank != 0:
            raise AssertionError("rank0_broadcast planned on a rank other than 0")
        return good(lengths_)

    broadcast_step = next(
        HDPDataIterator(
            [sequences], planner=only_rank0, hdp=manager.hdp, plan_mode="rank0_broadcast"
        )
    )
    out["broadcast_hash"] = broadcast_step.plan_hash
    out["every_rank_hash"] = next(
        HDPDataIterator([sequences], planner=good, hdp=manager.hdp)
    ).plan_hash
    skewed = make_step_planner(
        bytescale_config(capacity=CAPACITY * 2 if rank == 1 else CAPACITY),
        hdp_size=manager.size,
        cost_model=cm,
    )
    try:
        next(HDPDataIterator([sequences], planner=skewed, hdp=manager.hdp))
        out["mismatch"] = None
    except PlanMismatchError as exc:
        out["mismatch"] = str(exc)
    out["planning_failures"] = _planning_failures(good, sequences, manager, rank)

    # -- 6. selective activation offload in training (offload_cases.py) ---------------------
    from .offload_cases import OFFLOAD_LAYERS, offload_checks

    out["offload"] = offload_checks(rank, manager, sequences, cm.with_(num_layers=OFFLOAD_LAYERS))
    return out


def _resume_training(checkpoint, batches, planner, config, initial_state, manager) -> dict:
    """A fresh model, optimizer and iterator restored from the step-5 checkpoint train steps
    6-10 (indices 5-9); the test compares them with the uninterrupted run."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step

    model_state, optimizer_state, iterator_state = checkpoint
    ddp, optimizer = fresh_model(config, initial_state)
    ddp.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    iterator = HDPDataIterator(list(batches), planner=planner, hdp=manager.hdp)  # a new source
    iterator.load_state_dict(iterator_state)
    steps = []
    for step in itertools.islice(iterator, 5):
        record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        tokens = [mb.tokens.tolist() for mb in step.micro_batch_tensors()]
        steps.append({"index": step.index, "plan_hash": step.plan_hash,
                      "loss_sum": record.loss_sum, "tokens": tokens})
    iterator.close()
    return {"state": iterator_state, "steps": steps}


def _planning_failures(good, sequences, manager, rank: int) -> dict[str, str]:
    """A rank whose planner raises stops every rank (no one waits in a later collective), and
    the batch is planned again by the next call on every rank."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator

    def flaky(failing_rank: int):
        calls = [0]

        def plan(lengths_: list[int]):
            calls[0] += 1
            if rank == failing_rank and calls[0] == 1:
                raise ValueError(f"rank {rank} cannot plan")
            return good(lengths_)

        return plan

    out = {}
    for name, mode, failing in (("every_rank", "every_rank", 2), ("broadcast", "rank0_broadcast", 0)):
        iterator = HDPDataIterator([sequences, sequences[:3]], planner=flaky(failing),
                                   hdp=manager.hdp, plan_mode=mode)
        try:
            next(iterator)
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(exc).__name__}: {exc}"
        step = next(iterator)  # the same batch again, planned this time
        out[name + "_retry"] = f"{step.index} {len(step.plan.sequences)}"
        iterator.close()
    return out


def _step_guards(step, config, initial_state, manager, cm, rank: int) -> dict[str, Any]:
    """The token-count guard of ``run_hdp_step``, and an overlong document truncated by the
    planner: its tokens reach the ranks through ``PlannedTokens`` cut to the planned length, and
    the step equals one process training the truncated documents."""
    import dataclasses

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step

    out: dict[str, Any] = {}
    # a step whose global token count disagrees with what the ranks trained stops every rank
    wrong = dataclasses.replace(step, global_loss_tokens=step.global_loss_tokens + 1)
    ddp, optimizer = fresh_model(config, initial_state)
    try:
        run_hdp_step(wrong, model=ddp, optimizer=optimizer, manager=manager)
        out["token_guard"] = None
    except RuntimeError as exc:
        out["token_guard"] = str(exc)

    # an overlong document: CONTEXT + 44 tokens, truncated to CONTEXT by the planner
    rng = np.random.default_rng(21)
    documents = [rng.integers(0, VOCAB, n).tolist() for n in (CONTEXT + 44, 70, 31, 90)]
    planner = make_step_planner(bytescale_config(overlong="truncate"), hdp_size=manager.size,
                                cost_model=cm)
    truncated = next(HDPDataIterator([documents], planner=planner, hdp=manager.hdp))
    out["truncated_meta"] = truncated.plan.meta.get("truncated")
    out["truncated_loss_tokens"] = truncated.global_loss_tokens
    seen = []
    for tensors in truncated.micro_batch_tensors():
        real = tensors.layout.real_mask()
        for slot in tensors.layout.slots:
            rows = slice(slot.offset, slot.offset + slot.num_real)
            for pos, tok in zip(tensors.position_ids[rows].tolist(), tensors.tokens[rows].tolist()):
                seen.append((slot.seq, pos, tok))
        out.setdefault("padding_is_zero", True)
        out["padding_is_zero"] &= bool((tensors.tokens[~real] == 0).all())
    out["truncated_tokens_seen"] = seen
    ddp, optimizer = fresh_model(config, initial_state)
    grads = grab_grads_before_step(ddp, optimizer)
    record = run_hdp_step(truncated, model=ddp, optimizer=optimizer, manager=manager)
    out["truncated_loss_sum"] = record.loss_sum
    if rank == 0:
        cut = [d[:CONTEXT] for d in documents]
        ref_loss, ref_grads = reference_loss_and_grads(config, initial_state, cut)
        out["truncated_reference_loss"] = ref_loss
        out["truncated_grad_error"] = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
        out["documents"] = documents
    return out
