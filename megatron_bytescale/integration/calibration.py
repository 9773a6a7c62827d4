"""Calibrate the planner's cost model on the model actually being trained, on this machine.

The planner needs per-layer ``T(s) = alpha1 s^2 + beta1 s + gamma`` and ``Act(s)`` of *this*
model on *this* device, the host link that offload uses, and the P2P link of the rings. HDP
rank 0 measures (:func:`calibrate_cost_model`; every rank times the layers at the same time, so
the timings share the machine as the run will, and rank 0's are kept):

* **decoder layers only** (:func:`time_decoder`): the embedding runs untimed, then the decoder's
  forward and backward (from a fixed output gradient) are timed: CUDA events around them after a
  synchronise on CUDA, CPU time on CPU (ranks share cores there, and waiting for one is not
  work; :func:`.busy_clock.busy_clock`, the clock the run's busy time uses). The embedding,
  LM head and loss are not layers, so they are not divided
  among them;
* **activation bytes** of the decoder's forward: on CUDA the allocator's peak minus the baseline
  before the forward (what the device must hold); on CPU the distinct storages saved for
  backward, parameters excluded (a view saved twice is counted once);
* **host link** (:func:`measure_host_link`): pinned-memory D2H and H2D copies on CUDA, a copy
  into a separate host buffer on CPU (what the CPU offload stand-in pays);
* **P2P link** (:func:`measure_p2p_link`) between HDP ranks 0 and 1.

Then all ranks run a few ring micro-batches together (rings of 2 and of all ranks, each of one
sequence and of many short documents, plus a local pack of many documents) and rank 0 fits two
terms that single sequences on one rank cannot show (:func:`.planner.profile.fit_ring_terms`):
the ring step overhead, what a ring step costs beyond its kernels and the link time, and the
cost per document per ring step (attention backends that call their kernel once per document
segment; the CPU path). The
fitted model is named after the device (``calibrated-nvidia-h200``, ``calibrated-cpu``) and
broadcast as JSON, so every rank plans with exactly the same numbers (plans must hash equal,
D7) however noisy the measurement was.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_bytescale.data.hdp_iterator import collective_device
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.plan import PlanBuilder
from megatron_bytescale.planner.profile import RingTermsFit, fit_ring_terms

from .busy_clock import busy_clock
from .groups import HDPGroupManager

if TYPE_CHECKING:
    from megatron_bytescale.runtime import HDPGroup, MicroBatchTensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """The measured samples and the fitted model (samples are rank 0's, kept for reports)."""

    cost_model: CostModel
    time_samples: tuple[tuple[int, float], ...]
    """(sequence length, seconds per layer, forward + backward)."""
    activation_samples: tuple[tuple[int, float], ...]
    """(sequence length, activation bytes per layer)."""
    p2p_bandwidth: float
    p2p_latency_s: float
    ring_samples: tuple[tuple[int, int, float], ...] = ()
    """(ring size, sequence length, rank 0's decoder seconds) of the one-sequence ring micro-batches."""
    document_samples: tuple[tuple[int, int, int, float], ...] = ()
    """(ring size, documents, tokens, rank 0's decoder seconds) of every micro-batch the ring
    terms were fitted to (the one-sequence rings included, with 1 document)."""
    ring_fit: "RingTermsFit | None" = None
    """The ring-term fit with residuals before (overhead only) and after (with per document)."""
    d2h_bandwidth: float = 0.0
    h2d_bandwidth: float = 0.0
    device_name: str = "cpu"


@dataclass(frozen=True)
class DecoderMeasurement:
    """One micro-batch through the decoder layers: best seconds (fwd + bwd) and activation bytes."""

    seconds: float
    activation_bytes: int


def device_label(device: torch.device | str) -> str:
    """``cpu``, or the CUDA device's name as a slug (``nvidia-h200``): names a calibration."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


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
    host_bytes: int = 64 << 20,
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure ``model`` on HDP rank 0, fit a :class:`CostModel`, give it to every HDP rank.

    Collective over the HDP group: every rank must call it. ``model`` is the bare (not
    DDP-wrapped) model; its gradients are cleared afterwards.

    Args:
        lengths: sequence lengths to time (at least 3 distinct; the largest should reach the
            capacity so the quadratic term is measured where it matters).
        kv_bytes_per_token: K+V bytes per token per layer a ring rotates (2 * kv heads *
            head dim * element size).
        dkv_bytes_per_token: dK+dV bytes per token per layer on the backward ring (float32
            accumulators by default: 2 * kv heads * head dim * 4; the K/V size with
            ``--bytescale-dkv-wire-dtype input``). None means the same as ``kv_bytes_per_token``.
        repeats: timings per length; the minimum is kept (least disturbed by other processes).
        host_bytes: size of the host-link copies.
        device: where micro-batches are built (default: the model's parameters' device).
        progress: called on rank 0 with a line after each measurement (``bytescale profile``).
    """
    if manager.pp_size > 1:
        raise ValueError(
            "calibrate_cost_model times whole-model micro-batches on one rank, which a pipeline "
            "stage cannot run alone; calibrate in a PP = 1 run of the same model and pass the "
            "saved model (--bytescale-cost-model), or use the analytic cost model"
        )
    hdp = manager.hdp
    device = device if device is not None else _model_device(model)
    layers = int(model.config.num_layers)
    payload: list = [None]
    bandwidth, latency = measure_p2p_link(hdp, num_bytes=p2p_bytes)
    if progress is not None and hdp.rank == 0 and hdp.size > 1:
        progress(f"P2P link between HDP ranks 0 and 1: {bandwidth / 1e9:.3f} GB/s, "
                 f"{latency * 1e6:.0f} us latency")
    cost_model = None
    # every rank times its own local micro-batches at once, rank 0's are kept: the timings then
    # see what the run's will, all ranks computing together (on a CPU host, cores and caches
    # shared), not one rank alone on an idle machine
    time_samples, activation_samples = measure_layer_costs(
        model, manager, lengths=lengths, repeats=repeats, vocab_size=vocab_size, device=device,
        progress=progress if hdp.rank == 0 else None,
    )
    if hdp.rank == 0:
        d2h, h2d = measure_host_link(device, num_bytes=host_bytes)
        if progress is not None:
            progress(f"host link: D2H {d2h / 1e9:.2f} GB/s, H2D {h2d / 1e9:.2f} GB/s")
        label = device_label(device)
        cost_model = CostModel.fit(
            time_samples,
            activation_samples,
            name=f"calibrated-{label}",
            num_layers=layers,
            d2h_bandwidth=d2h,
            h2d_bandwidth=h2d,
            kv_bytes_per_token=float(kv_bytes_per_token),
            dkv_bytes_per_token=None if dkv_bytes_per_token is None else float(dkv_bytes_per_token),
            p2p_bandwidth_intra=bandwidth,
            p2p_bandwidth_inter=bandwidth,
            p2p_latency_s=latency,
            ranks_per_node=hdp.size,
            source=f"calibrated on HDP rank 0 ({label}) at lengths {sorted(set(lengths))}",
        )
    ring_samples = _measure_ring_samples(
        model, manager, lengths=lengths, repeats=repeats, vocab_size=vocab_size, device=device,
    )  # fmt: skip
    if hdp.rank == 0:
        fit = fit_ring_terms(cost_model, ring_samples, layers=layers) if ring_samples else None
        if fit is not None:
            cost_model = fit.apply(cost_model)
            logger.info("calibration: ring step overhead %.3f ms, per document %.3f ms per layer",
                        fit.overhead_s * 1e3, fit.per_document_s * 1e3)
        if progress is not None and fit is not None:
            rings = " and ".join(str(d) for d in sorted({d for d, _, _, _ in ring_samples}))
            progress(f"micro-batches on {rings} ranks: ring step overhead {fit.overhead_s * 1e3:.3f} ms, "
                     f"per document per ring step {fit.per_document_s * 1e3:.3f} ms per layer")
        payload[0] = {
            "cost_model": cost_model.to_dict(),
            "documents": ring_samples,
            "fit": None if fit is None else [fit.overhead_s, fit.per_document_s, fit.overhead_only_s,
                                            list(fit.predicted_before), list(fit.predicted_after)],
            "time": time_samples,
            "activation": activation_samples,
            "bandwidth": bandwidth,
            "latency": latency,
            "rings": [(d, t, m) for d, n, t, m in ring_samples if n == 1 and d > 1],
            "d2h": d2h,
            "h2d": h2d,
            "device": label,
        }
    if hdp.size > 1:
        dist.broadcast_object_list(payload, src=hdp.global_rank(0), group=hdp.group)
    data = payload[0]
    documents = tuple(tuple(x) for x in data["documents"])
    fit = None
    if data["fit"] is not None:
        overhead, per_doc, only, before, after = data["fit"]
        fit = RingTermsFit(overhead_s=overhead, per_document_s=per_doc, overhead_only_s=only,
                           samples=documents, predicted_before=tuple(before), predicted_after=tuple(after))
    return Calibration(
        document_samples=documents,
        ring_fit=fit,
        cost_model=CostModel.from_dict(data["cost_model"]),
        time_samples=tuple(tuple(x) for x in data["time"]),
        activation_samples=tuple(tuple(x) for x in data["activation"]),
        p2p_bandwidth=float(data["bandwidth"]),
        p2p_latency_s=float(data["latency"]),
        ring_samples=tuple(tuple(x) for x in data["rings"]),
        d2h_bandwidth=float(data["d2h"]),
        h2d_bandwidth=float(data["h2d"]),
        device_name=str(data["device"]),
    )


# ----------------------------------------------------------------------------- layers


def single_sequence_micro_batch(
    manager: HDPGroupManager,
    ring: Sequence[int],
    tokens: torch.Tensor,
    *,
    device: torch.device | None = None,
) -> "MicroBatchTensors":
    """This rank's micro-batch of ONE sequence (``tokens``) carried by ``ring`` (HDP ranks)."""
    return documents_micro_batch(manager, ring, [tokens], device=device)


def documents_micro_batch(
    manager: HDPGroupManager,
    ring: Sequence[int],
    documents: Sequence[torch.Tensor],
    *,
    device: torch.device | None = None,
) -> "MicroBatchTensors":
    """This rank's micro-batch of the sequences ``documents`` carried together by ``ring``."""
    from megatron_bytescale.runtime import build_micro_batch

    lengths = {i: int(t.numel()) for i, t in enumerate(documents)}
    builder = PlanBuilder(hdp_size=manager.hdp.size, capacity=sum(lengths.values()), lengths=lengths)
    builder.add(list(ring), list(lengths))
    plan = builder.build(scheduler="calibration")
    return build_micro_batch(plan, manager.hdp, 0, dict(enumerate(documents)), device=device)


def measure_layer_costs(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    *,
    lengths: Sequence[int],
    repeats: int = 3,
    vocab_size: int = 256,
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Per-layer ``(length, seconds)`` and ``(length, activation bytes)`` of one sequence per length.

    Each sequence runs on this rank alone (a ring of size 1), through :func:`time_decoder`;
    ``progress`` gets a line after each length.
    """
    generator = torch.Generator().manual_seed(1234)
    layers = int(model.config.num_layers)
    time_samples: list[tuple[int, float]] = []
    activation_samples: list[tuple[int, float]] = []
    distinct = sorted(set(int(n) for n in lengths))
    for index, length in enumerate(distinct):
        tokens = torch.randint(0, vocab_size, (length,), generator=generator)
        micro_batch = single_sequence_micro_batch(manager, [manager.hdp.rank], tokens, device=device)
        measured = time_decoder(model, manager, micro_batch, repeats=repeats)
        time_samples.append((length, measured.seconds / layers))
        activation_samples.append((length, measured.activation_bytes / layers))
        logger.info(
            "calibration: %d tokens -> %.4f s and %.1f MB of activations per layer (fwd+bwd)",
            length, measured.seconds / layers, measured.activation_bytes / layers / 1e6,
        )  # fmt: skip
        if progress is not None:
            progress(f"{index + 1}/{len(distinct)} lengths: {length} tokens -> "
                     f"{measured.seconds / layers * 1e3:.3f} ms and "
                     f"{measured.activation_bytes / layers / 1e6:.2f} MB per layer (fwd+bwd)")
    return time_samples, activation_samples


def time_decoder(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    micro_batch: "MicroBatchTensors",
    *,
    repeats: int = 3,
) -> DecoderMeasurement:
    """Best time of the decoder layers' forward + backward on ``micro_batch``, and its activations.

    The embedding runs without grad and untimed; its output (detached, requiring grad) feeds the
    decoder, whose output gets a fixed gradient. The first run warms allocators and caches and
    is not counted. ``model`` is a (bare) ``ByteScaleGPTModel``; its gradients are cleared.
    """
    inner = _unwrap(model)
    tokens = micro_batch.tokens.reshape(1, -1)
    positions = micro_batch.position_ids.reshape(1, -1)
    on_cuda = micro_batch.tokens.device.type == "cuda"
    best, activation = float("inf"), 0
    with manager.bind(micro_batch):
        for attempt in range(repeats + 1):
            with torch.no_grad():
                hidden = inner.embedding(input_ids=tokens, position_ids=positions)
            hidden = hidden.detach().requires_grad_(True)
            rotary = (
                inner.rotary_for_positions(positions)
                if inner.position_embedding_type == "rope"
                else None
            )
            grad = torch.ones_like(hidden)
            seconds, held = (
                _run_decoder_cuda(inner, hidden, rotary, grad)
                if on_cuda
                else _run_decoder_cpu(inner, hidden, rotary, grad, count=attempt == 0)
            )
            if attempt == 0:
                activation = held
            else:
                best = min(best, seconds)
    inner.zero_grad(set_to_none=True)
    return DecoderMeasurement(seconds=best, activation_bytes=int(activation))


def _run_decoder_cuda(inner, hidden, rotary, grad) -> tuple[float, int]:
    device = hidden.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = inner.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
    peak = torch.cuda.max_memory_allocated(device)  # the allocator counts at allocation time
    out.backward(grad)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, peak - baseline


def _run_decoder_cpu(inner, hidden, rotary, grad, *, count: bool) -> tuple[float, int]:
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in inner.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, storage.nbytes())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count else None
    clock = busy_clock()  # the clock the run's busy time uses
    start = clock()
    if hooks is not None:
        with hooks:
            out = inner.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
    else:
        out = inner.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
    out.backward(grad)
    return clock() - start, sum(saved.values())


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "decoder") or not hasattr(model, "embedding"):
        raise TypeError(
            f"calibration needs a GPT model with .embedding and .decoder (a ByteScaleGPTModel), "
            f"got {type(model).__name__}"
        )
    return model


def _model_device(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------- rings


DOCUMENTS_PER_SAMPLE = 32
"""Short documents in each many-document calibration micro-batch."""


def _measure_ring_samples(
    model: torch.nn.Module,
    manager: HDPGroupManager,
    *,
    lengths: Sequence[int],
    repeats: int,
    vocab_size: int,
    device: torch.device | None,
) -> list[tuple[int, int, int, float]]:
    """Time micro-batches on HDP ranks ``0..D-1``: ``(D, documents, tokens, seconds)`` on rank 0.

    Collective: every rank calls it (ranks outside a ring skip that case). For D = 2 and D =
    all ranks: one sequence of ``D * n`` tokens for ``n`` = half and all of the longest
    calibration length (capped so it fits the model's positions), so every member holds ``n``
    tokens, and :data:`DOCUMENTS_PER_SAMPLE` short documents of ``D * n`` tokens in all; and a
    local pack of as many documents of ``n`` tokens on rank 0. Other ranks return ``[]``.
    """
    hdp = manager.hdp
    if hdp.size < 2:
        return []
    generator = torch.Generator().manual_seed(4321)
    longest = max(int(n) for n in lengths)
    max_positions = int(getattr(_unwrap(model), "max_sequence_length", 0) or 0)
    cases: list[tuple[int, int, int]] = []  # (ring size, documents, tokens)
    for ring_size in sorted({2, hdp.size}):
        per_rank_max = min(longest, max_positions // ring_size) if max_positions else longest
        for per_rank in sorted({max(1, per_rank_max // 2), max(1, per_rank_max)}):
            cases.append((ring_size, 1, ring_size * per_rank))
        docs = min(DOCUMENTS_PER_SAMPLE, max(1, ring_size * per_rank_max // (2 * ring_size)))
        if docs > 1:
            cases.append((ring_size, docs, ring_size * per_rank_max))
    docs = min(DOCUMENTS_PER_SAMPLE, longest)
    if docs > 1:
        cases.append((1, docs, longest))
    samples: list[tuple[int, int, int, float]] = []
    for ring_size, docs, tokens in cases:
        parts = [tokens // docs + (1 if i < tokens % docs else 0) for i in range(docs)]
        seqs = [torch.randint(0, vocab_size, (n,), generator=generator) for n in parts]
        if hdp.rank >= ring_size:
            continue
        micro_batch = documents_micro_batch(manager, range(ring_size), seqs, device=device)
        measured = time_decoder(model, manager, micro_batch, repeats=repeats)
        samples.append((ring_size, docs, tokens, measured.seconds))
    return samples if hdp.rank == 0 else []


# ----------------------------------------------------------------------------- links


def measure_host_link(
    device: torch.device | str, *, num_bytes: int = 64 << 20, repeats: int = 3
) -> tuple[float, float]:
    """``(d2h, h2d)`` bytes/s between ``device`` and host memory, best of ``repeats``.

    CUDA: copies between a device buffer and a pinned host buffer, timed with CUDA events (the
    PCIe/C2C link that activation offload uses). CPU: a copy into a separate host buffer, which
    is what the CPU offload stand-in does instead.
    """
    device = torch.device(device)
    num_bytes = max(1, int(num_bytes))
    if device.type != "cuda":
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        rate = num_bytes / max(best, 1e-9)
        return rate, rate
    host = torch.ones(num_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def best_copy_s(dst: torch.Tensor, src: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    h2d = num_bytes / max(best_copy_s(dev, host), 1e-9)
    d2h = num_bytes / max(best_copy_s(host, dev), 1e-9)
    return d2h, h2d


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
                    dist.P2POp(dist.isend, send, peer, group=hdp.ring_group),
                    dist.P2POp(dist.irecv, recv, peer, group=hdp.ring_group),
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
