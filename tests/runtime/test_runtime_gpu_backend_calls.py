"""How the GPU backends call their libraries, checked on CPU against stand-in modules.

flash-attn and Transformer Engine need CUDA, so their kernels never run here. These tests put
stand-ins with the upstream *signatures and output conventions* into ``sys.modules`` (the
stand-ins compute with :class:`MathBackend`) and check that the backends pass what the
libraries expect: THD ``cu_seqlens_*_padded`` for TE (cuDNN reads its ragged offsets from
them), TE 2.15's changed ``fused_attn_bwd`` arguments and ``o_format``, TE's packed softmax
statistics with more rows than tokens, and flash-attn's ``[N, T]`` log-sum-exp.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Optional

import pytest
import torch

from megatron_bytescale.runtime import MathBackend, Segments

_MATH = MathBackend()


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor) -> Segments:
    return Segments(cu_q=tuple(cu_q.tolist()), cu_k=tuple(cu_k.tolist()))


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seg = Segments(cu_q=(0, 37, 40, 105), cu_k=(0, 37, 40, 105))
    q = torch.randn(105, 6, 16, generator=g)
    k = torch.randn(105, 2, 16, generator=g)
    v = torch.randn(105, 2, 16, generator=g)
    dout = torch.randn(105, 6, 16, generator=g)
    return q, k, v, dout, seg


def _relerr(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------------- Transformer Engine
def _te_modules(new_api: bool) -> dict[str, types.ModuleType]:
    """Stand-ins for TE 2.0-2.14 (``new_api=False``) or TE >= 2.15 (``new_api=True``)."""

    def check_thd(qkv_layout, cu_q_padded, cu_kv_padded, formats):
        if qkv_layout != "thd_thd_thd":
            raise AssertionError(f"qkv_layout {qkv_layout}")
        if cu_q_padded is None or cu_kv_padded is None:  # cuDNN: null ragged-offset pointers
            raise RuntimeError("THD needs cu_seqlens_q_padded and cu_seqlens_kv_padded")
        for name, value in formats.items():
            if not value.startswith("thd"):
                raise RuntimeError(f"{name}={value!r} with a THD layout")

    def fwd_body(max_q, max_kv, cu_q, cu_kv, q, k, v, fake_dtype, backend, cu_q_padded,
                 cu_kv_padded, attn_scale, qkv_layout, attn_mask_type, formats):
        assert isinstance(fake_dtype, torch.dtype) and backend == "F16_arbitrary_seqlen"
        assert all(t.is_contiguous() for t in (q, k, v)), "TE reads THD tensors by pointer"
        check_thd(qkv_layout, cu_q_padded, cu_kv_padded, formats)
        seg = _segments(cu_q, cu_kv)
        out, lse = _MATH.forward(q, k, v, seg, causal="causal" in attn_mask_type, scale=attn_scale)
        rows = max(1024, 1 << math.ceil(math.log2(q.shape[0])))  # TE < 2.15: get_max_tokens
        stats = torch.full((rows, q.shape[1], 1), 123.0)
        stats[: q.shape[0], :, 0] = lse
        return out, [stats, torch.zeros(2, dtype=torch.int64)]

    def bwd_body(cu_q, cu_kv, q, k, v, o, d_o, fake_dtype, aux, backend, cu_q_padded,
                 cu_kv_padded, attn_scale, qkv_layout, attn_mask_type, formats):
        assert isinstance(fake_dtype, torch.dtype), f"fake_dtype is {fake_dtype!r}"
        assert isinstance(aux, list) and backend == "F16_arbitrary_seqlen", (aux, backend)
        assert all(t.is_contiguous() for t in (q, k, v, o, d_o)), "TE reads THD tensors by pointer"
        check_thd(qkv_layout, cu_q_padded, cu_kv_padded, formats)
        stats = aux[0]
        assert stats.dim() == 3 and stats.shape[0] >= q.shape[0]
        seg = _segments(cu_q, cu_kv)
        lse = stats[: q.shape[0], :, 0]
        causal = "causal" in attn_mask_type
        return [*_MATH.backward(d_o, q, k, v, o, lse, seg, causal=causal, scale=attn_scale), None]

    if new_api:

        def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                           q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                           cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                           page_table_k=None, page_table_v=None, s_quantizer=None,
                           o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
                           qkv_layout="sbh3d", o_format="sbhd", qkv_scale_inv_format=None,
                           attn_bias_type="no_bias", attn_mask_type="padding",
                           softmax_type="vanilla", window_size=(-1, -1),
                           bottom_right_diagonal=None, rng_gen=None, softmax_offset=None,
                           return_max_logit=False, cuda_graph=False):
            return fwd_body(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                            fake_dtype, fused_attention_backend, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded, attn_scale, qkv_layout, attn_mask_type,
                            {"o_format": o_format})

        def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o,
                           d_o, fake_dtype, aux_ctx_tensors, fused_attention_backend,
                           cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                           s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                           attn_scale=None, dropout=0.0, fast_zero_fill=True,
                           qkv_layout="sbh3d", o_format="sbhd", do_format="sbhd",
                           dqkv_layout="sbh3d", qkv_scale_inv_format=None,
                           do_scale_inv_format=None, attn_bias_type="no_bias",
                           attn_mask_type="padding", softmax_type="vanilla",
                           window_size=(-1, -1), bottom_right_diagonal=None,
                           deterministic=False, cuda_graph=False):
            return bwd_body(cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                            aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded, attn_scale, qkv_layout, attn_mask_type,
                            {"o_format": o_format, "do_format": do_format,
                             "dqkv_layout": dqkv_layout})

    else:

        def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv,
                           q, k, v, fake_dtype, fused_attention_backend, attn_bias=None,
                           cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                           page_table_k=None, page_table_v=None, s_quantizer=None,
                           o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
                           qkv_layout="sbh3d", attn_bias_type="no_bias",
                           attn_mask_type="padding", window_size=(-1, -1), rng_gen=None):
            return fwd_body(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                            fake_dtype, fused_attention_backend, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded, attn_scale, qkv_layout, attn_mask_type, {})

        def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o,
                           d_o, fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
                           cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                           s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                           attn_scale=None, dropout=0.0, fast_zero_fill=True,
                           qkv_layout="sbh3d", attn_bias_type="no_bias",
                           attn_mask_type="padding", window_size=(-1, -1), deterministic=False):
            assert dqkv_dtype == "DType.kFloat32", dqkv_dtype
            return bwd_body(cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                            aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded, attn_scale, qkv_layout, attn_mask_type, {})

    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.18.0" if new_api else "2.8.0"
    ext = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    ext.fused_attn_fwd, ext.fused_attn_bwd = fused_attn_fwd, fused_attn_bwd
    tex = types.ModuleType("transformer_engine_torch")
    tex.NVTE_Fused_Attn_Backend = types.SimpleNamespace(
        NVTE_F16_arbitrary_seqlen="F16_arbitrary_seqlen"
    )
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = {torch.float32: "DType.kFloat32"}
    return {
        "transformer_engine": te,
        "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
        "transformer_engine.pytorch.cpp_extensions": types.ModuleType(
            "transformer_engine.pytorch.cpp_extensions"
        ),
        "transformer_engine.pytorch.cpp_extensions.fused_attn": ext,
        "transformer_engine.pytorch.constants": constants,
        "transformer_engine_torch": tex,
    }


@pytest.mark.parametrize("new_api", [False, True], ids=["te-2.0-2.14", "te-2.15+"])
def test_te_backend_calls_match_transformer_engine(monkeypatch, new_api):
    for name, module in _te_modules(new_api).items():
        monkeypatch.setitem(sys.modules, name, module)
    from megatron_bytescale.runtime.backends.te_backend import TEBackend

    backend = TEBackend()
    q, k, v, dout, seg = _case()
    q, k = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k))  # strided views
    scale = 0.25
    out, lse = backend.forward(q, k, v, seg, causal=True, scale=scale)
    r_out, r_lse = _MATH.forward(q, k, v, seg, causal=True, scale=scale)
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    assert _relerr(out, r_out) <= 1e-6 and _relerr(lse, r_lse) <= 1e-6
    grads = backend.backward(dout, q, k, v, out, lse, seg, causal=True, scale=scale)
    r_grads = _MATH.backward(dout, q, k, v, r_out, r_lse, seg, causal=True, scale=scale)
    for mine, ref in zip(grads, r_grads):
        assert mine.shape == ref.shape and _relerr(mine, ref) <= 1e-6


# ---------------------------------------------------------------------- flash-attn
def _flash_attn_modules() -> dict[str, types.ModuleType]:
    """Stand-ins for flash-attn 2.7/2.8's internal varlen API."""

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                   max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                                   causal: bool, window_size_left: int = -1,
                                   window_size_right: int = -1, softcap: float = 0.0,
                                   alibi_slopes: Optional[torch.Tensor] = None,
                                   return_softmax: bool = False, block_table=None,
                                   leftpad_k=None, seqused_k=None, zero_tensors: bool = False):
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        seg = _segments(cu_seqlens_q, cu_seqlens_k)
        assert (max_seqlen_q, max_seqlen_k) == (seg.max_q, seg.max_k)
        out, lse = _MATH.forward(q, k, v, seg, causal=causal, scale=softmax_scale)
        return out, lse.transpose(0, 1).contiguous(), torch.empty(0), torch.zeros(2)

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float, softmax_scale: float, causal: bool,
                                    window_size_left: int, window_size_right: int,
                                    softcap: float, alibi_slopes, deterministic: bool,
                                    rng_state=None, zero_tensors: bool = False):
        assert out.dtype == q.dtype and dout.dtype == q.dtype
        assert softmax_lse.shape == (q.shape[1], q.shape[0]) and softmax_lse.is_contiguous()
        seg = _segments(cu_seqlens_q, cu_seqlens_k)
        grads = _MATH.backward(dout, q, k, v, out, softmax_lse.transpose(0, 1), seg,
                               causal=causal, scale=softmax_scale)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g)
        return torch.empty(0)

    flash_attn = types.ModuleType("flash_attn")
    flash_attn.__version__ = "2.8.3"
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward = _flash_attn_varlen_forward
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    return {"flash_attn": flash_attn, "flash_attn.flash_attn_interface": interface}


def test_flash_attn_backend_calls_match_flash_attn(monkeypatch):
    for name, module in _flash_attn_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    from megatron_bytescale.runtime.backends.flash_attn_backend import FlashAttnBackend

    backend = FlashAttnBackend()
    q, k, v, dout, seg = _case(1)
    out, lse = backend.forward(q, k, v, seg, causal=True, scale=0.25)
    r_out, r_lse = _MATH.forward(q, k, v, seg, causal=True, scale=0.25)
    assert lse.shape == q.shape[:2] and _relerr(out, r_out) <= 1e-6 and _relerr(lse, r_lse) <= 1e-6
    grads = backend.backward(dout, q, k, v, out, lse, seg, causal=True, scale=0.25)
    r_grads = _MATH.backward(dout, q, k, v, r_out, r_lse, seg, causal=True, scale=0.25)
    for mine, ref in zip(grads, r_grads):
        assert _relerr(mine, ref) <= 1e-6
