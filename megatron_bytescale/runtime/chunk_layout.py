"""Where the tokens of one causal chunk of a split ring micro-batch sit on a ring member.

A ring micro-batch split along the pipeline into ``k`` chunks (Seq1F1B-style,
docs/pipeline.md) runs each chunk as a micro-batch of its own: chunk ``i`` holds positions
``[floor(i L / k), floor((i + 1) L / k))`` of every document (:func:`.causal_chunks`), and that
range is zigzagged over the ring like a sequence of its own, so every member does the same work
in every chunk. :class:`ChunkLayout` is that ordinary :class:`AttentionLayout` plus where each
range starts in its document (for positions, labels and the attention to earlier chunks, see
:mod:`.chunked_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from ..planner.plan import StepPlan
from ..planner.zigzag import Span, causal_chunks
from .hdp_group import HDPGroup, Ring
from .layout import AttentionLayout, make_attention_layout


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk ``chunk`` of ``num_chunks`` of one ring micro-batch on one member.

    ``layout`` is an ordinary :class:`AttentionLayout` of the chunk's token ranges taken as
    sequences of their own (causal among themselves, zigzagged over the ring); ``starts[s]`` is
    where slot ``s``'s range begins in its original sequence. Documents whose chunk is empty
    (shorter than ``num_chunks``) have no slot.
    """

    layout: AttentionLayout
    chunk: int
    num_chunks: int
    starts: tuple[int, ...]

    @property
    def ring(self) -> Ring:
        return self.layout.ring

    def global_positions(self) -> torch.Tensor:
        """Long ``[num_tokens]``: every row's position in its original sequence, -1 on padding."""
        positions = self.layout.global_positions()
        for slot, start in zip(self.layout.slots, self.starts):
            positions[slot.offset : slot.offset + slot.num_real] += start
        return positions


def make_chunk_layout(
    ring: Ring,
    sequences: Iterable[tuple[int, int]],
    *,
    chunk: int,
    num_chunks: int,
    align: int = 1,
    splits: Mapping[int, tuple[Span, ...]] | None = None,
) -> ChunkLayout:
    """The layout of chunk ``chunk`` of ``sequences`` (``(seq_id, whole length)``) on ``ring``.

    ``splits`` gives a sequence's zigzag parts of its chunk, relative to the chunk's start
    (``StepPlan.chunk_zigzag_splits``); by default the planner's own split.
    """
    if num_chunks < 1 or not 0 <= chunk < num_chunks:
        raise ValueError(f"chunk {chunk} of {num_chunks}: need num_chunks >= 1 and 0 <= chunk < num_chunks")
    pieces, starts = [], []
    sequences = list(sequences)
    for seq, length in sequences:
        a, b = causal_chunks(int(length), num_chunks)[chunk]
        if b > a:
            pieces.append((seq, b - a))
            starts.append(a)
    if not pieces:
        raise ValueError(
            f"chunk {chunk} of {num_chunks} holds no token of sequences {[s for s, _ in sequences]}; "
            f"split a ring micro-batch into at most as many chunks as its longest sequence has tokens"
        )
    layout = make_attention_layout(ring, pieces, align=align, splits=splits)
    return ChunkLayout(layout=layout, chunk=chunk, num_chunks=num_chunks, starts=tuple(starts))


def chunk_layout_for(plan: StepPlan, hdp: HDPGroup | int, index: int) -> ChunkLayout:
    """The chunk layout of this rank's ``index``-th micro-batch, which must be a chunk."""
    from .layout import plan_micro_batch, plan_ring

    rank, mb = plan_micro_batch(plan, hdp, index)
    if mb.chunk is None:
        raise ValueError(f"rank {rank} micro-batch {index} (order {mb.order}) is not a chunk of a "
                         f"split micro-batch; use layout_for")
    ring = plan_ring(plan, hdp, rank, mb)
    lengths = plan.sequence_lengths()
    i, k = mb.chunk
    all_splits = plan.chunk_zigzag_splits()
    cl = make_chunk_layout(
        ring, ((s, lengths[s]) for s in mb.seqs), chunk=i, num_chunks=k, align=plan.align,
        splits={s: all_splits[(s, i)] for s in mb.seqs if (s, i) in all_splits},
    )  # fmt: skip
    expected = [(slot.seq, a + start, b + start) for slot, start in zip(cl.layout.slots, cl.starts)
                for a, b in slot.parts if b > a]
    got = [(p.seq, p.start, p.end) for p in mb.pieces]
    if got != expected or cl.layout.seqs != mb.seqs:
        raise ValueError(
            f"rank {rank} micro-batch {index} (order {mb.order}, chunk {i} of {k}): pieces {got} "
            f"are not the zigzag share {expected} of ring position {ring.position}; the plan is "
            f"invalid (run plan.validate())"
        )
    return cl
