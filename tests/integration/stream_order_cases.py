"""Per-rank body of the stream-order tests: HDP training with NCCL's per-group operation order.

One 4-process gloo spawn (module level so that spawned processes import it), in three phases:

A. HDP 4, PP 1, ``--overlap-grad-reduce`` with small buckets, rings on their own group: the
   hand-made plans of the GPU-path tests and random balance plans, under
   ``testing.stream_order`` (HDP group and ring group each one ordered stream). Gradients
   must equal the same training without the emulation.
B. PP 2 x HDP 2: the pipeline stress plans (PP-Balance and random pipeline plans) with
   overlapped reduction, the pipeline group ordered too.
C. Last, because it leaves gloo operations pending: the same overlapped training with the
   rings on the HDP group itself (the configuration before the ring group existed). The
   spawn ends with a hard exit.

Megatron's DDP issues no reduction from its backward hooks in a model's first step (it counts
the gradients each bucket waits for, then reduces everything in ``finish_grad_sync``); from the
second step on, a bucket group's reduction starts as soon as its gradients are ready. Every
hazardous plan therefore runs as a second or later step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .gpu_path_cases import _config, _plans
from .hdp_cases import CONTEXT, VOCAB, grab_grads_before_step, relative_error
from .parallel_cases import fresh_model, layout_config, stress_batches, switch_layout

OVERLAP = dict(overlap_grad_reduce=True, bucket_size=2000)
RANDOM_PLANS = 6
DEADLOCK_TIMEOUT_S = 8.0


def ring_hazards(plan) -> int:
    """(rank, micro-batch) pairs where a rank's LAST micro-batch is a ring and a member of that
    ring still has a later micro-batch: where an overlapped bucket reduction fires mid-ring."""
    hazards = 0
    for row in plan.ranks:
        if not row.micro_batches:
            continue
        last = row.micro_batches[-1]
        if len(last.ring) < 2:
            continue
        later = [m for m in last.ring
                 if any(mb.order > last.order for mb in plan.ranks[m].micro_batches)]  # fmt: skip
        hazards += bool(later)
    return hazards


def _fixed(pairs) -> list[tuple[list, Any]]:
    return [(tokens, (lambda _, p=plan: p)) for plan, tokens in pairs]


def _phase_a_batches(manager) -> list[tuple[list, Any]]:
    # Megatron issues no reduction from the backward hooks in a model's first step (it learns
    # how many gradients each bucket waits for), so the hazardous plan 0 comes second
    hand = _plans()
    batches = _fixed([hand[2], hand[0], hand[1]])
    batches += list(stress_batches(seed=21, hdp_size=manager.size, pp_size=1, count=RANDOM_PLANS))
    return batches


def _train(manager, initial_state, batches, **wrap) -> tuple[list[dict], list]:
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp

    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=CONTEXT)
    model.load_state_dict(initial_state)
    ddp, optimizer = wrap_for_hdp(model, lr=1e-2, **wrap)
    grads, plans = [], []
    for tokens, planner in batches:
        step = next(HDPDataIterator([tokens], planner=planner, hdp=manager.hdp))
        captured = grab_grads_before_step(ddp, optimizer)
        run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        grads.append(captured)
        plans.append(step.plan)
    return grads, plans


def stream_order_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel

    from megatron_bytescale.integration.groups import (
        HDPGroupManager,
        initialize_hdp_model_parallel,
        set_hdp_manager,
    )
    from megatron_bytescale.integration.training import build_gpt_model
    from megatron_bytescale.runtime import HDPGroup
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron
    from megatron_bytescale.testing.stream_order import StreamOrderDeadlock, stream_ordered

    enable_cpu_megatron()
    manager = initialize_hdp_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    initial_state = build_gpt_model(_config(), vocab_size=VOCAB,
                                    max_sequence_length=CONTEXT).state_dict()  # fmt: skip
    out: dict[str, Any] = {"rank": rank}

    # -- A. separate ring group, HDP 4 -------------------------------------------------------
    batches = _phase_a_batches(manager)
    plain, plans = _train(manager, initial_state, batches, **OVERLAP)
    hdp = manager.hdp
    start = time.perf_counter()
    with stream_ordered({hdp.group: "hdp", hdp.ring_group: "ring"}, timeout_s=120) as emulation:
        ordered, _ = _train(manager, initial_state, batches, **OVERLAP)
        items = {"hdp": emulation.items(hdp.group), "ring": emulation.items(hdp.ring_group)}
    out["A"] = {
        "errors": [max(relative_error(o[n], p[n]) for n in p) for o, p in zip(ordered, plain)],
        "hazards": [ring_hazards(plan) for plan in plans],
        "items": items,
        "seconds": time.perf_counter() - start,
    }

    # -- B. PP 2 x HDP 2, the pipeline stress plans ------------------------------------------
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step

    full_state = build_gpt_model(layout_config(), vocab_size=VOCAB, max_sequence_length=CONTEXT,
                                 share_embeddings_and_output_weights=True).state_dict()
    manager = switch_layout(pipeline_model_parallel_size=2)
    hdp = manager.hdp
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    ddp, optimizer = fresh_model(layout_config(), {"state": full_state}, share_embeddings=True,
                                 **OVERLAP)  # fmt: skip
    steps = []
    start = time.perf_counter()
    groups = {hdp.group: "hdp", hdp.ring_group: "ring", pp_group: "pipeline"}
    with stream_ordered(groups, timeout_s=120) as emulation:
        for tokens, planner in stress_batches(seed=5):
            step = next(HDPDataIterator([tokens], planner=planner, hdp=hdp))
            record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
            steps.append({"hazards": ring_hazards(step.plan), "loss_sum": record.loss_sum,
                          "rings": sum(1 for r in step.plan.ring_sizes() if r > 1),
                          "last_stage": manager.rank_map.is_last_stage})  # fmt: skip
        items = {name: emulation.items(g) for g, name in groups.items()}
    out["B"] = {"steps": steps, "items": items, "seconds": time.perf_counter() - start}

    # -- C. rings on the HDP group (no ring group): may leave gloo work pending --------------
    manager = switch_layout()
    shared = HDPGroupManager(HDPGroup(manager.hdp.group, ring_group=manager.hdp.group),
                             rank_map=manager.rank_map)  # fmt: skip
    set_hdp_manager(shared)
    start = time.perf_counter()
    deadlock = None
    with stream_ordered({shared.hdp.group: "hdp"}, timeout_s=DEADLOCK_TIMEOUT_S):
        try:
            hand = _plans()  # plan 1 first: reductions fire from the hooks from step 2 on
            _train(shared, initial_state, _fixed([hand[1], hand[0]]), **OVERLAP)
        except StreamOrderDeadlock as exc:
            deadlock = str(exc)
        except RuntimeError as exc:  # a deadlock seen through autograd's re-raise
            deadlock = str(exc) if "stream-ordered group" in str(exc) else repr(exc)
    out["C"] = {"deadlock": deadlock, "seconds": time.perf_counter() - start,
                "hazards": ring_hazards(_plans()[0][0])}  # fmt: skip
    return out
