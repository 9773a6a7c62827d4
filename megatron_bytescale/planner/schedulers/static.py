"""``static``: the Megatron/MegaScale static DP x CP baseline (paper §8.1 "Baseline", paper.md §7.1).

* Context length: ``context_length`` if given, else the batch's longest sequence.
* CP: the fewest ranks that hold the context, i.e. the smallest divisor of ``hdp_size`` that is
  >= ceil(context / C) and whose per-rank zigzag share of a context-long sequence fits C
  (padding included). DP = hdp_size / CP. CP groups are blocks of consecutive HDP ranks
  (Megatron puts CP inside DP in its rank order).
* Sequences are packed first-fit in data order into bins of at most ``context`` tokens; a bin
  also closes when its per-rank share would pass C: every document is zigzag-split over CP with
  its own padding (2 * CP parts of ``zigzag_chunk`` tokens), so a member holds
  ``sum_j 2 * zigzag_chunk(s_j, CP, align)`` token slots, and that must stay <= C. (Thousands of
  tiny documents in one 2M bin would otherwise need more than C slots per rank.)
* Every bin is one micro-batch over its whole CP group (per-document zigzag, ring = the group);
  bins go round-robin to the DP groups. No offload.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..plan import StepPlan
from ..zigzag import zigzag_chunk
from ._common import Placement, PlanRequest, apply_overlong, emit_plan

NAME = "static"


def static_cp_size(hdp_size: int, context_length: int, capacity: int, align: int = 1) -> int:
    """The smallest divisor of ``hdp_size`` whose ranks hold a ``context_length`` sequence.

    Raises:
        ValueError: no divisor works (the context needs more ranks than there are, or no
            divisor of ``hdp_size`` is large enough).
    """
    need = max(1, math.ceil(context_length / capacity))
    for cp in range(need, hdp_size + 1):
        if hdp_size % cp:
            continue
        if cp == 1 or 2 * zigzag_chunk(context_length, cp, align) <= capacity:
            return cp
    raise ValueError(
        f"static: no context-parallel size fits: context length {context_length} needs at least "
        f"{need} ranks of capacity {capacity}, and no divisor of hdp_size {hdp_size} in "
        f"[{need}, {hdp_size}] holds it; use more HDP ranks, a larger capacity or a shorter "
        f"--context-length"
    )


def plan_static(request: PlanRequest) -> StepPlan:
    """The static baseline; see the module docstring."""
    context = request.context_length or max(request.lengths, default=0)
    if not request.lengths:
        return emit_plan(request, [], scheduler=NAME, meta={"cp_size": 1, "dp_size": request.hdp_size},
                         offload_allowed=False)
    cp = static_cp_size(request.hdp_size, context, request.capacity, request.align)
    request = apply_overlong(
        request, context, why=f"the static context length is {context}",
        hint="Pass a larger --context-length",
    )
    dp = request.hdp_size // cp
    bins = [[request.ids[i] for i in b] for b in first_fit_bins(
        request.lengths, context=context, capacity=request.capacity, cp=cp, align=request.align)]
    placements = []
    for k, b in enumerate(bins):
        g = k % dp
        placements.append(Placement(ring=tuple(range(g * cp, (g + 1) * cp)), seqs=tuple(b)))
    meta = {"cp_size": cp, "dp_size": dp, "context_length": int(context), "num_bins": len(bins)}
    return emit_plan(request, placements, scheduler=NAME, meta=meta, offload_allowed=False)


def first_fit_bins(lengths: Sequence[int], *, context: int, capacity: int, cp: int,
                   align: int = 1) -> list[list[int]]:
    """The static baseline's bins, as lists of positions in ``lengths``: first fit in data
    order under two limits, tokens <= ``context`` and zigzag slots <= ``capacity``.

    Every document goes into the lowest-numbered bin where both still fit, else into a new bin.
    Scanning the bins for each document is quadratic (20k documents that each fill a bin took
    25 s); a segment tree over the bins that keeps, per subtree, the most free tokens and the
    most free slots of any bin in it finds the same bin by descending only into subtrees where
    both could fit.

    A bin that is full when it opens (a document of the whole context, or of the whole
    per-rank slots) can never take another document (every document has >= 1 token and slot),
    so it gets no leaf: the tree holds only bins with room, in bin order, and a batch of
    documents that each fill the context (``simulate --contexts 1``: one bin per token) costs
    one look at an empty tree per document.
    """
    free = _FreeSpace()
    bins: list[list[int]] = []
    open_bins: list[int] = []  # leaf -> its bin; leaves are given in bin order
    for pos, n in enumerate(lengths):
        need_slots = n if cp == 1 else 2 * zigzag_chunk(n, cp, align)
        leaf = free.first_fit(n, need_slots)
        if leaf < 0:
            if n < context and need_slots < capacity:
                free.set(len(open_bins), context - n, capacity - need_slots)
                open_bins.append(len(bins))
            bins.append([pos])
        else:
            bins[open_bins[leaf]].append(pos)
            free.take(leaf, n, need_slots)
    return bins


class _FreeSpace:
    """Free tokens and free slots of the bins opened so far, and the first bin with room for both.

    A segment tree: leaf ``size + b`` holds bin b's free tokens and slots (-1 for a bin not yet
    opened), every inner node the largest free tokens and the largest free slots below it. The
    first fit descends left-first into children whose maxima both suffice and, where none below
    does fit (the two maxima came from different bins), moves on to the next subtree to the
    right; the search is logarithmic unless tokens and slots disagree bin by bin.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size  # a power of two; doubled when a bin beyond it opens
        self.tokens = [-1] * (2 * size)
        self.slots = [-1] * (2 * size)

    def _grow(self) -> None:
        """Twice as many leaves: the tree stays as deep as the bins need, not the documents."""
        size, old_tokens, old_slots = self.size, self.tokens, self.slots
        self.size = 2 * size
        self.tokens = [-1] * (4 * size)
        self.slots = [-1] * (4 * size)
        self.tokens[2 * size:3 * size] = old_tokens[size:]
        self.slots[2 * size:3 * size] = old_slots[size:]
        tokens, slots = self.tokens, self.slots
        for i in range(2 * size - 1, 0, -1):
            tokens[i] = max(tokens[2 * i], tokens[2 * i + 1])
            slots[i] = max(slots[2 * i], slots[2 * i + 1])

    def set(self, b: int, tokens: int, slots: int) -> None:
        while b >= self.size:
            self._grow()
        i = self.size + b
        self.tokens[i] = tokens
        self.slots[i] = slots
        self._update(i)

    def take(self, b: int, tokens: int, slots: int) -> None:
        i = self.size + b
        self.tokens[i] -= tokens
        self.slots[i] -= slots
        self._update(i)

    def _update(self, i: int) -> None:
        tokens, slots = self.tokens, self.slots
        i //= 2
        while i:
            left, right = 2 * i, 2 * i + 1
            t = tokens[left] if tokens[left] > tokens[right] else tokens[right]
            s = slots[left] if slots[left] > slots[right] else slots[right]
            if tokens[i] == t and slots[i] == s:
                break
            tokens[i], slots[i] = t, s
            i //= 2

    def first_fit(self, tokens_needed: int, slots_needed: int) -> int:
        """The lowest bin with at least that many free tokens and slots, or -1."""
        tokens, slots, size = self.tokens, self.slots, self.size
        i = 1
        while True:
            if tokens[i] >= tokens_needed and slots[i] >= slots_needed:
                if i >= size:
                    return i - size
                i *= 2  # the left subtree first: lower bins
                continue
            while i & 1:  # no fit below i: up while i is a right child, then to the right sibling
                i >>= 1
            if i == 0:  # climbed past the root: no bin fits
                return -1
            i += 1
