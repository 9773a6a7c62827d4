"""The ``torch`` backend's CUDA path (PyTorch's flash varlen kernels), checked without a GPU.

Two independent checks of the aten call forms:

* ``device="meta"``: the real ``aten::_flash_attention_forward/_backward`` schemas and PyTorch's
  own shape functions run our exact calls (positional arguments, keyword ``scale``, GQA, head
  dims 64/96/128, several segments, 1-token segments), through the backend and through a whole
  emulated ring (metadata staging included);
* a stand-in CPU kernel registered for those aten ops (``torch.library``) computes with the math
  backend and asserts what the real kernel assumes (int32 ``cu_seqlens``, maxima, no dropout, the
  lse layout), so argument mix-ups (cu_q/cu_k, max_q/max_k, lse transposed) give wrong numbers.

Plus the automatic backend order on CUDA and the one warning when it falls to ``math``, and the
one-process ring emulation (the public single-step API) against a float64 reference.
"""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

import megatron_bytescale.runtime.backends as backends
import megatron_bytescale.runtime.backends.torch_flash as torch_flash
from megatron_bytescale.planner import PlanBuilder, even_zigzag_split
from megatron_bytescale.runtime import (
    MathBackend,
    Segments,
    TorchBackend,
    emulate_ring_attention,
    get_backend,
    layout_for,
    resolve_backend,
)
from megatron_bytescale.runtime.backends.torch_flash import FlashVarlenKernels

from runtime_cases import compare_with_reference, global_tensors, local_inputs, scatter_results

_MATH = MathBackend()


def _relerr(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------------- meta: real schemas
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_call_forms_on_meta(dtype, head_dim, causal):
    seg = Segments(cu_q=(0, 1, 40, 41, 300), cu_k=(0, 1, 40, 41, 300)) if causal else Segments(
        cu_q=(0, 7, 8, 90), cu_k=(0, 30, 31, 45))  # fmt: skip
    tq, tk = seg.cu_q[-1], seg.cu_k[-1]
    q = torch.empty(tq, 32, head_dim, dtype=dtype, device="meta")  # GQA: 32 query, 8 kv heads
    k = torch.empty(tk, 8, head_dim, dtype=dtype, device="meta")
    backend = TorchBackend()
    assert backend.unsupported_reason(q.device, dtype, head_dim) is None
    out, lse = backend.forward(q, k, k, seg, causal=causal, scale=0.1)
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == "meta"
    assert lse.shape == (tq, 32) and lse.dtype == torch.float32
    dq, dk, dv = backend.backward(q, q, k, k, out, lse, seg, causal=causal, scale=0.1)
    assert dq.shape == q.shape and dk.shape == k.shape == dv.shape and dk.dtype == dtype


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 8])
def test_emulated_ring_runs_the_flash_calls_on_meta(ring_size):
    """The whole per-step path of the ring (metadata staging, blocks, merges, dK/dV hops) with
    the real aten schemas, as it would run on a GPU."""
    lengths = {0: 1, 1: 4096 + 37, 2: 700, 3: 3}
    builder = PlanBuilder(hdp_size=ring_size, capacity=10**9, lengths=lengths)
    builder.add(list(range(ring_size)), [0, 1, 2, 3])
    plan = builder.build(scheduler="t").validate()
    layouts = [layout_for(plan, r, 0) for r in range(ring_size)]

    def make(heads):
        return [torch.empty(l.num_tokens, heads, 128, dtype=torch.bfloat16, device="meta")
                for l in layouts]  # fmt: skip

    q, k, v, dout = make(32), make(8), make(8), make(32)
    result = emulate_ring_attention(q, k, v, layouts, dout, backend="torch", dkv_wire="input")
    for p, layout in enumerate(layouts):
        assert result.out[p].shape == q[p].shape and result.dk[p].shape == k[p].shape
        seg = [b for b in (layout.memo(("block", s), lambda: None) for s in range(ring_size)) if b]
        assert all(b.segments.has_tensors(torch.device("meta")) for b in seg)


# ---------------------------------------------------------------------- stand-in CPU kernels
@pytest.fixture
def aten_flash_on_cpu(monkeypatch):
    """Register CPU kernels for the aten flash ops that check their inputs and compute with
    the math backend; yields a dict that selects the lse layout (``padded``: torch 2.4)."""
    mode = {"padded": False, "calls": 0}

    def segments(cu_q, cu_k, max_q, max_k):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.dim() == cu_k.dim() == 1
        seg = Segments(cu_q=tuple(cu_q.tolist()), cu_k=tuple(cu_k.tolist()))
        assert (max_q, max_k) == (seg.max_q, seg.max_k), "max_q/max_k do not match cu_seqlens"
        return seg

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                alibi_slopes=None, block_table=None, num_splits=None):  # fmt: skip
        assert dropout_p == 0.0 and return_debug_mask is False and scale is not None
        assert q.dim() == 3 and q.shape[1] % k.shape[1] == 0 and q.stride(-1) == 1
        seg = segments(cu_q, cu_k, max_q, max_k)
        out, lse = _MATH.forward(q, k, v, seg, causal=is_causal, scale=scale)
        mode["calls"] += 1
        if mode["padded"]:
            grid = torch.full((seg.num, q.shape[1], seg.max_q), float("inf"))
            for b, (qa, qb, _, _) in enumerate(seg):
                grid[b, :, : qb - qa] = lse[qa:qb].t()
            lse_out = grid
        else:
            lse_out = lse.t().contiguous()
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse_out, rng, torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                 rng_state, unused, *, scale=None, window_size_left=None,
                 window_size_right=None):  # fmt: skip
        assert dropout_p == 0.0 and scale is not None and lse.dtype == torch.float32
        assert isinstance(rng_state, torch.Tensor) and isinstance(unused, torch.Tensor)
        seg = segments(cu_q, cu_k, max_q, max_k)
        assert lse.is_contiguous()
        if mode["padded"]:
            assert lse.shape == (seg.num, q.shape[1], seg.max_q)
            rows = torch.cat([lse[b, :, : qb - qa].t() for b, (qa, qb, _, _) in enumerate(seg)])
        else:
            assert lse.shape == (q.shape[1], q.shape[0]), "lse must be [N, T]"
            rows = lse.t()
        return _MATH.backward(dout, q, k, v, out, rows, seg, causal=is_causal, scale=scale)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", forward, "CPU")
    lib.impl("_flash_attention_backward", backward, "CPU")
    monkeypatch.setattr(torch_flash, "PADDED_LSE", False)
    try:
        yield mode
    finally:
        lib._destroy()


@pytest.mark.parametrize("padded", [False, True], ids=["torch>=2.5", "torch-2.4-padded-lse"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_calls_compute_the_right_thing(aten_flash_on_cpu, monkeypatch, padded, causal):
    aten_flash_on_cpu["padded"] = padded
    monkeypatch.setattr(torch_flash, "PADDED_LSE", padded)
    g = torch.Generator().manual_seed(3)
    seg = Segments(cu_q=(0, 37, 38, 105), cu_k=(0, 37, 38, 105)) if causal else Segments(
        cu_q=(0, 20, 21, 80), cu_k=(0, 33, 40, 47))  # fmt: skip
    q = torch.randn(seg.cu_q[-1], 6, 16, generator=g)
    k, v = (torch.randn(seg.cu_k[-1], 2, 16, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    kernels = FlashVarlenKernels()
    out, lse = kernels.forward(q, k, v, seg, causal=causal, scale=0.3)
    r_out, r_lse = _MATH.forward(q, k, v, seg, causal=causal, scale=0.3)
    assert lse.shape == q.shape[:2] and _relerr(out, r_out) < 1e-6 and _relerr(lse, r_lse) < 1e-6
    grads = kernels.backward(dout, q, k, v, out, lse, seg, causal=causal, scale=0.3)
    r_grads = _MATH.backward(dout, q, k, v, r_out, r_lse, seg, causal=causal, scale=0.3)
    for mine, ref in zip(grads, r_grads):
        assert mine.shape == ref.shape and _relerr(mine, ref) < 1e-6
    assert aten_flash_on_cpu["calls"] == 1  # one call for all segments of the block


# ---------------------------------------------------------------------- choice and refusals
def test_flash_gate_names_what_it_needs():
    meta = torch.device("meta")
    reason = torch_flash.flash_unsupported_reason
    assert reason(meta, torch.bfloat16, 128) is None and reason(meta, torch.float16, 256) is None
    assert "fp16 or bf16" in reason(meta, torch.float32, 128)
    assert "multiple of 8" in reason(meta, torch.bfloat16, 100)
    assert "at most 256" in reason(meta, torch.bfloat16, 264)
    assert "CUDA" in reason(torch.device("cpu"), torch.bfloat16, 128)
    with pytest.raises(ValueError, match=r"'torch' cannot run torch.float32 .*fp16 or bf16"):
        resolve_backend("torch", torch.empty(4, 2, 8, device="meta"))


def test_auto_order_on_cuda_and_one_warning_for_math(monkeypatch, caplog):
    """te -> flash_attn -> torch -> math: torch flash when it can run the case, else math with
    ONE warning that says why each faster backend was passed over and what to change."""
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch_flash, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    assert backends.AUTO_ORDER_CUDA == ("te", "flash_attn", "torch", "math")
    assert get_backend(device=cuda, dtype=torch.bfloat16, head_dim=128).name == "torch"
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        for _ in range(3):
            assert get_backend(device=cuda, dtype=torch.float32, head_dim=128).name == "math"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "torch: PyTorch's flash kernel needs fp16 or bf16" in warnings[0]
    assert "Fix: train in bf16" in warnings[0] and "flash_attn:" in warnings[0]
    monkeypatch.setattr(torch_flash, "_capability", lambda index: (7, 5))
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert get_backend(device=cuda, dtype=torch.bfloat16, head_dim=128).name == "math"
    assert "compute capability 8.0+, got 7.5" in caplog.records[-1].getMessage()


def test_cpu_auto_is_torch_for_every_float_dtype():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert get_backend(device="cpu", dtype=dtype, head_dim=8).name == "torch"


# ---------------------------------------------------------------------- one-process ring
def _emulated_errors(ring_size, dtype, *, backend=None, dkv_wire="accumulator", even=False,
                     seed=0):  # fmt: skip
    rng = random.Random(seed)
    lengths = {i: rng.randint(1, 9 * ring_size) for i in range(3)}
    lengths[3] = 1  # a 1-token sequence
    builder = PlanBuilder(hdp_size=ring_size, capacity=10**9, lengths=lengths)
    members = rng.sample(range(ring_size), ring_size)
    splits = {s: even_zigzag_split(n, ring_size) for s, n in lengths.items()} if even else None
    builder.add(members, [0, 1, 2, 3], splits=splits)
    plan = builder.build(scheduler="t").validate()
    data = global_tensors(seed, plan, 4, 2, 8, dtype)
    layouts = [layout_for(plan, r, 0) for r in members]
    inputs = [local_inputs(layout, data, fill=0.0) for layout in layouts]
    q, k, v, dout = ([x[n].to(dtype) for x in inputs] for n in ("q", "k", "v", "dout"))
    res = emulate_ring_attention(q, k, v, layouts, dout, backend=backend, dkv_wire=dkv_wire)
    per_rank = [[] for _ in range(ring_size)]
    for p, rank in enumerate(members):
        per_rank[rank] = [scatter_results(layouts[p], dict(out=res.out[p], dq=res.dq[p],
                                                           dk=res.dk[p], dv=res.dv[p]))]
    return compare_with_reference(plan, per_rank, seed, 4, 2, 8, dtype=dtype)


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 8])
def test_emulated_ring_matches_reference(ring_size):
    for even in (False, True):
        errs = _emulated_errors(ring_size, torch.float32, even=even, seed=ring_size)
        assert max(errs.values()) <= 1e-5, (even, errs)
    errs = _emulated_errors(ring_size, torch.float64, seed=ring_size)
    assert max(errs.values()) <= 1e-12, errs  # float64 accumulates in float64 end to end
    errs = _emulated_errors(ring_size, torch.float64, backend="math", seed=ring_size)
    assert max(errs.values()) <= 1e-12, errs
    for wire in ("accumulator", "input"):  # bf16 kernels: a few 1e-3 (max-norm, tiny shapes;
        errs = _emulated_errors(ring_size, torch.bfloat16, dkv_wire=wire, seed=ring_size)
        assert max(errs.values()) <= 2e-2, (wire, errs)  # scripts/bench_ring_numerics.py measures)


def test_emulation_refuses_mismatched_layouts():
    builder = PlanBuilder(hdp_size=2, capacity=100, lengths={0: 9})
    builder.add([0, 1], [0])
    layouts = [layout_for(builder.build(scheduler="t"), r, 0) for r in (1, 0)]
    x = [torch.zeros(l.num_tokens, 2, 8) for l in layouts]
    with pytest.raises(ValueError, match=r"layouts\[0\] is for position 1"):
        emulate_ring_attention(x, x, x, layouts)
    with pytest.raises(ValueError, match="dkv wire dtype 'fp8'"):
        emulate_ring_attention(x, x, x, layouts[::-1], x, dkv_wire="fp8")
