"""Transformer Engine fused attention (cuDNN, GPU, fp16/bf16), imported lazily. Optional.

Uses TE's low-level ``fused_attn_fwd``/``fused_attn_bwd`` (TE >= 2.0) with the ``thd_thd_thd``
layout and the F16 arbitrary-seqlen cuDNN backend - the same calls TE's own context-parallel
code makes per ring step. THD needs ``cu_seqlens_*_padded`` (cuDNN reads its ragged offsets
from them; TE's own attention passes ``cu_seqlens`` when nothing is padded, as here). TE 2.15
dropped ``fused_attn_bwd``'s positional ``dqkv_dtype`` and added ``o_format``/``do_format``/
``dqkv_layout`` (default sbhd); the signature decides which call is made. cuDNN returns the
softmax statistics either packed ``[T', N, 1]`` (cuDNN >= 9.6 with THD; before TE 2.15 ``T'`` is
``T`` rounded up to a bucket, the first ``T`` rows are ours) or padded ``[B, N, max_q, 1]``;
both are converted to and from our ``lse [T, N]`` here and nowhere else.

Not exercised by the CPU test-suite (TE needs CUDA); tests skip it with a reason. Prefer
``flash_attn`` where both are installed.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from .base import AttentionBackend, Segments, fused_kernel_reason

_HINT = (
    "attention backend 'te' needs transformer-engine[pytorch]>=2.0 on a CUDA device "
    "(pip install --no-build-isolation 'transformer-engine[pytorch]'), or use backend='flash_attn' "
    "or backend='torch'"
)


class TEBackend(AttentionBackend):
    """One TE fused-attention call per block (all segments at once, THD layout)."""

    name = "te"

    def __init__(self) -> None:
        try:
            te = importlib.import_module("transformer_engine")
            self._ext = importlib.import_module(
                "transformer_engine.pytorch.cpp_extensions.fused_attn"
            )
            self._tex = importlib.import_module("transformer_engine_torch")
            self._te_dtype = importlib.import_module(
                "transformer_engine.pytorch.constants"
            ).TE_DType
        except (ImportError, RuntimeError) as exc:  # TE's empty meta-package raises RuntimeError
            raise ImportError(_HINT) from exc
        if int(str(te.__version__).split(".")[0]) < 2:
            raise ImportError(f"{_HINT}; found transformer-engine {te.__version__}")
        self._fused_backend = self._tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
        # TE >= 2.15: no dqkv_dtype argument; output/gradient formats default to sbhd
        bwd_parameters = inspect.signature(self._ext.fused_attn_bwd).parameters
        self._explicit_formats = "o_format" in bwd_parameters

    def unsupported_reason(self, device, dtype, head_dim=None):
        return fused_kernel_reason("Transformer Engine's fused attention", device, dtype, head_dim)

    # ------------------------------------------------------------------ lse format
    @staticmethod
    def _stats_to_lse(stats: torch.Tensor, segments: Segments) -> torch.Tensor:
        total = segments.cu_q[-1]
        if stats.dim() == 3:  # packed [T', N, 1], T' >= T (older TE rounds T' up)
            return stats[:total, :, 0].float()
        lse = stats.new_empty((total, stats.shape[1]), dtype=torch.float32)  # padded [B, N, S, 1]
        for i, (qa, qb, _, _) in enumerate(segments):
            lse[qa:qb] = stats[i, :, : qb - qa, 0].transpose(0, 1)
        return lse

    @staticmethod
    def _lse_to_stats(lse: torch.Tensor, segments: Segments, packed: bool) -> torch.Tensor:
        if packed:
            return lse.unsqueeze(-1).contiguous()
        stats = lse.new_zeros((segments.num, lse.shape[1], segments.max_q, 1))
        for i, (qa, qb, _, _) in enumerate(segments):
            stats[i, :, : qb - qa, 0] = lse[qa:qb].transpose(0, 1)
        return stats

    def _mask(self, causal: bool) -> str:
        return "padding_causal" if causal else "padding"

    def _thd_options(self, cu_q, cu_k, scale: float, causal: bool) -> dict:
        """Keyword arguments shared by fused_attn_fwd and fused_attn_bwd for packed THD.

        ``cu_seqlens_*_padded`` are the per-sequence offsets cuDNN reads in THD layouts; with
        no padding between sequences they equal ``cu_seqlens``.
        """
        return dict(
            cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout="thd_thd_thd",
            attn_bias_type="no_bias",
            attn_mask_type=self._mask(causal),
        )

    # ------------------------------------------------------------------ interface
    def forward(self, q, k, v, segments: Segments, *, causal: bool, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # TE reads [T, N, H] by pointer
        cu_q, cu_k = segments.tensors(q.device)
        out, aux = self._ext.fused_attn_fwd(
            True,
            segments.max_q,
            segments.max_k,
            cu_q,
            cu_k,
            q,
            k,
            v,
            q.dtype,
            self._fused_backend,
            **self._thd_options(cu_q, cu_k, scale, causal),
            **({"o_format": "thd"} if self._explicit_formats else {}),
        )
        stats = aux[0]
        self._packed = stats.dim() == 3
        return out, self._stats_to_lse(stats, segments)

    def backward(self, dout, q, k, v, out, lse, segments: Segments, *, causal: bool, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cu_q, cu_k = segments.tensors(q.device)
        stats = self._lse_to_stats(lse, segments, getattr(self, "_packed", True))
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused: no dropout
        if self._explicit_formats:
            dtypes = (q.dtype,)
            formats = {"o_format": "thd", "do_format": "thd", "dqkv_layout": "thd_thd_thd"}
        else:
            dtypes, formats = (q.dtype, self._te_dtype[q.dtype]), {}
        grads = self._ext.fused_attn_bwd(
            segments.max_q,
            segments.max_k,
            cu_q,
            cu_k,
            q,
            k,
            v,
            out.contiguous(),
            dout.contiguous(),
            *dtypes,
            [stats, rng_state],
            self._fused_backend,
            **self._thd_options(cu_q, cu_k, scale, causal),
            **formats,
        )
        return grads[0], grads[1], grads[2]
