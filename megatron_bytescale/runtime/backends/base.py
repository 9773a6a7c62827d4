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

GQA: k/v may have fewer heads than q (a divisor); q head h uses k/v head ``h // (Nq // Nkv)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch


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

    def __iter__(self):
        """Yield ``(q_start, q_end, k_start, k_end)`` per segment."""
        for i in range(self.num):
            yield self.cu_q[i], self.cu_q[i + 1], self.cu_k[i], self.cu_k[i + 1]

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_q, cu_k)`` as int32 tensors on ``device`` (cached), for varlen kernels."""
        key = str(device)
        if key not in self._tensors:
            self._tensors[key] = (
                torch.tensor(self.cu_q, dtype=torch.int32, device=device),
                torch.tensor(self.cu_k, dtype=torch.int32, device=device),
            )
        return self._tensors[key]


class AttentionBackend(ABC):
    """A kernel provider for ring-attention blocks; see the module docstring for the contract.

    Shapes: q/out/dout ``[T_q, N_q, H]``, k/v ``[T_k, N_kv, H]``, lse ``[T_q, N_q]`` float32.
    ``out`` has the dtype of q; gradients have the dtypes and shapes of their inputs.
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

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this backend can run on ``device`` with ``dtype`` (used for clear errors)."""
        return True
