"""Kernel backends, the online-softmax merge and the P2P formula, without processes.

Reference: float64 attention with autograd (plain matmul + softmax) per segment.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_bytescale.runtime import (
    BACKEND_NAMES,
    MathBackend,
    Segments,
    TorchBackend,
    get_backend,
    merge_partial_attention,
    plan_p2p_bytes,
    ring_attention_p2p_bytes,
)

from runtime_cases import scheduler_plan

TOL = 1e-5


def _reference_segment(q, k, v, dout, causal, scale):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qnh,knh->nqk", q, ke) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1).transpose(0, 1)
    out = torch.einsum("nqk,knh->qnh", torch.softmax(s, -1), ve)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _relerr(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _segments_case(causal: bool, n_q: int, n_kv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if causal:
        seg = [(0, 37, 0, 37), (37, 40, 37, 40), (40, 105, 40, 105)]
    else:
        seg = [(0, 20, 0, 33), (20, 21, 33, 40), (21, 80, 40, 47)]
    tq, tk = seg[-1][1], seg[-1][3]
    q = torch.randn(tq, n_q, 16, generator=g)
    k = torch.randn(tk, n_kv, 16, generator=g)
    v = torch.randn(tk, n_kv, 16, generator=g)
    dout = torch.randn(tq, n_q, 16, generator=g)
    segments = Segments(cu_q=(0, *(s[1] for s in seg)), cu_k=(0, *(s[3] for s in seg)))
    return q, k, v, dout, segments, seg


@pytest.mark.parametrize(
    "backend",
    [
        TorchBackend(),
        MathBackend(),
        MathBackend(tile=7),
    ],
    ids=["torch", "math", "math-tile7"],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_backend_matches_reference(backend, causal, heads):
    q, k, v, dout, segments, seg = _segments_case(causal, *heads)
    scale = 0.7 / math.sqrt(q.shape[-1])
    out, lse = backend.forward(q, k, v, segments, causal=causal, scale=scale)
    assert (
        out.shape == q.shape
        and out.dtype == q.dtype
        and lse.shape == q.shape[:2]
        and lse.dtype == torch.float32
    )
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, segments, causal=causal, scale=scale)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for qa, qb, ka, kb in seg:
        r_out, r_lse, r_dq, r_dk, r_dv = _reference_segment(
            q[qa:qb], k[ka:kb], v[ka:kb], dout[qa:qb], causal, scale
        )
        for name, mine, ref in (
            ("out", out[qa:qb], r_out),
            ("lse", lse[qa:qb], r_lse),
            ("dq", dq[qa:qb], r_dq),
            ("dk", dk[ka:kb], r_dk),
            ("dv", dv[ka:kb], r_dv),
        ):
            assert _relerr(mine, ref) <= TOL, (name, _relerr(mine, ref))


def test_merge_is_exact_in_any_order():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(9, 2, 8, generator=g),
        torch.randn(30, 2, 8, generator=g),
        torch.randn(30, 2, 8, generator=g),
    )
    backend = TorchBackend()
    scale = 1 / math.sqrt(8)
    full_out, full_lse = backend.forward(
        q, k, v, Segments(cu_q=(0, 9), cu_k=(0, 30)), causal=False, scale=scale
    )
    blocks = [(0, 4), (4, 21), (21, 30)]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        out = torch.zeros(9, 2, 8)
        lse = torch.full((9, 2), float("-inf"))
        for i in order:
            a, b = blocks[i]
            o, l = backend.forward(
                q, k[a:b], v[a:b], Segments(cu_q=(0, 9), cu_k=(0, b - a)), causal=False, scale=scale
            )
            merge_partial_attention(out, lse, o, l)
        assert _relerr(out, full_out.double()) <= TOL and _relerr(lse, full_lse.double()) <= TOL


def test_get_backend_choices_and_errors():
    assert get_backend(device="cpu").name == "torch"
    assert get_backend("math").name == "math"
    assert set(BACKEND_NAMES) == {"torch", "math", "flash_attn", "te"}
    with pytest.raises(ValueError, match=r"unknown attention backend 'cuDNN'.*torch"):
        get_backend("cuDNN")


@pytest.mark.parametrize("name", ["flash_attn", "te"])
def test_optional_backend_import_error_names_alternative(name):
    try:
        get_backend(name)
    except ImportError as exc:
        assert "backend='torch'" in str(exc) and "pip install" in str(exc)
    else:
        pytest.skip(f"{name} is installed here; the missing-package message cannot be checked")


@pytest.mark.parametrize("name", ["flash_attn", "te"])
def test_gpu_backend_matches_torch_backend(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        backend = get_backend(name)
    except ImportError as exc:
        pytest.skip(f"{name} not installed: {exc}")
    q, k, v, dout, segments, _ = _segments_case(True, 8, 2)
    q, k, v, dout = (t.cuda().bfloat16() for t in (q, k, v, dout))
    ref = MathBackend()
    scale = 1 / math.sqrt(16)
    out, lse = backend.forward(q, k, v, segments, causal=True, scale=scale)
    r_out, r_lse = ref.forward(q, k, v, segments, causal=True, scale=scale)
    assert _relerr(out, r_out.double()) < 2e-2 and _relerr(lse, r_lse.double()) < 1e-2
    grads = backend.backward(dout, q, k, v, out, lse, segments, causal=True, scale=scale)
    r_grads = ref.backward(dout, q, k, v, out, lse, segments, causal=True, scale=scale)
    for mine, theirs in zip(grads, r_grads):
        assert _relerr(mine, theirs.double()) < 3e-2


def test_p2p_formula():
    assert (
        ring_attention_p2p_bytes(
            num_tokens=100, ring_size=1, num_kv_heads=8, head_dim=128, element_size=2
        )
        == 0
    )
    kv = 2 * 100 * 8 * 128
    assert ring_attention_p2p_bytes(
        num_tokens=100, ring_size=4, num_kv_heads=8, head_dim=128, element_size=2
    ) == 3 * kv * 2 + 3 * kv * (2 + 4)
    assert (
        ring_attention_p2p_bytes(
            num_tokens=100,
            ring_size=4,
            num_kv_heads=8,
            head_dim=128,
            element_size=2,
            backward=False,
        )
        == 3 * kv * 2
    )


def test_p2p_formula_agrees_with_planner_estimate():
    """The planner's estimate of a plan's P2P bytes equals what the runtime formula (and so the
    runtime's counters) gives: K/V in the model dtype, dK/dV accumulators in fp32."""
    plan = scheduler_plan(
        8, [3000, 400, 350, 300, 1200, 200, 640, 90, 1000, 30, 2100, 170], 1000, "balance", align=2
    )
    if plan is None:
        pytest.skip("planner schedulers not available")
    from megatron_bytescale.planner.presets import model_spec, preset_cost_model

    spec, cost = model_spec("llama-7b"), preset_cost_model("llama-7b")
    kv_heads = spec.num_query_groups // spec.tensor_parallel_size
    head_dim = int(spec.head_dim)
    ours = plan_p2p_bytes(
        plan,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        element_size=spec.dtype_bytes,
        num_layers=cost.num_layers,
    )
    assert plan.estimate is not None and ours == plan.estimate.p2p_bytes > 0


def test_lazy_device_metadata_is_copied_without_a_host_wait():
    """Segment metadata built outside the ring's staging goes to CUDA through pinned memory with
    ``non_blocking=True`` (a pageable copy synchronises the host); other devices copy plainly."""
    from megatron_bytescale.runtime.backends.base import host_to_device

    calls = []

    class FakeHost:
        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, device, non_blocking=False):
            calls.append((str(device), non_blocking))
            return "staged"

    assert host_to_device(FakeHost(), torch.device("cuda", 1)) == "staged"
    assert calls == ["pin", ("cuda:1", True)]
    calls.clear()
    host_to_device(FakeHost(), "meta")
    assert calls == [("meta", False)]
    seg = Segments(cu_q=(0, 3, 5), cu_k=(0, 3, 5))
    cu_q, cu_k = seg.tensors(torch.device("meta"))
    assert cu_q.shape == (3,) and cu_q.dtype == torch.int32 and cu_q.device.type == "meta"
    assert seg.padded_rows(torch.device("meta")).shape == (5,)
