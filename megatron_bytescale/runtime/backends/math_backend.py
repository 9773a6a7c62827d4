"""``math``: tiled attention from matmuls, in float32 (float64 for float64 inputs), any device.

It never materialises more than a ``tile x tile`` score matrix per head, so it is the portable
fallback for any device, and on CPU it is the independent implementation the fused kernels are
tested against (in float64 it is the reference of ``scripts/gpu_check.py``). It is slow on a
GPU (10-50x a flash kernel): :func:`..get_backend` never picks it there without a warning.

Legend: S rows of one segment, N heads, H head dim (see :mod:`.base`).
"""

from __future__ import annotations

import torch

from ..online_softmax import merge_partial_attention
from .base import AttentionBackend, Segments, accumulation_dtype


def pack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-segment results along rows (no copy for a single segment)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


class MathBackend(AttentionBackend):
    """Tiled attention from matmuls in the accumulation dtype; exact up to rounding, any device.

    Args:
        tile: rows of q and k per tile; the score matrix per head is at most ``tile x tile``.
    """

    name = "math"

    def __init__(self, tile: int = 1024) -> None:
        if tile < 1:
            raise ValueError(f"tile ({tile}) must be >= 1")
        self.tile = tile

    def unsupported_reason(self, device, dtype, head_dim=None):
        if not dtype.is_floating_point:
            return f"needs floating-point inputs, got {dtype}"
        return None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _heads_first(x_SNH: torch.Tensor, groups: int, acc: torch.dtype) -> torch.Tensor:
        """``[N, S, H]`` in ``acc``, k/v heads repeated ``groups`` times for GQA."""
        x = x_SNH.to(acc).transpose(0, 1)
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
        acc = accumulation_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        q_N = q.to(acc).transpose(0, 1)
        k_N, v_N = self._heads_first(k, groups, acc), self._heads_first(v, groups, acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
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
        acc = accumulation_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        q_N = q.to(acc).transpose(0, 1)
        k_N, v_N = self._heads_first(k, groups, acc), self._heads_first(v, groups, acc)
        do_N = dout.to(acc).transpose(0, 1)
        lse_N = lse.to(acc).transpose(0, 1)
        delta_N = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)  # [N, S]
        dq, dk, dv = torch.zeros_like(q_N), torch.zeros_like(k_N), torch.zeros_like(v_N)
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
        return pack_rows(outs), pack_rows(lses)

    def backward(self, dout, q, k, v, out, lse, segments: Segments, *, causal: bool, scale: float):
        dqs, dks, dvs = [], [], []
        for qa, qb, ka, kb in segments:
            dq, dk, dv = self._backward_segment(
                dout[qa:qb], q[qa:qb], k[ka:kb], v[ka:kb], out[qa:qb], lse[qa:qb], causal, scale
            )
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        return pack_rows(dqs), pack_rows(dks), pack_rows(dvs)
