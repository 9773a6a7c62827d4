"""Attention layouts and micro-batch materialisation: a plan's micro-batch as local tensors.

A micro-batch on a rank is one ring plus the sequences it carries (D4). The local buffer holds,
for every sequence in the plan's ``seqs`` order, one *slot*:

- ring of size 1: the whole sequence, unpadded (``num_local == length``);
- ring of size N > 1: the real tokens of zigzag part i, then those of part 2N-1-i (i = ring
  position), then padding, ``num_local == 2 * chunk`` rows in all, where ``chunk`` is the
  largest of the sequence's 2N parts rounded up to ``align`` (:func:`padded_part_size`).

The parts are whatever contiguous split the plan states (``StepPlan.zigzag_splits``; the
planner's own cuts parts of ``ceil(L / 2N)``, an even split is just as valid). A slot's real
tokens are always a *prefix* of the slot, so ring attention skips padding without masks, and
every block of a ring step is one contiguous row range per sequence (:mod:`.ring_schedule`).

Every member of a ring computes the same slots (same seqs, lengths, split, align), so the buffer
length and slot offsets agree across the ring - receive buffers can be pre-sized locally.

:func:`build_micro_batch` turns this rank's ``index``-th micro-batch of a :class:`StepPlan`
into token, label, loss-mask and position tensors in that buffer order. Labels are the next
token of the ORIGINAL sequence (so a rank holding zigzag parts still predicts across part
boundaries), positions are positions in the original sequence (for RoPE, D3), and padding
(token id 0) and the last token of every sequence carry loss mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from ..planner.plan import MicroBatch, StepPlan
from ..planner.zigzag import Span, padded_part_size, zigzag_split
from .hdp_group import HDPGroup, Ring

PAD_TOKEN_ID = 0


@dataclass(frozen=True, kw_only=True)
class SequenceSlot:
    """One sequence's tokens in a rank's local buffer.

    Attributes:
        seq: sequence id.
        length: real tokens of the whole sequence.
        chunk: rows reserved per zigzag part (``length`` on a ring of size 1).
        offset: first row of the slot in the local buffer.
        num_local: rows of the slot, padding included.
        parts: real-token ranges ``[start, end)`` of the original sequence held here, in local
            order: ``(part i, part 2N-1-i)`` (either may be empty), or ``((0, length),)``.
        num_real: real tokens in the slot (always the first ``num_real`` rows).
        real_by_position: ``num_real`` of every ring position (identical on all members).
        first_by_position: real tokens of every ring position's first part (part i).
    """

    seq: int
    length: int
    chunk: int
    offset: int
    num_local: int
    parts: tuple[Span, ...]
    num_real: int
    real_by_position: tuple[int, ...]
    first_by_position: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.num_local


def _check_split(seq: int, length: int, ring_size: int, split: tuple[Span, ...]) -> None:
    want = 1 if ring_size == 1 else 2 * ring_size
    pos = 0
    for a, b in split:
        if a != pos or b < a:
            break
        pos = b
    else:
        if len(split) == want and pos == length:
            return
    raise ValueError(
        f"sequence {seq}: split {list(split)} is not {want} contiguous parts of [0, {length}) "
        f"for a ring of {ring_size}"
    )


def make_slot(
    *,
    seq: int,
    length: int,
    ring_size: int,
    position: int,
    align: int,
    offset: int,
    split: tuple[Span, ...] | None = None,
) -> SequenceSlot:
    """The slot of sequence ``seq`` for ring ``position`` starting at row ``offset``.

    ``split`` is the sequence's 2N parts (default: the planner's :func:`zigzag_split`).
    """
    if length < 1:
        raise ValueError(f"sequence {seq}: length {length} must be >= 1")
    split = zigzag_split(length, ring_size, align) if split is None else tuple(split)
    _check_split(seq, length, ring_size, split)
    if ring_size == 1:
        return SequenceSlot(
            seq=seq, length=length, chunk=length, offset=offset, num_local=length,
            parts=((0, length),), num_real=length, real_by_position=(length,),
            first_by_position=(length,),
        )  # fmt: skip
    sizes = [b - a for a, b in split]
    first = tuple(sizes[p] for p in range(ring_size))
    real = tuple(first[p] + sizes[2 * ring_size - 1 - p] for p in range(ring_size))
    chunk = padded_part_size(split, align)
    return SequenceSlot(
        seq=seq,
        length=length,
        chunk=chunk,
        offset=offset,
        num_local=2 * chunk,
        parts=(split[position], split[2 * ring_size - 1 - position]),
        num_real=real[position],
        real_by_position=real,
        first_by_position=first,
    )


@dataclass(frozen=True, kw_only=True)
class AttentionLayout:
    """The local buffer of one micro-batch on one ring member.

    ``num_tokens`` rows (padding included); ``slots`` in buffer order; ``cu_seqlens`` (int32,
    CPU) are the slot boundaries ``[0, end_0, end_1, ...]`` for varlen kernels. Build it with
    :func:`make_attention_layout` or from a plan with :func:`layout_for`.
    """

    ring: Ring
    slots: tuple[SequenceSlot, ...]
    num_tokens: int
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per layout and ``key`` (ring blocks, device metadata): every layer
        of a micro-batch reuses what the first one derived, without hashing the layout."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def __post_init__(self) -> None:
        if not self.slots and self.num_tokens:  # no slots: the empty micro-batch (0 rows)
            raise ValueError("an attention layout needs at least one sequence")
        pos = 0
        for slot in self.slots:
            if slot.offset != pos:
                raise ValueError(
                    f"sequence {slot.seq}: slot starts at row {slot.offset}, expected {pos}"
                )
            if len(slot.real_by_position) != self.ring.size:
                raise ValueError(
                    f"sequence {slot.seq}: slot describes {len(slot.real_by_position)} "
                    f"ring positions, "
                    f"the ring has {self.ring.size}"
                )
            pos = slot.end
        if pos != self.num_tokens:
            raise ValueError(f"slots cover {pos} rows but num_tokens is {self.num_tokens}")

    @cached_property
    def cu_seqlens_list(self) -> tuple[int, ...]:
        return (0, *(slot.end for slot in self.slots))

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """Slot boundaries in the local buffer, int32 on CPU."""
        return torch.tensor(self.cu_seqlens_list, dtype=torch.int32)

    @property
    def max_seqlen(self) -> int:
        return max(slot.num_local for slot in self.slots)

    @cached_property
    def max_position(self) -> int:
        """The largest position in its original sequence of any real row (host integer)."""
        return max((b - 1 for slot in self.slots for a, b in slot.parts if b > a), default=0)

    @property
    def num_real_tokens(self) -> int:
        return sum(slot.num_real for slot in self.slots)

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(slot.seq for slot in self.slots)

    def real_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[num_tokens]``: True for real tokens, False for padding."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        for slot in self.slots:
            mask[slot.offset : slot.offset + slot.num_real] = True
        return mask.to(device) if device is not None else mask

    def global_positions(self) -> torch.Tensor:
        """Long ``[num_tokens]``: position of every row in its original sequence, -1 on padding."""
        positions = torch.full((self.num_tokens,), -1, dtype=torch.long)
        for slot in self.slots:
            positions[slot.offset : slot.offset + slot.num_real] = _slot_positions(slot)
        return positions

    def fingerprint(self) -> tuple[int, ...]:
        """Integers every ring member must agree on (used by the neighbour check)."""
        items = [self.num_tokens, self.ring.size, len(self.slots)]
        items += list(self.ring.members)
        for slot in self.slots:
            items += [slot.seq, slot.length, slot.chunk, *slot.first_by_position]
            items += slot.real_by_position
        return tuple(items)


def _slot_positions(slot: SequenceSlot) -> torch.Tensor:
    """Positions in the original sequence of the slot's real rows, in row order."""
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in slot.parts])


def make_attention_layout(
    ring: Ring,
    sequences: Iterable[tuple[int, int]],
    *,
    align: int = 1,
    splits: Mapping[int, tuple[Span, ...]] | None = None,
) -> AttentionLayout:
    """The layout of ``sequences`` (``(seq_id, length)`` in buffer order) on ``ring``.

    ``splits`` gives a sequence's zigzag parts (``StepPlan.zigzag_splits``); a sequence it does
    not name gets the planner's own split.
    """
    splits = splits or {}
    slots: list[SequenceSlot] = []
    offset = 0
    seen: set[int] = set()
    for seq, length in sequences:
        if seq in seen:
            raise ValueError(f"sequence {seq} appears twice in one micro-batch")
        seen.add(seq)
        slot = make_slot(
            seq=int(seq),
            length=int(length),
            ring_size=ring.size,
            position=ring.position,
            align=align,
            offset=offset,
            split=splits.get(seq),
        )
        slots.append(slot)
        offset = slot.end
    return AttentionLayout(ring=ring, slots=tuple(slots), num_tokens=offset)


# ---------------------------------------------------------------------- materialisation
@dataclass(kw_only=True)
class MicroBatchTensors:
    """One micro-batch of one rank, ready for the model (all tensors ``[num_tokens]``).

    Attributes:
        tokens: token ids (padding: 0).
        labels: next token of the original sequence (0 where there is none).
        loss_mask: 1.0 where the label is a real next token, else 0.0.
        position_ids: position in the original sequence (padding: 0).
        layout: where every sequence sits in the buffer (for ring attention).
        order: the plan's global order number of this ring micro-batch (D5).
        offload_ratio: the plan's activation offload ratio for this micro-batch (D8).
        num_loss_tokens: ``loss_mask.sum()`` as an int (token-level loss, D6).
        chunk: for a chunk of a ring micro-batch split along the pipeline, its
            :class:`.ChunkLayout` (``layout`` is then ``chunk.layout``); None otherwise.
        chunk_prefixes: the K/V kept between the chunks of one split micro-batch, one
            :class:`.ChunkPrefix` per attention layer; the pipeline driver gives every chunk of a
            group the same dict.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    layout: AttentionLayout
    order: int
    offload_ratio: float
    num_loss_tokens: int
    chunk: Any = None
    chunk_prefixes: dict | None = None


def _resolve_rank(plan: StepPlan, hdp: HDPGroup | int) -> tuple[int, HDPGroup | None]:
    if isinstance(hdp, HDPGroup):
        if hdp.size != plan.hdp_size:
            raise ValueError(
                f"plan is for {plan.hdp_size} HDP ranks but the HDP group has {hdp.size}"
            )
        return hdp.rank, hdp
    rank = int(hdp)
    if not 0 <= rank < plan.hdp_size:
        raise ValueError(f"rank {rank} is outside the plan's HDP ranks [0, {plan.hdp_size})")
    return rank, None


def _micro_batch(plan: StepPlan, rank: int, index: int) -> MicroBatch:
    mbs = _plan_rank(plan, rank).micro_batches
    if not 0 <= index < len(mbs):
        raise IndexError(
            f"rank {rank} has {len(mbs)} micro-batches in this plan; index {index} is out of range"
        )
    return mbs[index]


def plan_micro_batch(plan: StepPlan, hdp: HDPGroup | int, index: int) -> tuple[int, MicroBatch]:
    """This rank's HDP rank and its ``index``-th micro-batch of ``plan``."""
    rank, _ = _resolve_rank(plan, hdp)
    return rank, _micro_batch(plan, rank, index)


def plan_ring(plan: StepPlan, hdp: HDPGroup | int, rank: int, mb: MicroBatch) -> Ring:
    """The ring descriptor of ``mb`` for ``rank`` (which must be a member)."""
    if rank not in mb.ring:
        raise ValueError(
            f"rank {rank} micro-batch of order {mb.order}: not a member of its ring {list(mb.ring)}"
        )
    return hdp.ring(mb.ring) if isinstance(hdp, HDPGroup) else Ring(mb.ring, mb.ring.index(rank))


def layout_for(plan: StepPlan, hdp: HDPGroup | int, index: int) -> AttentionLayout:
    """The attention layout of this rank's ``index``-th micro-batch (checks its pieces)."""
    rank, group = _resolve_rank(plan, hdp)
    mb = _micro_batch(plan, rank, index)
    if mb.chunk is not None:
        raise ValueError(
            f"rank {rank} micro-batch {index} (order {mb.order}) is chunk {mb.chunk[0]} of "
            f"{mb.chunk[1]} of a split micro-batch; use chunk_layout_for"
        )
    ring = plan_ring(plan, group if group is not None else rank, rank, mb)
    lengths = plan.sequence_lengths()
    missing = [s for s in mb.seqs if s not in lengths]
    if missing:
        raise ValueError(
            f"rank {rank} micro-batch {index} (order {mb.order}): unknown sequences {missing}"
        )
    all_splits = plan.zigzag_splits()
    splits = {s: all_splits[s] for s in mb.seqs if s in all_splits}
    layout = make_attention_layout(
        ring, ((s, lengths[s]) for s in mb.seqs), align=plan.align, splits=splits
    )
    expected = [(slot.seq, a, b) for slot in layout.slots for a, b in slot.parts if b > a]
    got = [(p.seq, p.start, p.end) for p in mb.pieces]
    if got != expected or any(s not in splits for s in mb.seqs):
        raise ValueError(
            f"rank {rank} micro-batch {index} (order {mb.order}): pieces {got} are not the zigzag "
            f"share {expected} of ring position {ring.position}; the plan is invalid "
            f"(run plan.validate())"
        )
    return layout


def _as_long_tensor(seq: int, tokens: torch.Tensor | np.ndarray, length: int) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    if t.dim() != 1:
        raise ValueError(f"sequence {seq}: tokens must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() != length:
        raise ValueError(
            f"sequence {seq}: got {t.numel()} tokens but the plan says length {length}"
        )
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"sequence {seq}: token ids must be integers, got {t.dtype}")
    return t.to(device="cpu", dtype=torch.long)


def build_micro_batch(
    plan: StepPlan,
    hdp: HDPGroup | int,
    index: int,
    tokens_by_seq: Mapping[int, torch.Tensor | np.ndarray],
    *,
    device: torch.device | str | None = None,
) -> MicroBatchTensors:
    """Materialise this rank's ``index``-th micro-batch of ``plan``.

    Args:
        plan: the step plan (assumed valid; this micro-batch's pieces are re-checked).
        hdp: the HDP group, or a plain HDP rank (for tests and tools without processes).
        index: position in this rank's micro-batch list (the plan's run order).
        tokens_by_seq: every sequence of the micro-batch as a 1-D integer array of its length.
        device: where the tensors go (default CPU).
    """
    mb = _micro_batch(plan, _resolve_rank(plan, hdp)[0], index)
    chunk = None
    if mb.chunk is None:
        layout = layout_for(plan, hdp, index)
        starts = [0] * len(layout.slots)
    else:
        from .chunk_layout import chunk_layout_for

        chunk = chunk_layout_for(plan, hdp, index)
        layout, starts = chunk.layout, list(chunk.starts)
    lengths = plan.sequence_lengths()
    toks, labs, masks, poss = [], [], [], []
    for slot, start in zip(layout.slots, starts):
        if slot.seq not in tokens_by_seq:
            raise ValueError(f"tokens_by_seq has no tokens for sequence {slot.seq}")
        length = lengths[slot.seq]  # a chunk's slot holds part of a longer sequence
        seq_tokens = _as_long_tensor(slot.seq, tokens_by_seq[slot.seq], length)
        g = _slot_positions(slot) + start
        has_next = g + 1 < length
        pad = slot.num_local - slot.num_real
        toks += [seq_tokens[g], torch.full((pad,), PAD_TOKEN_ID, dtype=torch.long)]
        nxt = seq_tokens[(g + 1).clamp(max=length - 1)]
        labs += [torch.where(has_next, nxt, PAD_TOKEN_ID), toks[-1]]
        masks += [has_next.to(torch.float32), torch.zeros(pad)]
        poss += [g, torch.zeros(pad, dtype=torch.long)]
    loss_mask = torch.cat(masks)
    move = _mover(device)
    return MicroBatchTensors(
        tokens=move(torch.cat(toks)),
        labels=move(torch.cat(labs)),
        loss_mask=move(loss_mask),
        position_ids=move(torch.cat(poss)),
        layout=layout,
        order=mb.order,
        offload_ratio=mb.offload_ratio,
        num_loss_tokens=int(loss_mask.sum().item()),
        chunk=chunk,
    )


def _mover(device: torch.device | str | None):
    """Host tensors -> ``device``: CUDA copies are staged in pinned memory and non-blocking, so
    building the next micro-batch never waits for the GPU (D12)."""
    if device is None or torch.device(device).type == "cpu":
        return lambda t: t
    if torch.device(device).type == "cuda":
        return lambda t: t.pin_memory().to(device, non_blocking=True)
    return lambda t: t.to(device)


def iter_micro_batches(
    plan: StepPlan,
    hdp: HDPGroup | int,
    tokens_by_seq: Mapping[int, torch.Tensor | np.ndarray],
    *,
    device: torch.device | str | None = None,
) -> Iterator[MicroBatchTensors]:
    """This rank's micro-batches of ``plan`` in run order (increasing ``order``, D5)."""
    rank, _ = _resolve_rank(plan, hdp)
    for index in range(len(_plan_rank(plan, rank).micro_batches)):
        yield build_micro_batch(plan, hdp, index, tokens_by_seq, device=device)


def _plan_rank(plan: StepPlan, rank: int):
    if len(plan.ranks) != plan.hdp_size or plan.ranks[rank].rank != rank:
        raise ValueError(f"plan has no entry for rank {rank} (malformed plan; run plan.validate())")
    return plan.ranks[rank]


def empty_micro_batch(hdp: HDPGroup | int, *, device: torch.device | str | None = None
                      ) -> MicroBatchTensors:
    """A micro-batch with no real token, on a ring of this rank alone (``order`` -1).

    Under expert parallelism every rank of an expert group meets the others in the MoE
    all-to-all of every slot (``StepPlan.ep_size``); a rank with nothing to train in a slot
    runs this one, forward and backward, so its group never waits for it. Its row is one
    padding token (megatron-core's attention cannot reshape a row of zero tokens): loss mask 0,
    no slot in the layout, so it attends to nothing, adds no router loss and changes no
    gradient.
    """
    rank = hdp.rank if isinstance(hdp, HDPGroup) else int(hdp)
    ring = hdp.ring((rank,)) if isinstance(hdp, HDPGroup) else Ring((rank,), 0)
    move = _mover(device)
    pad = torch.full((1,), PAD_TOKEN_ID, dtype=torch.long)
    return MicroBatchTensors(
        tokens=move(pad), labels=move(pad.clone()), loss_mask=move(torch.zeros(1)),
        position_ids=move(torch.zeros(1, dtype=torch.long)),
        layout=AttentionLayout(ring=ring, slots=(), num_tokens=0),
        order=-1, offload_ratio=0.0, num_loss_tokens=0,
    )
