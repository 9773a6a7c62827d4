"""Calibrate the planner's cost model on the model actually being trained.

The planner needs per-layer ``T(s) = alpha1 s^2 + beta1 s + gamma`` and ``Act(s)`` of *this*
model on *this* machine. HDP rank 0 measures them (forward + backward of one sequence of a few
lengths on a ring of size 1, CPU time per layer; activation bytes saved for backward, per
layer) and fits :meth:`CostModel.fit`; it also times P2P exchanges between two HDP ranks for
the ring's latency and bandwidth. The fitted model is broadcast as JSON, so every rank plans
with exactly the same numbers (plans must hash equal, D7) however noisy the measurement was.
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


def calibrate_cost_model(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    *,
    lengths: Sequence[int],
    kv_bytes_per_token: float,
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
        repeats: timings per length; the minimum is kept (least disturbed by other processes).
    """
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
            p2p_bandwidth_intra=bandwidth,
            p2p_bandwidth_inter=bandwidth,
            p2p_latency_s=latency,
            ranks_per_node=hdp.size,
            source=f"calibrated on HDP rank 0 at lengths {list(lengths)}",
        )
        payload[0] = {
            "cost_model": cost_model.to_dict(),
            "time": time_samples,
            "activation": activation_samples,
            "bandwidth": bandwidth,
            "latency": latency,
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
        best = float("inf")
        for attempt in range(repeats + 1):  # the first run warms up allocators and caches
            saved = [0]

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved[0] += t.numel() * t.element_size()
                return t

            start = time.process_time()
            with manager.bind(micro_batch), torch.autograd.graph.saved_tensors_hooks(
                pack, lambda t: t
            ):
                output, loss_func = hdp_forward_step(iter([micro_batch]), model)
                loss, _, _ = loss_func(output)
            loss.backward()
            elapsed = time.process_time() - start
            if attempt:
                best = min(best, elapsed)
        model.zero_grad(set_to_none=True)
        time_samples.append((length, best / layers))
        activation_samples.append((length, saved[0] / layers))
        logger.info("calibration: %d tokens -> %.4f s per layer (fwd+bwd)", length, best / layers)
    return time_samples, activation_samples


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
                start = time.perf_counter()
                ops = [
                    dist.P2POp(dist.isend, send, peer, group=hdp.group),
                    dist.P2POp(dist.irecv, recv, peer, group=hdp.group),
                ]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
                best = min(best, time.perf_counter() - start)
            return best

        latency = best_exchange_s(1)
        large = best_exchange_s(max(1, num_bytes // 4))
        result[0] = num_bytes / max(large - latency, 1e-9)
        result[1] = latency
    if hdp.size > 1:
        dist.broadcast(result, src=hdp.global_rank(0), group=hdp.group)
    return float(result[0]), float(result[1])
