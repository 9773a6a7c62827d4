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
    bins = _first_fit_bins(request, context, cp)
    placements = []
    for k, b in enumerate(bins):
        g = k % dp
        placements.append(Placement(ring=tuple(range(g * cp, (g + 1) * cp)), seqs=tuple(b)))
    meta = {"cp_size": cp, "dp_size": dp, "context_length": int(context), "num_bins": len(bins)}
    return emit_plan(request, placements, scheduler=NAME, meta=meta, offload_allowed=False)


def _first_fit_bins(request: PlanRequest, context: int, cp: int) -> list[list[int]]:
    """First fit in data order under two limits: tokens <= context, zigzag slots <= C."""
    bins: list[list[int]] = []
    tokens: list[int] = []
    slots: list[int] = []
    open_bins: list[int] = []  # indices of bins that may still take something
    for sid, n in zip(request.ids, request.lengths):
        need_slots = n if cp == 1 else 2 * zigzag_chunk(n, cp, request.align)
        for pos, b in enumerate(open_bins):
            if tokens[b] + n <= context and slots[b] + need_slots <= request.capacity:
                bins[b].append(sid)
                tokens[b] += n
                slots[b] += need_slots
                if tokens[b] == context or slots[b] == request.capacity:
                    open_bins.pop(pos)
                break
        else:
            bins.append([sid])
            tokens.append(n)
            slots.append(need_slots)
            open_bins.append(len(bins) - 1)
    return bins
