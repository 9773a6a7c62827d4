"""Calibrate the planner's cost model on the model actually being trained.

The planner needs per-layer ``T(s) = alpha1 s^2 + beta1 s + gamma`` and ``Act(s)`` of *this*
model on *this* machine. HDP rank 0 measures them (forward + backward of one sequence of a few
lengths on a ring of size 1, per layer: CPU time on CPU, synchronised wall time on CUDA;
activation bytes saved for backward, per layer) and fits :meth:`CostModel.fit`; it also times P2P exchanges between two HDP ranks for
the ring's latency and bandwidth. Then all ranks run a few ring micro-batches together (rings of
2 and of all ranks) and rank 0 fits the ring step overhead: what a ring costs beyond its
kernels and the link time (on CPU, gloo copies on the same cores that compute, so rings are
much dearer than a ping suggests, and a planner that ignores it piles rings on a few ranks).
The fitted model is broadcast as JSON, so every rank plans with exactly the same numbers
(plans must hash equal, D7) however noisy the measurement was.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from megatron_bytescale.data.hdp_iterator import collective_device
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.plan import PlanBuilder

from .groups import HDPGroupManager
from .schedule import hdp_forward_step

if TYPE_CHECKING:
    from megatron_bytescale.runtime import HDPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """The measured samples and the fitted model (samples are rank 0's, kept for reports)."""

    cost_model: CostModel
    time_samples: tuple[tuple[int, float], ...]
    activation_samples: tuple[tuple[int, float], ...]
    p2p_bandwidth: float
    p2p_latency_s: float
    ring_samples: tuple[tuple[int, int, float], ...] = ()
    """(ring size, sequence length, rank 0's CPU seconds) of the ring micro-batches measured."""


def calibrate_cost_model(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    *,
    lengths: Sequence[int],
    kv_bytes_per_token: float,
    dkv_bytes_per_token: float | None = None,
    repeats: int = 3,
    vocab_size: int = 256,
    p2p_bytes: int = 1 << 20,
    device: torch.device | None = None,
) -> Calibration:
    """Measure ``model`` on HDP rank 0, fit a :class:`CostModel`, give it to every HDP rank.

    Collective over the HDP group: every rank must call it. ``model`` is the bare (not
    DDP-wrapped) model; its gradients are cleared afterwards.

    Args:
        lengths: sequence lengths to time (at least 3 distinct; the largest should reach the
            capacity so the quadratic term is measured where it matters).
        kv_bytes_per_token: K+V bytes per token per layer a ring rotates (2 * kv heads *
            head dim * element size).
        dkv_bytes_per_token: dK+dV bytes per token per layer on the backward ring; the runtime
            sends them as float32 accumulators (2 * kv heads * head dim * 4). None means
            the same as ``kv_bytes_per_token`` (right for an fp32 model).
        repeats: timings per length; the minimum is kept (least disturbed by other processes).
    """
    if manager.pp_size > 1:
        raise ValueError(
            "calibrate_cost_model times whole-model micro-batches on one rank, which a pipeline "
            "stage cannot run alone; calibrate in a PP = 1 run of the same model and pass the "
            "saved model (--bytescale-cost-model), or use the analytic cost model"
        )
    hdp = manager.hdp
    layers = int(model.config.num_layers)
    payload: list = [None]
    bandwidth, latency = measure_p2p_link(hdp, num_bytes=p2p_bytes)
    if hdp.rank == 0:
        time_samples, activation_samples = _measure(
            model,
            manager,
            lengths=lengths,
            repeats=repeats,
            vocab_size=vocab_size,
            layers=layers,
            device=device,
        )
        cost_model = CostModel.fit(
            time_samples,
            activation_samples,
            name="calibrated-cpu",
            num_layers=layers,
            d2h_bandwidth=10e9,
            h2d_bandwidth=10e9,
            kv_bytes_per_token=float(kv_bytes_per_token),
            dkv_bytes_per_token=None if dkv_bytes_per_token is None else float(dkv_bytes_per_token),
            p2p_bandwidth_intra=bandwidth,
            p2p_bandwidth_inter=bandwidth,
            p2p_latency_s=latency,
            ranks_per_node=hdp.size,
            source=f"calibrated on HDP rank 0 at lengths {list(lengths)}",
        )
    else:
        cost_model = None
    ring_samples, overhead = _measure_ring_overhead(
        model, manager, cost_model, lengths=lengths, repeats=repeats, vocab_size=vocab_size,
        layers=layers, device=device,
    )  # fmt: skip
    if hdp.rank == 0:
        cost_model = cost_model.with_(ring_step_overhead_s=overhead)
        payload[0] = {
            "cost_model": cost_model.to_dict(),
            "time": time_samples,
            "activation": activation_samples,
            "bandwidth": bandwidth,
            "latency": latency,
            "rings": ring_samples,
        }
    if hdp.size > 1:
        dist.broadcast_object_list(payload, src=hdp.global_rank(0), group=hdp.group)
    data = payload[0]
    return Calibration(
        cost_model=CostModel.from_dict(data["cost_model"]),
        time_samples=tuple(tuple(x) for x in data["time"]),
        activation_samples=tuple(tuple(x) for x in data["activation"]),
        p2p_bandwidth=float(data["bandwidth"]),
        p2p_latency_s=float(data["latency"]),
        ring_samples=tuple(tuple(x) for x in data["rings"]),
    )


def _measure(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    *,
    lengths: Sequence[int],
    repeats: int,
    vocab_size: int,
    layers: int,
    device: torch.device | None,
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    from megatron_bytescale.runtime import build_micro_batch

    hdp = manager.hdp
    generator = torch.Generator().manual_seed(1234)
    time_samples: list[tuple[int, float]] = []
    activation_samples: list[tuple[int, float]] = []
    for length in sorted(set(int(n) for n in lengths)):
        tokens = torch.randint(0, vocab_size, (length,), generator=generator)
        builder = PlanBuilder(hdp_size=hdp.size, capacity=length, lengths={0: length})
        builder.add([hdp.rank], [0])
        plan = builder.build(scheduler="calibration")
        micro_batch = build_micro_batch(plan, hdp, 0, {0: tokens}, device=device)
        best, saved = _time_micro_batch(model, manager, micro_batch, repeats=repeats)
        time_samples.append((length, best / layers))
        activation_samples.append((length, saved / layers))
        logger.info("calibration: %d tokens -> %.4f s per layer (fwd+bwd)", length, best / layers)
    return time_samples, activation_samples


def _time_micro_batch(
    model: torch.nn.Module, manager: HDPGroupManager, micro_batch, *, repeats: int
) -> tuple[float, int]:
    """Best CPU seconds of forward + backward of one micro-batch, and the bytes saved for backward.

    The first run is not counted: it warms up allocators and caches.
    """
    best = float("inf")
    saved = [0]
    for attempt in range(repeats + 1):
        saved[0] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        start = _busy_clock(micro_batch.tokens.device)
        with manager.bind(micro_batch), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t
        ):
            output, loss_func = hdp_forward_step(iter([micro_batch]), model)
            loss, _, _ = loss_func(output)
        loss.backward()
        elapsed = _busy_clock(micro_batch.tokens.device) - start
        if attempt:
            best = min(best, elapsed)
    model.zero_grad(set_to_none=True)
    return best, saved[0]


def _busy_clock(device: torch.device) -> float:
    """Seconds for timing work on ``device``: CPU time of this process on the CPU (4 ranks may
    share 2 cores, and waiting for a core is not work), wall time after a device synchronise on
    CUDA (kernels run asynchronously; the host would only see launch time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def _measure_ring_overhead(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    fitted: CostModel | None,
    *,
    lengths: Sequence[int],
    repeats: int,
    vocab_size: int,
    layers: int,
    device: torch.device | None,
) -> tuple[list[tuple[int, int, float]], float]:
    """Run ring micro-batches on HDP ranks ``0..D-1`` for D = 2 and D = all; fit the step overhead.

    Collective: every rank calls it (ranks outside a ring skip that case). Each case carries one
    sequence of ``D * n`` tokens for ``n`` = half and all of the longest calibration length
    (capped so the sequence fits the model's positions), so every member holds ``n`` tokens. Rank 0 returns the least-squares overhead per ring step per
    layer: ``sum(measured - predicted) / sum(layers * (D - 1))`` with ``predicted`` from
    ``fitted`` (no overhead), clipped at 0; other ranks return 0.0 and no samples.
    """
    from megatron_bytescale.runtime import build_micro_batch

    hdp = manager.hdp
    if hdp.size < 2:
        return [], 0.0
    generator = torch.Generator().manual_seed(4321)
    longest = max(int(n) for n in lengths)
    max_positions = int(getattr(model, "max_sequence_length", 0) or 0)
    samples: list[tuple[int, int, float]] = []
    for ring_size in sorted({2, hdp.size}):
        per_rank_max = min(longest, max_positions // ring_size) if max_positions else longest
        for per_rank in sorted({max(1, per_rank_max // 2), max(1, per_rank_max)}):
            length = ring_size * per_rank
            tokens = torch.randint(0, vocab_size, (length,), generator=generator)
            if hdp.rank >= ring_size:
                continue
            builder = PlanBuilder(hdp_size=hdp.size, capacity=length, lengths={0: length})
            builder.add(range(ring_size), [0])
            plan = builder.build(scheduler="calibration")
            micro_batch = build_micro_batch(plan, hdp, 0, {0: tokens}, device=device)
            best, _ = _time_micro_batch(model, manager, micro_batch, repeats=repeats)
            samples.append((ring_size, length, best))
    if hdp.rank != 0 or fitted is None:
        return [], 0.0
    excess = steps = 0.0
    for ring_size, length, seconds in samples:
        predicted = fitted.micro_batch_time([length], ring_size, layers=layers)
        excess += seconds - predicted
        steps += layers * (ring_size - 1)
    overhead = max(0.0, excess / steps)
    logger.info("calibration: ring step overhead %.2f ms per layer", overhead * 1e3)
    return samples, overhead


def measure_p2p_link(
    hdp: "HDPGroup", *, num_bytes: int = 1 << 20, repeats: int = 5
) -> tuple[float, float]:
    """``(bytes/s, latency s)`` of ``batch_isend_irecv`` exchanges between HDP ranks 0 and 1.

    Latency is the best time of a 4-byte exchange, bandwidth ``num_bytes`` over the best time
    of a ``num_bytes`` exchange minus that latency. Collective call: ranks other than 0 and 1
    only receive the broadcast result.
    """
    device = collective_device(hdp.group)
    result = torch.tensor([1e9, 0.0], dtype=torch.float64, device=device)
    if hdp.size > 1 and hdp.rank in (0, 1):
        peer = hdp.global_rank(1 - hdp.rank)

        def best_exchange_s(numel: int) -> float:
            send = torch.ones(numel, dtype=torch.float32, device=device)
            recv = torch.empty_like(send)
            best = float("inf")
            for _ in range(repeats + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                ops = [
                    dist.P2POp(dist.isend, send, peer, group=hdp.group),
                    dist.P2POp(dist.irecv, recv, peer, group=hdp.group),
                ]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
                if device.type == "cuda":  # NCCL's wait() only orders streams
                    torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - start)
            return best

        latency = best_exchange_s(1)
        large = best_exchange_s(max(1, num_bytes // 4))
        result[0] = num_bytes / max(large - latency, 1e-9)
        result[1] = latency
    if hdp.size > 1:
        dist.broadcast(result, src=hdp.global_rank(0), group=hdp.group)
    return float(result[0]), float(result[1])
