"""The HDP planner: ByteScale's brain. Imports numpy only (no torch, no megatron).

It turns the sequence lengths of one global batch into a :class:`StepPlan`: which tokens
every HDP rank trains in which micro-batch, over which ring, with which offload ratio.
"""

from .plan import (
    Estimate,
    MicroBatch,
    Piece,
    PlanBuilder,
    PlanError,
    RankPlan,
    Sequence,
    StepPlan,
    build_ring_micro_batches,
    resident_tokens,
)
from .zigzag import zigzag_chunk, zigzag_part_ids, zigzag_parts, zigzag_share

__all__ = [
    "Estimate",
    "MicroBatch",
    "Piece",
    "PlanBuilder",
    "PlanError",
    "RankPlan",
    "Sequence",
    "StepPlan",
    "build_ring_micro_batches",
    "resident_tokens",
    "zigzag_chunk",
    "zigzag_part_ids",
    "zigzag_parts",
    "zigzag_share",
]
