"""``torch``: PyTorch's own fused attention kernels, so no extra package is ever needed.

* CUDA (and ``meta``, for shape checks): PyTorch's FlashAttention-2 varlen kernels, one call per
  block with all its segments (:mod:`.torch_flash`); fp16/bf16, head dim a multiple of 8 and at
  most 256, sm80+.
* CPU: the aten CPU flash kernels (``_scaled_dot_product_flash_attention_for_cpu`` and its
  ``_backward``), one call per segment. They return and consume the log-sum-exp like
  flash-attn's internal API, support GQA natively, and run float32, float64, bf16 and fp16.

What the backend cannot run it names up front (:meth:`TorchBackend.unsupported_reason`), so a
ring never starts with a case that would fail in a kernel on one member and leave the others
waiting. Under ``auto`` the runtime then falls back to ``math`` with a warning.

Legend: S rows of one segment, N heads, H head dim (see :mod:`.base`).
"""

from __future__ import annotations

import torch

from .base import AttentionBackend, Segments, accumulation_dtype
from .math_backend import pack_rows
from .torch_flash import FlashVarlenKernels, flash_unsupported_reason

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _to_bnsh(x_SNH: torch.Tensor) -> torch.Tensor:
    """``[S, N, H]`` -> ``[1, N, S, H]`` view (the aten kernels take strided inputs)."""
    return x_SNH.transpose(0, 1).unsqueeze(0)


def _from_bnsh(x_1NSH: torch.Tensor) -> torch.Tensor:
    return x_1NSH[0].transpose(0, 1)


def _cpu_forward(q, k, v, causal: bool, scale: float):
    """One segment through the aten CPU flash kernel: ``(out [S, N, H], lse [S, N])``."""
    o_1NSH, lse_1NS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _to_bnsh(q), _to_bnsh(k), _to_bnsh(v), 0.0, causal, scale=scale
    )
    return _from_bnsh(o_1NSH), lse_1NS[0].transpose(0, 1)


def _cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """One segment's ``(dq, dk, dv)`` from the aten CPU flash backward, given final out/lse.

    The kernel reads the log-sum-exp in the accumulation dtype of q (float64 for float64 q):
    the ring hands it whatever it merged in, so convert here.
    """
    lse_1NS = lse.transpose(0, 1).to(accumulation_dtype(q.dtype)).contiguous().unsqueeze(0)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _to_bnsh(dout), _to_bnsh(q), _to_bnsh(k), _to_bnsh(v), _to_bnsh(out), lse_1NS,
        0.0, causal, scale=scale,
    )  # fmt: skip
    return _from_bnsh(dq), _from_bnsh(dk), _from_bnsh(dv)


class TorchBackend(AttentionBackend):
    """aten CPU flash kernels on CPU (per segment), aten flash varlen kernels on CUDA."""

    name = "torch"

    def __init__(self) -> None:
        self._flash = FlashVarlenKernels()

    def unsupported_reason(self, device, dtype, head_dim=None):
        device = torch.device(device)
        if device.type == "cpu":
            if dtype not in _CPU_DTYPES:
                return f"the aten CPU flash kernels run {[str(d) for d in _CPU_DTYPES]}, not {dtype}"
            return None
        return flash_unsupported_reason(device, dtype, head_dim)

    def forward(self, q, k, v, segments: Segments, *, causal: bool, scale: float):
        if q.device.type != "cpu":
            return self._flash.forward(q, k, v, segments, causal=causal, scale=scale)
        outs, lses = [], []
        for qa, qb, ka, kb in segments:
            o, l = _cpu_forward(q[qa:qb], k[ka:kb], v[ka:kb], causal, scale)
            outs.append(o)
            lses.append(l)
        return pack_rows(outs), pack_rows(lses)

    def backward(self, dout, q, k, v, out, lse, segments: Segments, *, causal: bool, scale: float):
        if q.device.type != "cpu":
            return self._flash.backward(
                dout, q, k, v, out, lse, segments, causal=causal, scale=scale
            )
        dqs, dks, dvs = [], [], []
        for qa, qb, ka, kb in segments:
            dq, dk, dv = _cpu_backward(
                dout[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], lse[qa:qb], causal, scale
            )
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        return pack_rows(dqs), pack_rows(dks), pack_rows(dvs)
