"""Ring attention of a micro-batch split into causal chunks that run as separate units.

A long ring micro-batch can be cut into ``k`` causal chunks that follow each other through the
pipeline (Seq1F1B-style, docs/pipeline.md): chunk ``i`` holds positions
``[floor(i L / k), floor((i + 1) L / k))`` of every document (:func:`.causal_chunks`), and that
range is zigzagged over the ring on its own (:class:`ChunkLayout`), so every member does the
same work in every chunk.

Forward of chunk ``i``: its queries attend to its own keys causally (the usual ring: the
chunk's K/V rotate once), and to every key of the chunks before it, without a mask. Those keys
are *kept*, not sent again: while chunk ``j`` rotates its K/V, every member keeps the blocks
that pass it (:class:`ChunkPrefix`), so a later chunk attends to them locally. The partial
results merge through the log-sum-exp exactly as the ring's steps do
(:func:`.merge_partial_attention`). Memory: each member holds the whole prefix's K/V of the
micro-batch per attention layer (the ring's size times its own share) until the backward of the
chunk that owns them.

Backward runs the chunks in reverse (``k - 1`` first; anything else raises). Chunk ``i``'s
backward yields dq for itself and the dK/dV of every kept prefix block; those accumulate in
float32 (the accumulation dtype) in the :class:`ChunkPrefix` until chunk ``j``'s own backward.
There the ring's rotating dK/dV accumulator, which visits every member once for every owner,
picks up each member's accumulated share for that owner: the reduction over the ring costs no
extra transfer.

Autograd: each chunk is its own graph (its function's inputs are its own q, k, v); the gradient
owed to an earlier chunk travels through the :class:`ChunkPrefix`, not through autograd, so a
pipeline can run chunk ``i``'s backward as one unit and chunk ``j``'s later as another. Use one
:class:`ChunkPrefix` per ring micro-batch and attention layer; the driver keeps it alive from
the first chunk's forward to the last backward.
"""

from __future__ import annotations

import torch

from .backends import AttentionBackend, accumulation_dtype
from .chunk_layout import ChunkLayout, make_chunk_layout
from .counters import CommCounters, MicroBatchCommStats, timed
from .hdp_group import HDPGroup
from .online_softmax import merge_partial_attention
from .ring_comm import RingComm
from .ring_schedule import AttentionBlock, iter_spans, prepare_device_metadata, take_rows
from .ring_step import (
    resolve_backend,
    ring_backward_step,
    ring_forward_step,
    softmax_scale_of,
    start_ring_forward,
)

__all__ = ["ChunkLayout", "ChunkPrefix", "chunked_ring_attention", "make_chunk_layout"]

_TAG_KV = 1  # the same channels as ring attention: a chunk is one ring micro-batch on the wire
_TAG_DKV = 2


class ChunkPrefix:
    """What the chunks of one ring micro-batch share in one attention layer.

    Kept from forward: every member's K/V of every chunk but the last (one ``[2, T, Nkv, H]``
    buffer per ring position, in that position's buffer order). Owed from backward: float32
    dK/dV per chunk and ring position, added by later chunks' backwards and handed to the ring
    accumulator in the owning chunk's backward. Forwards must come in chunk order and backwards
    in reverse chunk order after the last forward; both are checked.
    """

    def __init__(self, num_chunks: int) -> None:
        if num_chunks < 1:
            raise ValueError(f"num_chunks ({num_chunks}) must be >= 1")
        self.num_chunks = num_chunks
        self._layouts: list[ChunkLayout | None] = [None] * num_chunks
        self._kv: list[list[torch.Tensor] | None] = [None] * num_chunks
        self._dkv: list[list[torch.Tensor | None] | None] = [None] * num_chunks
        self._forwarded = 0
        self._next_backward = num_chunks - 1
        self._blocks: dict[tuple[int, int, int], AttentionBlock | None] = {}

    @property
    def done(self) -> bool:
        """True once every chunk ran its backward (nothing is kept any more)."""
        return self._next_backward < 0

    def kept_bytes(self) -> int:
        """Bytes of prefix K/V and dK/dV held now (for memory accounting and tests)."""
        total = 0
        for group in (*self._kv, *self._dkv):
            for t in group or ():
                total += 0 if t is None else t.numel() * t.element_size()
        return total

    # ------------------------------------------------------------------ checks
    def _start_forward(self, cl: ChunkLayout) -> None:
        if cl.num_chunks != self.num_chunks:
            raise ValueError(f"chunk layout is for {cl.num_chunks} chunks, this prefix keeps {self.num_chunks}")
        if cl.chunk < self._forwarded:
            raise RuntimeError(
                f"chunk {cl.chunk} forward ran twice: a chunk of a split micro-batch runs its "
                f"attention forward once (recomputing it, as activation recomputation does, is "
                f"not supported; turn recomputation off for plans with chunks)"
            )
        if cl.chunk != self._forwarded:
            raise RuntimeError(
                f"chunk {cl.chunk} forward out of order: chunks of one micro-batch run forward in "
                f"order (next is chunk {self._forwarded})"
            )
        if self._forwarded and self._layouts[0].ring.members != cl.ring.members:  # type: ignore[union-attr]
            raise ValueError(f"chunk {cl.chunk} runs on ring {list(cl.ring.members)}, chunk 0 on "
                             f"{list(self._layouts[0].ring.members)}")  # type: ignore[union-attr]
        self._layouts[cl.chunk] = cl

    def _start_backward(self, cl: ChunkLayout) -> None:
        if self._forwarded != self.num_chunks or cl.chunk != self._next_backward:
            raise RuntimeError(
                f"chunk {cl.chunk} backward out of order: chunks run backward in reverse after the "
                f"last forward (forwards done {self._forwarded} of {self.num_chunks}, next backward "
                f"chunk {self._next_backward})"
            )

    # ------------------------------------------------------------------ prefix blocks
    def _prefix_block(self, i: int, j: int, source: int) -> AttentionBlock | None:
        """Chunk ``i``'s rows (this member) against chunk ``j``'s keys of ring position ``source``."""
        key = (i, j, source)
        if key not in self._blocks:
            mine, theirs = self._layouts[i].layout, self._layouts[j].layout  # type: ignore[union-attr]
            rows_of = {slot.seq: slot for slot in theirs.slots}
            q_ranges, k_ranges = [], []
            for slot in mine.slots:
                other = rows_of.get(slot.seq)
                if other is None or slot.num_real == 0:
                    continue
                n_k = other.real_by_position[source]
                if n_k:
                    q_ranges.append((slot.offset, slot.offset + slot.num_real))
                    k_ranges.append((other.offset, other.offset + n_k))
            self._blocks[key] = (
                AttentionBlock(tuple(q_ranges), tuple(k_ranges), causal=False) if q_ranges else None
            )
        return self._blocks[key]

    def _owed(self, j: int, source: int, like: torch.Tensor) -> torch.Tensor:
        owed = self._dkv[j]
        if owed is None:
            owed = self._dkv[j] = [None] * len(self._kv[j])  # type: ignore[arg-type]
        if owed[source] is None:
            owed[source] = torch.zeros(like.shape, dtype=accumulation_dtype(like.dtype), device=like.device)
        return owed[source]  # type: ignore[return-value]


# ---------------------------------------------------------------------- forward / backward
def _forward(q, k, v, cl: ChunkLayout, prefix: ChunkPrefix, hdp, scale, backend, record):
    layout, ring = cl.layout, cl.ring
    prepare_device_metadata(layout, q.device)
    keep = cl.chunk < cl.num_chunks - 1
    kept: list[torch.Tensor] = [None] * ring.size  # type: ignore[list-item]
    state = start_ring_forward(q)
    kv = torch.stack((k.detach(), v.detach()))
    comm = None if ring.is_local else RingComm(hdp, ring, counters=record, tag=_TAG_KV)
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming = comm.send_recv(kv)  # type: ignore[union-attr]
            comm.commit()  # type: ignore[union-attr]
        source = (ring.position - step) % ring.size
        kept[source] = kv
        with timed(record, "compute_s"):
            ring_forward_step(state, q, kv[0], kv[1], layout, source, backend=backend, scale=scale)
        if not last:
            with timed(record, "wait_s"):
                comm.wait()  # type: ignore[union-attr]
            kv = incoming
    with timed(record, "compute_s"):
        for j in range(cl.chunk):
            for source, kv_j in enumerate(prefix._kv[j]):  # type: ignore[arg-type]
                block = prefix._prefix_block(cl.chunk, j, source)
                if block is None:
                    continue
                o, l = backend.forward(
                    take_rows(q, block.q_spans), take_rows(kv_j[0], block.k_spans),
                    take_rows(kv_j[1], block.k_spans), block.segments, causal=False, scale=scale,
                )  # fmt: skip
                for a, b, pa, pb in iter_spans(block.q_spans):
                    merge_partial_attention(state.out[a:b], state.lse[a:b], o[pa:pb], l[pa:pb])
    if keep:
        prefix._kv[cl.chunk] = kept
    return state.output(q.dtype), state.lse


def _backward(dout, q, k, v, out, lse, cl: ChunkLayout, prefix: ChunkPrefix, hdp, scale, backend, record):
    layout, ring, i = cl.layout, cl.ring, cl.chunk
    prepare_device_metadata(layout, q.device)
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    with timed(record, "compute_s"):
        for j in range(i):
            for source, kv_j in enumerate(prefix._kv[j]):  # type: ignore[arg-type]
                block = prefix._prefix_block(i, j, source)
                if block is None:
                    continue
                rows = block.q_spans
                dq_b, dk_b, dv_b = backend.backward(
                    take_rows(dout, rows), take_rows(q, rows), take_rows(kv_j[0], block.k_spans),
                    take_rows(kv_j[1], block.k_spans), take_rows(out, rows), take_rows(lse, rows),
                    block.segments, causal=False, scale=scale,
                )  # fmt: skip
                for a, b, pa, pb in iter_spans(rows):
                    dq[a:b] += dq_b[pa:pb]
                owed = prefix._owed(j, source, kv_j)
                for a, b, pa, pb in iter_spans(block.k_spans):
                    owed[0, a:b] += dk_b[pa:pb]
                    owed[1, a:b] += dv_b[pa:pb]
    owed_here = prefix._dkv[i] or [None] * ring.size
    kv = torch.stack((k, v))
    kv_comm = dkv_comm = None
    if not ring.is_local:
        kv_comm = RingComm(hdp, ring, counters=record, tag=_TAG_KV)
        dkv_comm = RingComm(hdp, ring, counters=record, tag=_TAG_DKV)
    own = carried = None
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming = kv_comm.send_recv(kv)  # type: ignore[union-attr]
            kv_comm.commit()  # type: ignore[union-attr]
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        source = (ring.position - step) % ring.size
        with timed(record, "compute_s"):
            ring_backward_step(dout, q, kv[0], kv[1], out, lse, layout, source, dq, dkv,
                               backend=backend, scale=scale)  # fmt: skip
            if owed_here[source] is not None:  # later chunks' share for source, rides along
                dkv += owed_here[source]
        if step == 0:
            own = dkv
        else:
            if step >= 2:
                with timed(record, "wait_s"):
                    dkv_comm.wait()  # type: ignore[union-attr]
                dkv += carried
            carried = dkv_comm.send_recv(dkv)  # type: ignore[union-attr]
            dkv_comm.commit()  # type: ignore[union-attr]
        if not last:
            with timed(record, "wait_s"):
                kv_comm.wait()  # type: ignore[union-attr]
            kv = incoming
    if carried is not None:
        with timed(record, "wait_s"):
            dkv_comm.wait()  # type: ignore[union-attr]
        own += carried
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)  # type: ignore[index]


class _ChunkAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cl, prefix, hdp, scale, backend, record):  # noqa: D401
        prefix._start_forward(cl)
        out, lse = _forward(q, k, v, cl, prefix, hdp, scale, backend, record)
        prefix._forwarded += 1
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cl, ctx.prefix, ctx.hdp, ctx.scale, ctx.backend, ctx.record = (
            cl, prefix, hdp, scale, backend, record,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, dout):
        cl, prefix = ctx.cl, ctx.prefix
        prefix._start_backward(cl)
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(
            dout.contiguous(), q, k, v, out, lse, cl, prefix, ctx.hdp, ctx.scale, ctx.backend,
            ctx.record,
        )  # fmt: skip
        # every later chunk has run its backward: this chunk's kept keys and what it was owed
        # are no longer needed
        prefix._kv[cl.chunk] = None
        prefix._dkv[cl.chunk] = None
        prefix._next_backward -= 1
        return dq, dk, dv, None, None, None, None, None, None


def chunked_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk_layout: ChunkLayout,
    prefix: ChunkPrefix,
    hdp: HDPGroup,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend | None = None,
    counters: CommCounters | MicroBatchCommStats | None = None,
) -> torch.Tensor:
    """Causal attention of one chunk of a split ring micro-batch, differentiable in q, k, v.

    Args:
        q, k, v: the chunk's ``[T, N, H]`` buffers in ``chunk_layout.layout``'s order.
        chunk_layout: this member's :class:`ChunkLayout` of the chunk.
        prefix: the micro-batch's :class:`ChunkPrefix` for this attention layer (the same object
            for all its chunks).
        hdp, softmax_scale, backend, counters: as for :func:`.ring_attention`.

    Returns ``[T, Nq, H]``: every token attends to the earlier tokens of its original sequence,
    those of earlier chunks included. Call it for chunks 0, 1, ..., k-1 in order and run their
    backwards in reverse order; every member of the ring does the same.
    """
    if not isinstance(chunk_layout, ChunkLayout):
        raise TypeError(f"chunk_layout must be a ChunkLayout, got {type(chunk_layout).__name__}")
    if not isinstance(prefix, ChunkPrefix):
        raise TypeError(f"prefix must be a ChunkPrefix, got {type(prefix).__name__}")
    hdp.check_ring(chunk_layout.ring)
    n = chunk_layout.layout.num_tokens
    if q.dim() != 3 or k.shape != v.shape or q.shape[0] != n or k.shape[0] != n:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [tokens, heads, "
            f"head_dim] with {n} tokens (chunk {chunk_layout.chunk}'s buffer)"
        )
    impl = resolve_backend(backend, q)
    scale = softmax_scale_of(q, softmax_scale)
    record = counters.current() if isinstance(counters, CommCounters) else counters
    if record is not None:
        record.attention_calls += 1
    return _ChunkAttentionFunction.apply(q, k, v, chunk_layout, prefix, hdp, scale, impl, record)
