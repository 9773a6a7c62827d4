"""Dynamic-ring distributed attention: causal, per-document zigzag, GQA, THD layout (D3).

Legend: T rows of the local buffer (padding included), Nq / Nkv query / key-value heads,
H head dim. q ``[T, Nq, H]``, k/v ``[T, Nkv, H]``, out ``[T, Nq, H]``, lse ``[T, Nq]``.

A micro-batch's ring is whatever the plan says - any size, any ranks - and all traffic is
batched P2P on the one HDP group (:class:`.RingComm`). A ring of size 1 (a local pack of
short sequences) runs one varlen causal call and never communicates.

Forward on a ring of N: N steps; at step t this member holds the k/v of ring position
``p - t`` (its own first), sends them on to the next member while computing the block of that
step (:mod:`.ring_schedule`), and merges the block into the running output through the
log-sum-exp (:func:`.merge_partial_attention`). The transfer for step t+1 is committed before
the block of step t is computed and waited for just before step t+1 needs it.

Backward: k/v rotate again, and every member computes, per step, dq (kept) and the dK/dV
contribution for the k/v it holds. That contribution travels with an accumulator: the member
right after the owner starts it, every later member adds its part and forwards it, and the last
hop delivers it to the owner, which adds the contribution it kept from step 0. The accumulator
travels in the accumulation dtype (default) or in the input dtype (``dkv_wire="input"``: half
the dK/dV bytes for bf16, see :func:`.dkv_wire_dtype`). Byte counts are in :mod:`.p2p_volume`.

The compute of one step is :mod:`.ring_step` (shared with the one-process emulation); this
module adds the transfers, the autograd function and the checks. Nothing here reads a device
value back to the host: block offsets are host integers and the kernels' ``cu_seqlens`` reach the
device in one non-blocking copy per micro-batch (D12).

Numerics: blocks run in the input dtype; merging, dq and dK/dV accumulate in float32 (float64
for float64 inputs); the results are cast back to the input dtypes. Padding rows are never
computed (output 0, zero gradient).
"""

from __future__ import annotations

import hashlib
import logging

import torch

from .backends import AttentionBackend, accumulation_dtype
from .counters import CommCounters, MicroBatchCommStats, timed
from .hdp_group import HDPGroup
from .layout import AttentionLayout
from .ring_comm import RingComm
from .ring_schedule import AttentionBlock, attention_block, prepare_device_metadata
from .ring_step import (
    DkvWire,
    dkv_wire_dtype,
    resolve_backend,
    ring_backward_step,
    ring_forward_step,
    softmax_scale_of,
    start_ring_forward,
)

logger = logging.getLogger(__name__)

_TAG_KV = 1  # k/v rotation (forward and backward)
_TAG_DKV = 2  # dK/dV accumulators, in flight together with the k/v of the next step
_TAG_CHECK = 3  # neighbour layout check


# ---------------------------------------------------------------------- validation
def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, hdp: HDPGroup
) -> None:
    if not isinstance(layout, AttentionLayout):
        raise TypeError(f"layout must be an AttentionLayout, got {type(layout).__name__}")
    if not isinstance(hdp, HDPGroup):
        raise TypeError(f"hdp must be an HDPGroup, got {type(hdp).__name__}")
    hdp.check_ring(layout.ring)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be [tokens, heads, head_dim] (THD), got shape {tuple(t.shape)}"
            )
    if q.shape[0] != layout.num_tokens:
        raise ValueError(
            f"q has {q.shape[0]} tokens but the layout's local buffer has {layout.num_tokens} "
            f"(sequences {list(layout.seqs)} on ring {list(layout.ring.members)})"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"k/v {tuple(k.shape)} must match q {tuple(q.shape)} in tokens and head_dim"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
            f"({k.shape[1]}) for GQA"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")


def _resolve_record(
    counters: CommCounters | MicroBatchCommStats | None,
) -> MicroBatchCommStats | None:
    return counters.current() if isinstance(counters, CommCounters) else counters


def _start_call(
    counters: CommCounters | MicroBatchCommStats | None,
) -> MicroBatchCommStats | None:
    """The micro-batch record a forward call charges, with the call counted."""
    record = _resolve_record(counters)
    if record is not None:
        record.attention_calls += 1
    return record


def verify_ring_layout(
    layout: AttentionLayout, hdp: HDPGroup, *, extra: tuple[int, ...] = ()
) -> None:
    """Check that both ring neighbours hold the same micro-batch layout; raise ValueError if not.

    Exchanges a fixed-size fingerprint (buffer rows, ring, sequences, ``extra`` such as head
    counts) with the previous and next member. Without it, members that disagree on the
    buffer size make gloo abort the process (``op.preamble.length <= op.nbytes``) instead of
    raising. Costs one tiny batched P2P; a no-op on a ring of size 1. Members that disagree on
    the ring itself may still wait until the process-group timeout.
    """
    hdp.check_ring(layout.ring)
    ring = layout.ring
    if ring.is_local:
        return
    digest = hashlib.sha256(repr((layout.fingerprint(), tuple(extra))).encode()).digest()
    device = hdp.device  # NCCL sends CUDA tensors only
    mine = torch.tensor(
        [layout.num_tokens, ring.size, int.from_bytes(digest[:7], "little")],
        dtype=torch.int64,
        device=device,
    )
    comm = RingComm(hdp, ring, tag=_TAG_CHECK)
    from_prev = comm.recv(torch.empty_like(mine), ring.prev_rank)
    from_next = comm.recv(torch.empty_like(mine), ring.next_rank)
    comm.send(mine, ring.next_rank)
    comm.send(mine, ring.prev_rank)
    comm.commit()
    comm.wait()
    for peer, theirs in ((ring.prev_rank, from_prev), (ring.next_rank, from_next)):
        if not torch.equal(theirs, mine):
            raise ValueError(
                f"ring {list(ring.members)}: HDP rank {ring.rank} has a layout of "
                f"{layout.num_tokens} rows for sequences {list(layout.seqs)}, but neighbour HDP "
                f"rank {peer} reports {int(theirs[0])} rows on a ring of {int(theirs[1])} with a "
                f"different fingerprint; the members run different micro-batches (compare "
                f"plan.content_hash() on every rank)"
            )


# ---------------------------------------------------------------------- forward / backward
def _local_block(layout: AttentionLayout) -> AttentionBlock:
    block = attention_block(layout, layout.ring.position)
    assert block is not None  # a layout has at least one sequence of length >= 1
    return block


def _forward(q, k, v, layout, hdp, scale, backend, record):
    ring = layout.ring
    prepare_device_metadata(layout, q.device)
    if ring.is_local:
        block = _local_block(layout)
        with timed(record, "compute_s"):
            out, lse = backend.forward(q, k, v, block.segments, causal=True, scale=scale)
        return out.contiguous(), lse

    state = start_ring_forward(q)
    kv = torch.stack((k, v))
    comm = RingComm(hdp, ring, counters=record, tag=_TAG_KV)
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming = comm.send_recv(kv)
            comm.commit()
        source = (ring.position - step) % ring.size
        with timed(record, "compute_s"):
            ring_forward_step(state, q, kv[0], kv[1], layout, source, backend=backend, scale=scale)
        if not last:
            with timed(record, "wait_s"):
                comm.wait()
            kv = incoming
    return state.output(q.dtype), state.lse


def _backward(dout, q, k, v, out, lse, layout, hdp, scale, backend, record, dkv_wire="accumulator"):
    ring = layout.ring
    prepare_device_metadata(layout, q.device)
    if ring.is_local:
        block = _local_block(layout)
        with timed(record, "compute_s"):
            return backend.backward(
                dout, q, k, v, out, lse, block.segments, causal=True, scale=scale
            )

    acc, wire = accumulation_dtype(q.dtype), dkv_wire_dtype(q.dtype, dkv_wire)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack((k, v))
    kv_comm = RingComm(hdp, ring, counters=record, tag=_TAG_KV)
    dkv_comm = RingComm(hdp, ring, counters=record, tag=_TAG_DKV)
    own = carried = None
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming = kv_comm.send_recv(kv)
            kv_comm.commit()
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        source = (ring.position - step) % ring.size
        with timed(record, "compute_s"):
            ring_backward_step(dout, q, kv[0], kv[1], out, lse, layout, source, dq, dkv,
                               backend=backend, scale=scale)  # fmt: skip
        if step == 0:
            own = dkv  # our own k/v's contribution stays here until the accumulator returns
        else:
            if step >= 2:
                with timed(record, "wait_s"):
                    dkv_comm.wait()
                dkv += carried
            carried = dkv_comm.send_recv(dkv.to(wire))
            dkv_comm.commit()
        if not last:
            with timed(record, "wait_s"):
                kv_comm.wait()
            kv = incoming
    with timed(record, "wait_s"):
        dkv_comm.wait()
    own += carried
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    hdp: HDPGroup,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend | None = None,
    counters: CommCounters | MicroBatchCommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, without autograd: ``(out [T, Nq, H], lse [T, Nq] float32)``.

    Padding rows get ``out = 0`` and ``lse = -inf``.
    """
    _check_inputs(q, k, v, layout, hdp)
    scale = softmax_scale_of(q, softmax_scale)
    record = _start_call(counters)
    return _forward(q, k, v, layout, hdp, scale, resolve_backend(backend, q), record)


def ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: AttentionLayout,
    hdp: HDPGroup,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend | None = None,
    counters: CommCounters | MicroBatchCommStats | None = None,
    dkv_wire: DkvWire = "accumulator",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward only, given the forward's ``out`` and ``lse``: ``(dq, dk, dv)``."""
    _check_inputs(q, k, v, layout, hdp)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:2]:
        raise ValueError(
            f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must match q {tuple(q.shape)}, "
            f"lse {tuple(lse.shape)} must be {tuple(q.shape[:2])}"
        )
    scale = softmax_scale_of(q, softmax_scale)
    dkv_wire_dtype(q.dtype, dkv_wire)  # refuse a bad choice before any transfer
    return _backward(
        dout, q, k, v, out, lse, layout, hdp, scale, resolve_backend(backend, q),
        _resolve_record(counters), dkv_wire,
    )  # fmt: skip


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, hdp, scale, backend, record, dkv_wire):  # noqa: D401
        out, lse = _forward(q, k, v, layout, hdp, scale, backend, record)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.hdp, ctx.scale = layout, hdp, scale
        ctx.backend, ctx.record, ctx.dkv_wire = backend, record, dkv_wire
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(
            dout.contiguous(), q, k, v, out, lse, ctx.layout, ctx.hdp, ctx.scale, ctx.backend,
            ctx.record, ctx.dkv_wire,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    hdp: HDPGroup,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend | None = None,
    counters: CommCounters | None = None,
    verify_peers: bool = False,
    dkv_wire: DkvWire = "accumulator",
) -> torch.Tensor:
    """Causal attention of a micro-batch over its ring, differentiable in q, k and v.

    Args:
        q: ``[T, Nq, H]`` queries in the layout's buffer order (``T == layout.num_tokens``).
        k, v: ``[T, Nkv, H]``; ``Nq`` must be a multiple of ``Nkv`` (GQA).
        layout: the micro-batch's :class:`AttentionLayout` (same ring on every member).
        hdp: the HDP group the ring lives on.
        softmax_scale: defaults to ``1 / sqrt(H)``.
        backend: ``"torch"``, ``"math"``, ``"flash_attn"``, ``"te"`` or an instance; None picks
            the best available for the device, dtype and head dim (:func:`get_backend`). A
            backend that cannot run the case is refused here, before any transfer.
        counters: P2P bytes, calls and compute/wait time are charged to its current micro-batch
            (the backward to the same micro-batch as the forward).
        verify_peers: first exchange a layout fingerprint with both neighbours
            (:func:`verify_ring_layout`) so that disagreeing members raise instead of aborting.
        dkv_wire: dtype of the dK/dV accumulators on the wire: ``"accumulator"`` (float32,
            exact partial sums) or ``"input"`` (q's dtype: bf16 halves those bytes), see
            :func:`.dkv_wire_dtype`.

    Returns:
        ``[T, Nq, H]`` in q's dtype; every token attends to the earlier tokens of its own
        original sequence only. Padding rows are 0.

    Every member of the ring must call this with the same layout, in the same order (D5).
    """
    _check_inputs(q, k, v, layout, hdp)
    impl = resolve_backend(backend, q)
    scale = softmax_scale_of(q, softmax_scale)
    dkv_wire_dtype(q.dtype, dkv_wire)  # refuse a bad choice before any transfer
    if verify_peers:
        verify_ring_layout(
            layout, hdp, extra=(q.shape[1], k.shape[1], q.shape[2], q.element_size())
        )
    record = _start_call(counters)
    return _RingAttentionFunction.apply(q, k, v, layout, hdp, scale, impl, record, dkv_wire)
