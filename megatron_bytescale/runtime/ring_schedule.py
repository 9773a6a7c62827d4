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
exactly: a slot's real tokens are a prefix of it (see :mod:`.layout`), so each block row range
is clipped to real rows and empty segments are dropped. Padding rows are never computed, get
output 0 and gradient 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from .backends.base import Segments
from .layout import AttentionLayout

Range = tuple[int, int]


@dataclass(frozen=True)
class AttentionBlock:
    """One kernel call of a ring step: local q rows against the source's k/v rows.

    ``q_ranges[i]`` (rows of the local buffer) attends to ``k_ranges[i]`` (rows of the source
    member's buffer, whose layout is identical). ``q_spans``/``k_spans`` merge adjacent ranges:
    packing the block's inputs is a view when there is one span. Blocks are cached per
    (layout, source), so every layer of a micro-batch reuses them (and, on GPU, their
    ``cu_seqlens`` device tensors).
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


@lru_cache(maxsize=4096)
def attention_block(layout: AttentionLayout, source: int) -> AttentionBlock | None:
    """The block this member computes with the k/v of ring position ``source``; None if empty."""
    me = layout.ring.position
    q_ranges: list[Range] = []
    k_ranges: list[Range] = []
    for slot in layout.slots:
        off, chunk = slot.offset, slot.chunk
        mine, theirs = slot.num_real, slot.real_by_position[source]
        if source == me:
            q, k = (off, off + mine), (off, off + mine)
        elif source < me:
            q, k = (off, off + mine), (off, off + min(theirs, chunk))
        else:
            q, k = (off + chunk, off + max(mine, chunk)), (off, off + theirs)
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
