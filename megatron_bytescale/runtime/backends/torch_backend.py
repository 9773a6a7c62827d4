"""Attention backends in plain PyTorch: always available.

``torch``: on CPU the aten flash-attention kernels for CPU
(``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``), which return and
consume the log-sum-exp exactly like flash-attn's internal API and support GQA natively. On
other devices it falls back to ``math``.

``math``: a tiled (blockwise) attention in float32 matmuls. It never materialises more than a
``tile x tile`` score matrix per head, so it is the portable fallback for any device, and on
CPU it is the independent implementation tests compare the fused kernel path with.

Legend: S rows of one segment, N heads, H head dim (see :mod:`.base`).
"""

from __future__ import annotations

import torch

from ..online_softmax import merge_partial_attention
from .base import AttentionBackend, Segments


def _to_bnsh(x_SNH: torch.Tensor) -> torch.Tensor:
    """``[S, N, H]`` -> ``[1, N, S, H]`` view (the aten kernels take strided inputs)."""
    return x_SNH.transpose(0, 1).unsqueeze(0)


def _from_bnsh(x_1NSH: torch.Tensor) -> torch.Tensor:
    return x_1NSH[0].transpose(0, 1)


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-segment results along rows (no copy for a single segment)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _cpu_forward(q, k, v, causal: bool, scale: float):
    """One segment through the aten CPU flash kernel: ``(out [S, N, H], lse [S, N])``."""
    o_1NSH, lse_1NS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _to_bnsh(q), _to_bnsh(k), _to_bnsh(v), 0.0, causal, scale=scale
    )
    return _from_bnsh(o_1NSH), lse_1NS[0].transpose(0, 1)


def _cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """One segment's ``(dq, dk, dv)`` from the aten CPU flash backward, given final out/lse."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _to_bnsh(dout),
        _to_bnsh(q),
        _to_bnsh(k),
        _to_bnsh(v),
        _to_bnsh(out),
        lse.transpose(0, 1).contiguous().unsqueeze(0),
        0.0,
        causal,
        scale=scale,
    )
    return _from_bnsh(dq), _from_bnsh(dk), _from_bnsh(dv)


class TorchBackend(AttentionBackend):
    """aten CPU flash kernels on CPU (one call per segment), :class:`MathBackend` elsewhere."""

    name = "torch"

    def __init__(self) -> None:
        self._math = MathBackend()

    def forward(self, q, k, v, segments: Segments, *, causal: bool, scale: float):
        if q.device.type != "cpu":
            return self._math.forward(q, k, v, segments, causal=causal, scale=scale)
        outs, lses = [], []
        for qa, qb, ka, kb in segments:
            o, l = _cpu_forward(q[qa:qb], k[ka:kb], v[ka:kb], causal, scale)
            outs.append(o)
            lses.append(l)
        return _pack(outs), _pack(lses)

    def backward(self, dout, q, k, v, out, lse, segments: Segments, *, causal: bool, scale: float):
        if q.device.type != "cpu":
            return self._math.backward(
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
        return _pack(dqs), _pack(dks), _pack(dvs)


class MathBackend(AttentionBackend):
    """Tiled float32 attention from matmuls; exact up to rounding, any device.

    Args:
        tile: rows of q and k per tile; the score matrix per head is at most ``tile x tile``.
    """

    name = "math"

    def __init__(self, tile: int = 1024) -> None:
        if tile < 1:
            raise ValueError(f"tile ({tile}) must be >= 1")
        self.tile = tile

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _heads_first(x_SNH: torch.Tensor, groups: int) -> torch.Tensor:
        """float32 ``[N, S, H]``, k/v heads repeated ``groups`` times for GQA."""
        x = x_SNH.float().transpose(0, 1)
        return x.repeat_interleave(groups, dim=0) if groups > 1 else x

    def _tiles(self, sq: int, sk: int, causal: bool):
        for qs in range(0, sq, self.tile):
            qe = min(qs + self.tile, sq)
            for ks in range(0, sk, self.tile):
                if causal and ks >= qe:
                    break
                yield qs, qe, ks, min(ks + self.tile, sk)

    @staticmethod
    def _scores(q_NtH, k_NtH, scale, causal, qs, ks):
        s = torch.matmul(q_NtH, k_NtH.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(qs, qs + s.shape[-2], device=s.device).unsqueeze(-1)
            cols = torch.arange(ks, ks + s.shape[-1], device=s.device).unsqueeze(0)
            s = s.masked_fill(cols > rows, float("-inf"))
        return s

    # ------------------------------------------------------------------ one segment
    def _forward_segment(self, q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        q_N, k_N, v_N = (
            q.float().transpose(0, 1),
            self._heads_first(k, groups),
            self._heads_first(v, groups),
        )
        out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
        lse = torch.full(
            (q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device
        )
        for qs, qe, ks, ke in self._tiles(q.shape[0], k.shape[0], causal):
            s = self._scores(q_N[:, qs:qe], k_N[:, ks:ke], scale, causal, qs, ks)
            blk_lse = torch.logsumexp(s, dim=-1)  # [N, t]; -inf where a row sees no key here
            safe = torch.where(torch.isinf(blk_lse), torch.zeros_like(blk_lse), blk_lse)
            blk_out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v_N[:, ks:ke])
            merge_partial_attention(
                out[qs:qe], lse[qs:qe], blk_out.transpose(0, 1), blk_lse.transpose(0, 1)
            )
        return out.to(q.dtype), lse

    def _backward_segment(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        q_N, k_N, v_N = (
            q.float().transpose(0, 1),
            self._heads_first(k, groups),
            self._heads_first(v, groups),
        )
        do_N = dout.float().transpose(0, 1)
        lse_N = lse.float().transpose(0, 1)
        delta_N = (dout.float() * out.float()).sum(-1).transpose(0, 1)  # [N, S]
        dq = torch.zeros_like(q_N)
        dk = torch.zeros_like(k_N)
        dv = torch.zeros_like(v_N)
        for qs, qe, ks, ke in self._tiles(q.shape[0], k.shape[0], causal):
            s = self._scores(q_N[:, qs:qe], k_N[:, ks:ke], scale, causal, qs, ks)
            p = torch.exp(s - lse_N[:, qs:qe].unsqueeze(-1))
            dv[:, ks:ke] += torch.matmul(p.transpose(-1, -2), do_N[:, qs:qe])
            dp = torch.matmul(do_N[:, qs:qe], v_N[:, ks:ke].transpose(-1, -2))
            ds = p * (dp - delta_N[:, qs:qe].unsqueeze(-1)) * scale
            dq[:, qs:qe] += torch.matmul(ds, k_N[:, ks:ke])
            dk[:, ks:ke] += torch.matmul(ds.transpose(-1, -2), q_N[:, qs:qe])
        if groups > 1:
            n_kv = k.shape[1]
            dk = dk.view(n_kv, groups, *dk.shape[1:]).sum(1)
            dv = dv.view(n_kv, groups, *dv.shape[1:]).sum(1)
        return (
            dq.transpose(0, 1).to(q.dtype),
            dk.transpose(0, 1).to(k.dtype),
            dv.transpose(0, 1).to(v.dtype),
        )

    # ------------------------------------------------------------------ interface
    def forward(self, q, k, v, segments: Segments, *, causal: bool, scale: float):
        outs, lses = [], []
        for qa, qb, ka, kb in segments:
            o, l = self._forward_segment(q[qa:qb], k[ka:kb], v[ka:kb], causal, scale)
            outs.append(o)
            lses.append(l)
        return _pack(outs), _pack(lses)

    def backward(self, dout, q, k, v, out, lse, segments: Segments, *, causal: bool, scale: float):
        dqs, dks, dvs = [], [], []
        for qa, qb, ka, kb in segments:
            dq, dk, dv = self._backward_segment(
                dout[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], lse[qa:qb], causal, scale
            )
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        return _pack(dqs), _pack(dks), _pack(dvs)
