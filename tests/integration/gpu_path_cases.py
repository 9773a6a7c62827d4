"""Per-rank body of the GPU-path tests: overlapped reduction, recompute, no host syncs.

One 4-process gloo spawn (module level so that spawned processes import it). Hand-written plans
make ranks run different numbers of micro-batches, none on some rank in some step, over rings
of 1-3 ranks. Every comparison is against the same training without the feature, from the same
weights on the same data (the plain path is itself checked against one process training the
whole batch in test_hdp_training.py).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
import torch

from .hdp_cases import CONTEXT, VOCAB, grab_grads_before_step, relative_error


def _plans():
    """Three steps; rank 3 runs nothing in step 0, rank 0 nothing in step 1."""
    from megatron_bytescale.planner.plan import PlanBuilder

    steps = [
        ({0: 40, 1: 90, 2: 30, 3: 50, 4: 20},
         [([0], [0]), ([1, 2], [1]), ([0], [2]), ([1, 2, 0], [3]), ([2], [4])]),
        ({0: 60, 1: 25, 2: 100, 3: 33},
         [([3], [0]), ([1, 2], [1]), ([3, 2], [2]), ([1], [3])]),
        ({0: 70, 1: 45, 2: 18, 3: 64, 4: 9},
         [([0, 1, 2, 3], [0]), ([1], [1]), ([3], [2]), ([2, 0], [3]), ([0], [4])]),
    ]
    rng = np.random.default_rng(11)
    out = []
    for lengths, rings in steps:
        builder = PlanBuilder(hdp_size=4, capacity=10**6, lengths=lengths)
        for members, seqs in rings:
            builder.add(members, seqs)
        tokens = [rng.integers(0, VOCAB, lengths[i]).tolist() for i in range(len(lengths))]
        out.append((builder.build(scheduler="manual").validate(), tokens))
    return out


def _config(**overrides):
    from megatron_bytescale.integration.training import make_transformer_config

    return make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=64, **overrides)  # fmt: skip


def _train(manager, initial_state, config, *, counters=None, **wrap) -> list[dict]:
    """Three steps of the hand-made plans; the reduced gradients of every step."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp

    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT)
    model.load_state_dict(initial_state)
    ddp, optimizer = wrap_for_hdp(model, lr=1e-2, **wrap)
    grads = []
    for plan, tokens in _plans():
        step = next(HDPDataIterator([tokens], planner=lambda _, p=plan: p, hdp=manager.hdp))
        captured = grab_grads_before_step(ddp, optimizer)
        run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager, counters=counters)
        grads.append(captured)
    return grads, ddp


def gpu_path_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel
    from megatron_bytescale.integration.training import build_gpt_model
    from megatron_bytescale.runtime import CommCounters
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    manager = initialize_hdp_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    initial_state = build_gpt_model(_config(), vocab_size=VOCAB,
                                    max_sequence_length=CONTEXT).state_dict()  # fmt: skip
    out: dict[str, Any] = {"rank": rank}

    # -- overlapped gradient reduction: same gradients, every bucket issued on every rank ------
    plain, _ = _train(manager, initial_state, _config(), bucket_size=2000)
    overlapped, ddp = _train(manager, initial_state, _config(), overlap_grad_reduce=True,
                             bucket_size=2000)  # fmt: skip
    gate = ddp._bytescale_ordered_grad_sync
    out["overlap"] = {
        "bucket_groups": len(gate.groups),
        "issued_last_step": gate.issued,
        "errors": [max(relative_error(o[n], p[n]) for n in p) for o, p in zip(overlapped, plain)],
    }

    # -- recompute: full layers and selective core_attn give the same gradients ---------------
    counts = {}
    recompute = {}
    for name, overrides in (
        ("none", {}),
        ("full", dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)),
        ("selective_core_attn", dict(recompute_granularity="selective",
                                     recompute_modules=["core_attn"])),
    ):  # fmt: skip
        counters = CommCounters()
        with _capture_warnings() as warnings:
            grads, _ = _train(manager, initial_state, _config(**overrides), counters=counters)
        recompute[name] = grads
        counts[name] = {"calls": sum(s.total.attention_calls for s in counters.steps),
                        "warned": warnings}
    out["recompute"] = {
        name: [max(relative_error(g[n], r[n]) for n in r) for g, r in zip(recompute[name],
                                                                          recompute["none"])]
        for name in ("full", "selective_core_attn")
    }  # fmt: skip
    out["recompute_calls"] = counts

    # -- the micro-batch loop never reads a device value back --------------------------------
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_micro_batches
    from megatron_bytescale.integration.training import wrap_for_hdp

    # (host_syncs: reads back AND blocking host-to-device copies; see testing.host_sync)
    from megatron_bytescale.testing.host_sync import host_syncs

    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=CONTEXT)
    ddp, _ = wrap_for_hdp(model, lr=1e-2, overlap_grad_reduce=True)
    plan, tokens = _plans()[2]
    iterator = HDPDataIterator([tokens, tokens], planner=lambda _: plan, hdp=manager.hdp)
    next(iterator)
    # the iterator's per-step path (plan, hash check): one gathered hash table read back, once
    with host_syncs("count") as seen:
        step = next(iterator)
    out["iterator_syncs"] = seen.calls
    tensors = list(step.micro_batch_tensors())  # built (on the host) before the hot loop
    step = _prebuilt(step, tensors)
    ddp.zero_grad_buffer()
    with host_syncs("count") as seen:
        try:
            run_micro_batches(step, model=ddp, config=ddp.config, manager=manager)
        finally:
            out["host_reads"] = seen.calls
    ddp.finish_grad_sync()
    iterator.close()
    return out


def _prebuilt(step, tensors):
    import dataclasses

    return dataclasses.replace(step, _build=lambda index: tensors[index])


@contextlib.contextmanager
def _capture_warnings():
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logger = logging.getLogger("megatron_bytescale.integration.core_attention")
    handler = Handler()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
