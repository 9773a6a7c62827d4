"""Per-rank body of the activation-offload training checks (runs inside the HDP test spawn).

A 4-layer GPT (Eq. 3 keeps two layers resident, so two can offload) trains one global batch:

* the same hand-made plan (rings of 3 and 2, local packs) with every micro-batch's ratio set to
  0, 0.5 and 1, with the offloader, against the same plan without it (<= 1e-6) and against
  one process training the batch (<= 1e-5);
* plans made with offload on by ``naive`` and ``balance``: the long sequence gets a smaller
  ring than without offload and the gradients still match the single process;
* a few more steps of one plan, to see the host buffer pool stop growing.
"""

from __future__ import annotations

from typing import Any

import torch

OFFLOAD_LAYERS = 4
RATIOS = (0.0, 0.5, 1.0)


def _config4():
    from megatron_bytescale.integration.training import make_transformer_config

    return make_transformer_config(num_layers=OFFLOAD_LAYERS, hidden_size=32, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=64)


def _manual_plan(lengths: list[int], ratio: float):
    """Seq 0 on a ring of 3, seq 1 on a ring of 2, the rest packed locally; every micro-batch
    offloads ``ratio`` (capacity large: the point is the runtime, not Eq. 3)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=4, capacity=10**6, lengths=dict(enumerate(lengths)))
    builder.add([0, 1, 3], [0], ratio)
    builder.add([2, 1], [1], ratio)
    rest = list(range(2, len(lengths)))
    for rank in range(4):
        builder.add([rank], rest[rank::4], ratio)
    return builder.build(scheduler="manual", layers_per_stage=OFFLOAD_LAYERS).validate()


def _train_once(plan, sequences, config, initial_state, manager, offloader_on: bool):
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.offload import activation_offloader
    from megatron_bytescale.integration.schedule import run_hdp_step

    from .hdp_cases import fresh_model, grab_grads_before_step

    ddp, optimizer = fresh_model(config, initial_state)
    offloader = activation_offloader(ddp, min_tensor_bytes=0) if offloader_on else None
    step = next(HDPDataIterator([sequences], planner=lambda _: plan, hdp=manager.hdp))
    grads = grab_grads_before_step(ddp, optimizer)
    record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager, offloader=offloader)
    return grads, record, (ddp, optimizer, offloader, step)


def offload_checks(rank: int, manager: Any, sequences: list[list[int]], cost_model: Any) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.training import build_gpt_model

    from .hdp_cases import CONTEXT, VOCAB, bytescale_config, reference_loss_and_grads, relative_error

    config = _config4()
    tensor_parallel.model_parallel_cuda_manual_seed(4321)
    torch.manual_seed(4321)
    initial_state = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=CONTEXT).state_dict()
    reference = reference_loss_and_grads(config, initial_state, sequences)[1] if rank == 0 else None
    lengths = [len(s) for s in sequences]
    out: dict[str, Any] = {"manual": {}, "planned": {}}

    def compare(grads: dict[str, torch.Tensor], against: dict[str, torch.Tensor]) -> float:
        return max(relative_error(grads[n], against[n]) for n in against)

    for ratio in RATIOS:
        plan = _manual_plan(lengths, ratio)
        with_grads, record, _ = _train_once(plan, sequences, config, initial_state, manager, True)
        without_grads, _, _ = _train_once(plan, sequences, config, initial_state, manager, False)
        stats = record.offload
        info = {"offloaded_bytes": stats.offloaded_bytes, "reloaded_bytes": stats.reloaded_bytes,
                "peak_resident_bytes": stats.peak_resident_bytes,
                "on_demand_reloads": stats.on_demand_reloads,
                "ratios": sorted({r.offload_ratio for r in record.micro_batches}),
                "hdp": (record.hdp.offloaded_mb, record.hdp.peak_saved_mb)}
        if rank == 0:
            info["vs_no_offload"] = compare(with_grads, without_grads)
            info["vs_reference"] = compare(with_grads, reference)
        out["manual"][ratio] = info

    for scheduler in ("naive", "balance"):
        rings = {}
        for offload in (False, True):
            planner = make_step_planner(bytescale_config(scheduler=scheduler, offload=offload),
                                        hdp_size=manager.size, cost_model=cost_model)
            plan = planner(lengths)
            rings[offload] = next(mb.ring_size for rp in plan.ranks for mb in rp.micro_batches if 0 in mb.seqs)
        grads, record, state = _train_once(plan, sequences, config, initial_state, manager, True)
        info = {"ring_of_longest": rings, "offloaded_bytes": record.offload.offloaded_bytes,
                "planned_ratios": [mb.offload_ratio for mb in state[3].micro_batches]}
        if rank == 0:
            info["vs_reference"] = compare(grads, reference)
        if scheduler == "balance":  # keep training on the same batch: the pool stops growing
            ddp, optimizer, offloader, step = state
            pools = []
            for _ in range(4):
                from megatron_bytescale.integration.schedule import run_hdp_step

                again = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager, offloader=offloader)
                pools.append((again.offload.host_pool_bytes, offloader.pool.allocations))
            info["pools"] = pools
        out["planned"][scheduler] = info
    return out
