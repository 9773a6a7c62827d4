"""Split one ring micro-batch of a plan into causal chunks along the pipeline (Seq1F1B-style).

The plan unit of docs/pipeline.md ("Long sequences split along the pipeline"): the micro-batch
of ``order`` becomes ``k`` micro-batches, chunks ``0 .. k-1`` of the same ring at orders
``order .. order + k - 1`` (every later order moves up by ``k - 1``), each chunk zigzagged over
the ring with the planner's split. Every member holds the chunks where it held the micro-batch,
so rings stay at one local index on all their members. This is the step a scheduler takes when
its estimate says a split pays: :func:`.chunk_estimate.split_where_faster` decides (called by
``make_plan(seq_split=True)`` after PP-Balance); this module does not.
"""

from __future__ import annotations

import dataclasses

from .plan import MicroBatch, PlanError, RankPlan, StepPlan, build_ring_micro_batches
from .zigzag import causal_chunks


def split_micro_batch(plan: StepPlan, order: int, num_chunks: int) -> StepPlan:
    """``plan`` with ring micro-batch ``order`` split into ``num_chunks`` causal chunks.

    The chunks do not offload: a micro-batch that offloads is split only if every chunk fits
    the capacity without offload. The estimate is dropped (it described the unsplit plan).
    Timing-only plans (the simulator's, without pieces) get timing-only chunks, checked for the
    one rule they can break: every ring at one local index on its members.
    Raises ValueError when the split cannot run or would not be a valid plan.
    """
    if plan.pp_size < 2:
        raise ValueError(f"splitting a micro-batch along the pipeline needs pp_size >= 2, the plan has "
                         f"{plan.pp_size}")
    if num_chunks < 2:
        raise ValueError(f"num_chunks ({num_chunks}) must be >= 2 to split a micro-batch")
    found = [mb for rp in plan.ranks for mb in rp.micro_batches if mb.order == order]
    if not found:
        raise ValueError(f"the plan has no micro-batch of order {order}")
    mb0 = found[0]
    if mb0.chunk is not None:
        raise ValueError(f"order {order} is already chunk {mb0.chunk[0]} of {mb0.chunk[1]}")
    lengths = plan.sequence_lengths()
    longest = max(lengths[s] for s in mb0.seqs)
    if num_chunks > longest:
        raise ValueError(f"order {order}: {num_chunks} chunks for sequences of at most {longest} tokens; "
                         f"split into at most {longest}")
    timing_only = all(not mb.pieces for mb in found)  # the simulator's plans carry no pieces
    if timing_only:
        chunks = [dict.fromkeys(mb0.ring, _timing_chunk(mb0, lengths, order + i, i, num_chunks))
                  for i in range(num_chunks)]  # fmt: skip
    else:
        chunks = [
            build_ring_micro_batches(order=order + i, ring=mb0.ring, seqs=mb0.seqs, lengths=lengths,
                                     align=plan.align, chunk=(i, num_chunks))
            for i in range(num_chunks)
        ]  # fmt: skip
    shift = num_chunks - 1
    ranks = []
    for rp in plan.ranks:
        mbs: list[MicroBatch] = []
        for mb in rp.micro_batches:
            if mb.order == order:
                mbs.extend(c[rp.rank] for c in chunks)
            else:
                mbs.append(mb if mb.order < order else dataclasses.replace(mb, order=mb.order + shift))
        ranks.append(RankPlan(rank=rp.rank, micro_batches=tuple(mbs)))
    out = dataclasses.replace(plan, ranks=tuple(ranks), estimate=None)
    try:
        return _check_local_indices(out) if timing_only else out.validate()
    except PlanError as exc:
        raise ValueError(f"splitting order {order} into {num_chunks} chunks gives an invalid plan: {exc}") from None


def _timing_chunk(mb: MicroBatch, lengths: dict[int, int], order: int, i: int, k: int) -> MicroBatch:
    """Chunk ``i`` of a timing-only micro-batch: the sequences with tokens in it, no pieces."""
    seqs = tuple(s for s in mb.seqs if causal_chunks(lengths[s], k)[i][1] > causal_chunks(lengths[s], k)[i][0])
    return MicroBatch(order=order, ring=mb.ring, offload_ratio=0.0, seqs=seqs, pieces=(), chunk=(i, k))


def _check_local_indices(plan: StepPlan) -> StepPlan:
    """What a timing-only plan can be checked for: every ring at one local index on its members."""
    where: dict[int, set[int]] = {}
    for rp in plan.ranks:
        for local, mb in enumerate(rp.micro_batches):
            where.setdefault(mb.order, set()).add(local)
    for order, places in where.items():
        if len(places) > 1:
            raise PlanError(f"order {order}: ring members would hold it at local indices {sorted(places)}")
    return plan
