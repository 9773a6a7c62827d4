"""Measure the MoE token dispatch that a layer timed at expert parallelism 1 cannot show.

``bytescale profile --num-experts N`` times the decoder layers with megatron-core's MoE layer
(router, the dispatcher's permute copies and, with TP, its all-gathers, the experts) like any
other layer: those costs land in T(s). What it cannot time at EP 1 is the all-to-all of an
expert group. :func:`measure_moe_all_to_all` times it directly over megatron-core's EP groups
(``ep_size`` ranks, ``expert_tensor_parallel_size`` GPUs apart: ``ep_size`` consecutive HDP
ranks when that is TP; :func:`~megatron_bytescale.planner.expert_layout.expert_parallel_group`):
every rank sends its ``k`` routed copies of ``n`` tokens (``k * n``
rows of ``hidden`` elements, an equal share to every member, i.e. a balanced router), for a
few ``n``; :func:`megatron_bytescale.planner.moe_cost.fit_moe_dispatch` fits
``seconds = a n + b`` to the best of each and counts four per layer (dispatch and combine,
forward and backward).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_bytescale.data.hdp_iterator import collective_device
from megatron_bytescale.planner.expert_layout import expert_parallel_group

if TYPE_CHECKING:
    from megatron_bytescale.runtime import HDPGroup

#: Tokens per rank of the timed all-to-alls (a micro-batch share from short to long).
DEFAULT_TOKENS = (256, 512, 1024, 2048, 4096)


def measure_moe_all_to_all(
    hdp: "HDPGroup",
    *,
    ep_size: int,
    expert_tensor_parallel_size: int | None = None,
    hidden_size: int,
    topk: int,
    dtype: torch.dtype = torch.float32,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> tuple[tuple[int, float], ...]:
    """``(tokens per rank, best seconds of one all-to-all)`` over this rank's EP group (members
    ``expert_tensor_parallel_size`` GPUs apart; None: the TP size), HDP rank 0's timings
    broadcast to every HDP rank. Collective over every process (one pipeline stage).

    Raises:
        ValueError: ``ep_size`` < 2, or ETP x EP not a divisor of the processes.
    """
    world = dist.get_world_size()
    etp = expert_tensor_parallel_size or world // hdp.size
    if ep_size < 2 or world % (etp * ep_size):
        raise ValueError(f"--expert-model-parallel-size ({ep_size}) must be >= 2 and, times the expert-TP "
                         f"size {etp}, divide the {world} processes to time the expert all-to-all")
    device = collective_device(hdp.group)
    ranks = expert_parallel_group(dist.get_rank(), etp=etp, ep=ep_size)
    group = dist.new_group(ranks, use_local_synchronization=True)
    best = torch.zeros(len(tokens), dtype=torch.float64, device=device)
    try:
        for i, n in enumerate(tokens):
            rows = -(-int(n) * topk // ep_size) * ep_size  # an equal share to every member
            send = torch.ones(rows, hidden_size, dtype=dtype, device=device)
            recv = torch.empty_like(send)
            seconds = float("inf")
            for _ in range(repeats + 1):
                dist.barrier(group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                dist.all_to_all_single(recv, send, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = min(seconds, time.perf_counter() - start)
            best[i] = seconds
            if progress is not None and hdp.rank == 0:
                progress(f"MoE all-to-all over {ep_size} ranks, {n} tokens x top-{topk}: {seconds * 1e3:.3f} ms")
    finally:
        dist.destroy_process_group(group)
    dist.broadcast(best, src=hdp.global_rank(0), group=hdp.group)
    return tuple((int(n), float(t)) for n, t in zip(tokens, best.tolist()))
