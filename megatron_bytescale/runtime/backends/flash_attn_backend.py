"""flash-attn varlen kernels (GPU, fp16/bf16), imported lazily.

Targets flash-attn >= 2.7, whose internal ``_flash_attn_varlen_forward`` returns
``(out, softmax_lse [N_q, T_q], S_dmask, rng_state)`` and whose ``_flash_attn_varlen_backward``
fills ``dq, dk, dv`` in place given the final out and lse - the same contract as our
:class:`~.base.AttentionBackend`. GQA is native. All segments of a block go into one varlen call.

Not exercised by the CPU test-suite (flash-attn needs CUDA); tests skip it with a reason.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from .base import AttentionBackend, Segments, fused_kernel_reason

_MIN_VERSION = (2, 7)
_HINT = (
    "attention backend 'flash_attn' needs flash-attn>={}.{} on a CUDA device "
    "(pip install flash-attn --no-build-isolation), or use backend='torch'"
).format(*_MIN_VERSION)


def _import_flash_attn() -> ModuleType:
    try:
        flash_attn = importlib.import_module("flash_attn")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as exc:
        raise ImportError(_HINT) from exc
    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2] if x.isdigit())
    if version < _MIN_VERSION:
        raise ImportError(f"{_HINT}; found flash-attn {flash_attn.__version__}")
    return interface


class FlashAttnBackend(AttentionBackend):
    """One ``flash_attn`` varlen call per block (all segments at once)."""

    name = "flash_attn"

    def __init__(self) -> None:
        self._fa = _import_flash_attn()

    def unsupported_reason(self, device, dtype, head_dim=None):
        return fused_kernel_reason("flash-attn", device, dtype, head_dim)

    @staticmethod
    def _check(q: torch.Tensor) -> None:
        if q.shape[-1] % 8 or q.shape[-1] > 256:
            raise ValueError(
                f"flash_attn backend needs a head dim that is a multiple of 8 and at most 256, "
                f"got {q.shape[-1]}"
            )

    def forward(self, q, k, v, segments: Segments, *, causal: bool, scale: float):
        self._check(q)
        cu_q, cu_k = segments.tensors(q.device)
        out, lse_NT, _, _ = self._fa._flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            segments.max_q,
            segments.max_k,
            **_varlen_options(scale, causal),
            return_softmax=False,
        )
        return out, lse_NT.transpose(0, 1)

    def backward(self, dout, q, k, v, out, lse, segments: Segments, *, causal: bool, scale: float):
        self._check(q)
        cu_q, cu_k = segments.tensors(q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_varlen_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse.transpose(0, 1).contiguous(),
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            segments.max_q,
            segments.max_k,
            **_varlen_options(scale, causal),
            deterministic=False,
            rng_state=None,
        )
        return dq, dk, dv


def _varlen_options(scale: float, causal: bool) -> dict:
    """Keyword arguments shared by flash-attn's varlen forward and backward (>= 2.7)."""
    return dict(
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
    )
