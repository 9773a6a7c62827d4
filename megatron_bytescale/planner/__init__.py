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
from .zigzag import (
    even_zigzag_split,
    padded_part_size,
    zigzag_chunk,
    zigzag_part_ids,
    zigzag_parts,
    zigzag_share,
    zigzag_split,
    zigzag_split_from_shares,
)

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
    "even_zigzag_split",
    "padded_part_size",
    "resident_tokens",
    "zigzag_chunk",
    "zigzag_part_ids",
    "zigzag_parts",
    "zigzag_share",
    "zigzag_split",
    "zigzag_split_from_shares",
]

# --- cost model, Eq. 3, schedulers, estimate, order -------------------------------------------
from .cost_model import CostModel  # noqa: E402
from .estimate import estimate_plan, simulate_plan  # noqa: E402
from .offload import OffloadDecision, solve_offload  # noqa: E402
from .order import check_deadlock_free  # noqa: E402
from .presets import HardwareSpec, ModelSpec, preset_cost_model  # noqa: E402
from .topology import Topology, ring_link_bytes  # noqa: E402
from .schedulers import SCHEDULERS, make_plan  # noqa: E402

__all__ += [
    "CostModel",
    "HardwareSpec",
    "ModelSpec",
    "OffloadDecision",
    "SCHEDULERS",
    "Topology",
    "check_deadlock_free",
    "estimate_plan",
    "make_plan",
    "preset_cost_model",
    "ring_link_bytes",
    "simulate_plan",
    "solve_offload",
]
