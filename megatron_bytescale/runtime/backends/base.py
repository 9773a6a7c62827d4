"""The interface every attention kernel backend implements.

Legend (shape suffixes, as in the rest of the runtime):
    T  packed tokens (rows) of several segments, N  heads, H  head dim.

One call computes one *block* of ring attention: several independent segments packed along T
(the varlen convention of flash-attn: segment i of q attends only to segment i of k/v, with
boundaries in ``cu_q``/``cu_k``), all causal or all non-causal. "Causal" is top-left aligned
and only used with ``len(q_i) == len(k_i)``. The forward returns the output and the
log-sum-exp of every (row, head) - the statistic the ring merges partial results with - and the
backward takes the *final* (merged) output and log-sum-exp, which makes its per-block
gradients exact (the flash-attention backward identity).

The log-sum-exp is float32 (float64 for float64 inputs: :func:`accumulation_dtype`); a backward
accepts it in either and converts it to what its kernel wants. A backend names what it cannot
run (:meth:`AttentionBackend.unsupported_reason`) so that callers refuse it before any rank
starts communicating, instead of failing half-way through a ring.

Device metadata: ``cu_q``/``cu_k`` live on the host (tuples). Kernels that want them on the
device get them from :meth:`Segments.tensors`, which the ring fills for a whole micro-batch at
once from pinned memory (one non-blocking copy, :func:`..ring_schedule.prepare_device_metadata`)
so that no kernel call waits for a host-to-device copy.

GQA: k/v may have fewer heads than q (a divisor); q head h uses k/v head ``h // (Nq // Nkv)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import torch


def fused_kernel_reason(
    kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int | None,
    *, devices: tuple[str, ...] = ("cuda",),
) -> str | None:  # fmt: skip
    """Why a fused flash-style kernel (fp16/bf16, head dim a multiple of 8 and at most 256, on
    ``devices``) cannot run a case; None if it can."""
    kind = torch.device(device).type
    if kind not in devices:
        return f"{kernel} runs on CUDA, not {kind}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{kernel} needs fp16 or bf16, got {dtype} (train with --bf16)"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"{kernel} needs a head dim that is a multiple of 8 and at most 256, got {head_dim}"
    return None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial results of ``dtype`` inputs accumulate: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, kw_only=True)
class Segments:
    """Boundaries of the packed segments of one block (cumulative offsets, starting at 0)."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    _tensors: dict = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.cu_q) != len(self.cu_k) or len(self.cu_q) < 2:
            raise ValueError(
                f"segments need matching cu_q/cu_k of length >= 2, got {self.cu_q} / {self.cu_k}"
            )

    @property
    def num(self) -> int:
        return len(self.cu_q) - 1

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))

    def __iter__(self) -> Iterator[tuple[int, int, int, int]]:
        """Yield ``(q_start, q_end, k_start, k_end)`` per segment."""
        for i in range(self.num):
            yield self.cu_q[i], self.cu_q[i + 1], self.cu_k[i], self.cu_k[i + 1]

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_q, cu_k)`` as int32 tensors on ``device``, for varlen kernels.

        Served from what :meth:`install` put there; otherwise built here once with one
        non-blocking copy (the ring installs them ahead for a whole micro-batch).
        """
        key = str(device)
        if key not in self._tensors:
            host = torch.tensor([self.cu_q, self.cu_k], dtype=torch.int32)
            self._tensors[key] = tuple(host_to_device(host, device).unbind(0))
        return self._tensors[key]

    def install(self, device: torch.device, cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
        """Provide ``(cu_q, cu_k)`` on ``device`` (views of a buffer copied for many blocks)."""
        if cu_q.numel() != len(self.cu_q) or cu_k.numel() != len(self.cu_k):
            raise ValueError(
                f"installed cu_seqlens have {cu_q.numel()}/{cu_k.numel()} entries, the segments "
                f"{len(self.cu_q)}/{len(self.cu_k)}"
            )
        self._tensors[str(device)] = (cu_q, cu_k)

    def has_tensors(self, device: torch.device) -> bool:
        return str(device) in self._tensors

    def padded_rows(self, device: torch.device) -> torch.Tensor:
        """Row ``b * max_q + j`` of every token (segment b, row j) in a padded ``[B, max_q]``
        grid, on ``device`` (cached): converts padded per-segment statistics to packed rows."""
        key = f"padded_rows:{device}"
        if key not in self._tensors:
            rows = [b * self.max_q + j for b, (qa, qb, _, _) in enumerate(self) for j in range(qb - qa)]
            self._tensors[key] = host_to_device(torch.tensor(rows, dtype=torch.long), device)
        return self._tensors[key]


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without the host waiting for the copy.

    On CUDA the values go through pinned memory with ``non_blocking=True``: a pageable copy
    would synchronise the host with the device (a stall per block, and an error under
    ``torch.cuda.set_sync_debug_mode("error")``). PyTorch's caching host allocator keeps the
    pinned block until the copy's stream has passed it, so ``host`` may be dropped at once.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    if device.type == "cpu":
        return host  # already there: no copy at all
    return host.to(device)


class AttentionBackend(ABC):
    """A kernel provider for ring-attention blocks; see the module docstring for the contract.

    Shapes: q/out/dout ``[T_q, N_q, H]``, k/v ``[T_k, N_kv, H]``, lse ``[T_q, N_q]`` in
    :func:`accumulation_dtype`. ``out`` has the dtype of q; gradients have the dtypes and shapes
    of their inputs.
    """

    name: ClassVar[str]

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Segments,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every segment: ``(out [T_q, N_q, H], lse [T_q, N_q] float32)``."""

    @abstractmethod
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        segments: Segments,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this block given the final ``out`` and ``lse`` of its rows."""

    def unsupported_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None
    ) -> str | None:
        """Why this backend cannot run ``dtype`` with ``head_dim`` on ``device``; None if it can."""
        return None

    def supports(
        self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None
    ) -> bool:
        """Whether this backend can run on ``device`` with ``dtype`` (and ``head_dim``)."""
        return self.unsupported_reason(torch.device(device), dtype, head_dim) is None
