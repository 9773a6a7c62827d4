"""Which rows attend to which at each ring step (per-document zigzag, paper.md §4.2).

At step t of a ring of N, the member at position p holds the keys/values of position
``src = (p - t) mod N``. For every sequence, p's local parts are i=p and 2N-1-p, src's are
src and 2N-1-src, and causality between whole parts decides the block:

- ``src == p`` (diagonal): local parts against themselves, causal. Because part p precedes part
  2N-1-p and the slot stores them in that order, a plain causal mask over the slot is exact.
- ``src < p``: src's first part precedes both local parts, its second part follows both:
  every local row attends to src's first part, no mask.
- ``src > p``: src's both parts lie between p's two parts: only p's second part attends, to
  both of src's parts, no mask.

Every member does the same amount of work per step (the zigzag balance). Padding is skipped
exactly: a slot holds its first part's real tokens, then its second part's, then padding (see
:mod:`.layout`), so each case above is ONE contiguous row range of q and of k/v per sequence,
whatever split the plan chose; empty segments are dropped. Padding rows are never computed,
get output 0 and gradient 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .backends.base import Segments
from .layout import AttentionLayout

Range = tuple[int, int]


@dataclass(frozen=True)
class AttentionBlock:
    """One kernel call of a ring step: local q rows against the source's k/v rows.

    ``q_ranges[i]`` (rows of the local buffer) attends to ``k_ranges[i]`` (rows of the source
    member's buffer, whose layout is identical). ``q_spans``/``k_spans`` merge adjacent ranges:
    packing the block's inputs is a view when there is one span. Blocks are memoised on the
    layout per source, so every layer of a micro-batch reuses them (and, on an accelerator, their
    ``cu_seqlens`` device tensors, see :func:`prepare_device_metadata`).
    """

    q_ranges: tuple[Range, ...]
    k_ranges: tuple[Range, ...]
    causal: bool

    @cached_property
    def segments(self) -> Segments:
        return Segments(cu_q=_cumulative(self.q_ranges), cu_k=_cumulative(self.k_ranges))

    @cached_property
    def q_spans(self) -> tuple[Range, ...]:
        return _merge_adjacent(self.q_ranges)

    @cached_property
    def k_spans(self) -> tuple[Range, ...]:
        return _merge_adjacent(self.k_ranges)


def _cumulative(ranges: tuple[Range, ...]) -> tuple[int, ...]:
    out = [0]
    for a, b in ranges:
        out.append(out[-1] + b - a)
    return tuple(out)


def _merge_adjacent(ranges: tuple[Range, ...]) -> tuple[Range, ...]:
    spans: list[list[int]] = []
    for a, b in ranges:
        if spans and spans[-1][1] == a:
            spans[-1][1] = b
        else:
            spans.append([a, b])
    return tuple((a, b) for a, b in spans)


def attention_block(layout: AttentionLayout, source: int) -> AttentionBlock | None:
    """The block this member computes with the k/v of ring position ``source``; None if empty."""
    return layout.memo(("block", source), lambda: _build_block(layout, source))


def _build_block(layout: AttentionLayout, source: int) -> AttentionBlock | None:
    me = layout.ring.position
    q_ranges: list[Range] = []
    k_ranges: list[Range] = []
    for slot in layout.slots:
        off = slot.offset
        mine, theirs = slot.num_real, slot.real_by_position[source]
        if source == me:
            q, k = (off, off + mine), (off, off + mine)
        elif source < me:
            q, k = (off, off + mine), (off, off + slot.first_by_position[source])
        else:
            q, k = (off + slot.first_by_position[me], off + mine), (off, off + theirs)
        if q[1] > q[0] and k[1] > k[0]:
            q_ranges.append(q)
            k_ranges.append(k)
    if not q_ranges:
        return None
    return AttentionBlock(tuple(q_ranges), tuple(k_ranges), causal=source == me)


def take_rows(x: torch.Tensor, spans: tuple[Range, ...]) -> torch.Tensor:
    """Rows ``spans`` of ``x`` packed along dim 0 (a view for a single span)."""
    if len(spans) == 1:
        a, b = spans[0]
        return x[a:b]
    return torch.cat([x[a:b] for a, b in spans], dim=0)


def iter_spans(spans: tuple[Range, ...]):
    """Yield ``(buffer_start, buffer_end, packed_start, packed_end)`` for every span."""
    packed = 0
    for a, b in spans:
        yield a, b, packed, packed + b - a
        packed += b - a


def prepare_device_metadata(layout: AttentionLayout, device: torch.device) -> None:
    """Put the ``cu_seqlens`` of every block of the micro-batch on ``device`` in ONE copy.

    Built on the host once per micro-batch (all ring steps, both passes and every layer reuse
    it), staged in pinned memory and copied with ``non_blocking=True``: the copy is ordered on
    the current stream before the kernels that read it, and the host never waits for it (D12).
    A no-op on CPU, whose kernels read the host offsets, and after the first call per device.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return
    layout.memo(("device_metadata", str(device)), lambda: _install_metadata(layout, device))


def _install_metadata(layout: AttentionLayout, device: torch.device) -> torch.Tensor:
    blocks = [attention_block(layout, source) for source in range(layout.ring.size)]
    blocks = [b for b in blocks if b is not None]
    values: list[int] = []
    for block in blocks:
        values += block.segments.cu_q
        values += block.segments.cu_k
    host = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    staged = host.to(device, non_blocking=True)
    offset = 0
    for block in blocks:
        seg = block.segments
        n_q, n_k = len(seg.cu_q), len(seg.cu_k)
        seg.install(device, staged[offset : offset + n_q], staged[offset + n_q : offset + n_q + n_k])
        offset += n_q + n_k
    return host  # kept alive with the layout until the copy has surely completed
