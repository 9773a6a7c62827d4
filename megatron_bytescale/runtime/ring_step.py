"""One step of ring attention without its transfers, and a whole ring emulated in one process.

Legend: T rows of a member's buffer (padding included), Nq / Nkv query / key-value heads,
H head dim. q ``[T, Nq, H]``, k/v ``[T, Nkv, H]``, dK/dV accumulators ``[2, T, Nkv, H]``.

:func:`ring_forward_step` and :func:`ring_backward_step` are exactly what a ring member computes
at one step of :func:`.ring_attention` once the k/v of ring position ``source`` are at hand: the
block of that step (:mod:`.ring_schedule`) through the backend, merged into the running result
(forward), or added to dq and to the dK/dV contribution for ``source`` (backward). The
distributed ring calls them between its transfers; :func:`emulate_ring_attention` calls them for
every member of a ring in one process, moving k/v and the dK/dV accumulators between members in
memory the way the ring sends them (including the wire dtype), so a ring of any size can be
checked and timed on one device (tests, ``scripts/gpu_check.py``).

Numerics: blocks run in the input dtype; the output, log-sum-exp, dq and dK/dV accumulate in the
accumulation dtype (float32, float64 for float64 inputs); the dK/dV accumulator travels in the
wire dtype (:func:`dkv_wire_dtype`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from .backends import AttentionBackend, accumulation_dtype, get_backend
from .layout import AttentionLayout
from .online_softmax import merge_partial_attention
from .ring_schedule import attention_block, iter_spans, prepare_device_metadata, take_rows

DkvWire = Literal["accumulator", "input"]
DKV_WIRE_CHOICES: tuple[str, ...] = ("accumulator", "input")


def dkv_wire_dtype(dtype: torch.dtype, wire: DkvWire = "accumulator") -> torch.dtype:
    """The dtype dK/dV accumulators travel in between ring members.

    ``"accumulator"``: float32 (float64 for float64 inputs): exact partial sums, but for bf16
    k/v the backward then moves 3x the forward's bytes (K/V once, dK/dV at twice the width).
    ``"input"``: the k/v dtype (bf16 halves the dK/dV bytes); every hop adds in the accumulation
    dtype and rounds once for the wire, and the owner accumulates in the accumulation dtype.
    """
    if wire not in DKV_WIRE_CHOICES:
        raise ValueError(f"dkv wire dtype {wire!r} must be one of {', '.join(DKV_WIRE_CHOICES)}")
    return accumulation_dtype(dtype) if wire == "accumulator" else dtype


def softmax_scale_of(q: torch.Tensor, softmax_scale: float | None) -> float:
    """``softmax_scale`` or ``1 / sqrt(head_dim)``."""
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def resolve_backend(backend: str | AttentionBackend | None, q: torch.Tensor) -> AttentionBackend:
    """The backend instance for ``q``; raises ValueError up front if it cannot run q's case.

    Refusing before the first transfer matters: a kernel failing on one ring member would leave
    the others waiting until the process-group timeout.
    """
    head_dim = q.shape[-1]
    impl = (
        backend
        if isinstance(backend, AttentionBackend)
        else get_backend(backend, device=q.device, dtype=q.dtype, head_dim=head_dim)
    )
    reason = impl.unsupported_reason(q.device, q.dtype, head_dim)
    if reason is not None:
        raise ValueError(
            f"attention backend {impl.name!r} cannot run {q.dtype} with head dim {head_dim} on "
            f"{q.device}: {reason}; choose another backend (auto picks one that can)"
        )
    return impl


@dataclass
class RingForwardState:
    """The running result of one member's forward: out and lse in the accumulation dtype."""

    out: torch.Tensor
    lse: torch.Tensor
    steps: int = 0

    def output(self, dtype: torch.dtype) -> torch.Tensor:
        """The merged output in ``dtype`` (padding rows 0)."""
        return self.out.to(dtype)


def start_ring_forward(q: torch.Tensor) -> RingForwardState:
    """An empty running result for ``q`` (out 0, lse -inf)."""
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)
    return RingForwardState(out=out, lse=lse)


def ring_forward_step(
    state: RingForwardState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    source: int,
    *,
    backend: AttentionBackend,
    scale: float,
) -> None:
    """Merge this member's block against the k/v of ring position ``source`` into ``state``.

    The first step of a member is its diagonal block, which covers every real row: its result
    is copied, not merged.
    """
    prepare_device_metadata(layout, q.device)
    block = attention_block(layout, source)
    first = state.steps == 0 and source == layout.ring.position
    state.steps += 1
    if block is None:
        return
    o, l = backend.forward(
        take_rows(q, block.q_spans),
        take_rows(k, block.k_spans),
        take_rows(v, block.k_spans),
        block.segments,
        causal=block.causal,
        scale=scale,
    )
    for a, b, pa, pb in iter_spans(block.q_spans):
        if first:
            state.out[a:b].copy_(o[pa:pb])
            state.lse[a:b].copy_(l[pa:pb])
        else:
            merge_partial_attention(state.out[a:b], state.lse[a:b], o[pa:pb], l[pa:pb])


def ring_backward_step(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: AttentionLayout,
    source: int,
    dq: torch.Tensor,
    dkv: torch.Tensor,
    *,
    backend: AttentionBackend,
    scale: float,
) -> None:
    """Add this member's step against ring position ``source`` to ``dq`` and ``dkv``.

    ``out``/``lse`` are the member's final forward results; ``dq`` ``[T, Nq, H]`` and ``dkv``
    ``[2, T, Nkv, H]`` (the contribution for ``source``'s k/v) are accumulators.
    """
    prepare_device_metadata(layout, q.device)
    block = attention_block(layout, source)
    if block is None:
        return
    rows = block.q_spans
    dq_b, dk_b, dv_b = backend.backward(
        take_rows(dout, rows),
        take_rows(q, rows),
        take_rows(k, block.k_spans),
        take_rows(v, block.k_spans),
        take_rows(out, rows),
        take_rows(lse, rows),
        block.segments,
        causal=block.causal,
        scale=scale,
    )
    for a, b, pa, pb in iter_spans(rows):
        dq[a:b] += dq_b[pa:pb]
    for a, b, pa, pb in iter_spans(block.k_spans):
        dkv[0, a:b] += dk_b[pa:pb]
        dkv[1, a:b] += dv_b[pa:pb]


@dataclass(frozen=True)
class EmulatedRing:
    """Per-member results of :func:`emulate_ring_attention`, in ring-position order."""

    out: tuple[torch.Tensor, ...]
    lse: tuple[torch.Tensor, ...]
    dq: tuple[torch.Tensor, ...] | None
    dk: tuple[torch.Tensor, ...] | None
    dv: tuple[torch.Tensor, ...] | None


def emulate_ring_attention(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    v: Sequence[torch.Tensor],
    layouts: Sequence[AttentionLayout],
    dout: Sequence[torch.Tensor] | None = None,
    *,
    softmax_scale: float | None = None,
    backend: str | AttentionBackend | None = None,
    dkv_wire: DkvWire = "accumulator",
) -> EmulatedRing:
    """Ring attention of all N members of one ring, in one process, with the ring's own steps.

    Args:
        q, k, v: each member's buffers, indexed by ring position.
        layouts: each member's layout (``layouts[p].ring.position == p``, same ring).
        dout: each member's output gradient; None runs the forward only.
        dkv_wire: the dtype the dK/dV accumulators travel in (:func:`dkv_wire_dtype`).

    Returns the forward (and backward) results of every member, as the distributed ring would
    produce them (same steps, same order of additions, same wire rounding).
    """
    n = len(layouts)
    if not n or not (len(q) == len(k) == len(v) == n):
        raise ValueError(f"need one q, k, v per ring member, got {len(q)}, {len(k)}, {len(v)} "
                         f"for {n} layouts")  # fmt: skip
    for p, layout in enumerate(layouts):
        if layout.ring.size != n or layout.ring.position != p:
            raise ValueError(
                f"layouts[{p}] is for position {layout.ring.position} of a ring of "
                f"{layout.ring.size}; pass one layout per position of one ring, in order"
            )
    impl = resolve_backend(backend, q[0])
    scale = softmax_scale_of(q[0], softmax_scale)
    states = []
    for p in range(n):
        state = start_ring_forward(q[p])
        for step in range(n):
            src = (p - step) % n
            ring_forward_step(state, q[p], k[src], v[src], layouts[p], src, backend=impl, scale=scale)
        states.append(state)
    outs = tuple(s.output(q[p].dtype) for p, s in enumerate(states))
    lses = tuple(s.lse for s in states)
    if dout is None:
        return EmulatedRing(out=outs, lse=lses, dq=None, dk=None, dv=None)
    acc, wire = accumulation_dtype(q[0].dtype), dkv_wire_dtype(q[0].dtype, dkv_wire)
    dqs = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in q]
    contributions: list[list[torch.Tensor | None]] = [[None] * n for _ in range(n)]  # [owner][hop]
    for p in range(n):
        for step in range(n):
            src = (p - step) % n
            dkv = torch.zeros((2, *k[src].shape), dtype=acc, device=k[src].device)
            ring_backward_step(dout[p], q[p], k[src], v[src], outs[p], lses[p], layouts[p], src,
                               dqs[p], dkv, backend=impl, scale=scale)  # fmt: skip
            contributions[src][step] = dkv  # hop `step` of the accumulator owned by src
    dks, dvs = [], []
    for owner in range(n):
        own, carried = contributions[owner][0], None
        for hop in range(1, n):  # the accumulator starts after the owner and travels N-1 hops
            dkv = contributions[owner][hop]
            if carried is not None:
                dkv += carried
            carried = dkv.to(wire)
        total = own if carried is None else own + carried
        dks.append(total[0].to(k[owner].dtype))
        dvs.append(total[1].to(v[owner].dtype))
    return EmulatedRing(
        out=outs, lse=lses, dq=tuple(d.to(x.dtype) for d, x in zip(dqs, q)),
        dk=tuple(dks), dv=tuple(dvs),
    )  # fmt: skip
