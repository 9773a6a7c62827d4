"""Shared pieces of the planner tests: small cost models and hypothesis strategies."""

from __future__ import annotations

from hypothesis import strategies as st

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.presets import toy_cost_model

SCHEDULER_NAMES = ("naive", "balance", "static", "pow2")


def small_cost_model(**changes) -> CostModel:
    """The toy cost model (:func:`megatron_bytescale.planner.presets.toy_cost_model`)."""
    return toy_cost_model(**changes)


HDP_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24)


@st.composite
def batches(draw, *, max_items: int = 30):
    """(lengths, hdp_size, capacity, align): a mix of short and long sequences that fits."""
    hdp = draw(st.sampled_from(HDP_SIZES))
    capacity = draw(st.integers(16, 256))
    align = draw(st.sampled_from((1, 1, 2, 4)))
    n = draw(st.integers(0, max_items))
    longest = capacity * hdp
    lengths = draw(st.lists(
        st.one_of(st.integers(1, capacity), st.integers(capacity, max(capacity, longest))),
        min_size=n, max_size=n,
    ))
    return lengths, hdp, capacity, align


def lists_by_rank(placements) -> dict[int, list[int]]:
    """Each rank's list of first sequence ids, in placement order (one id per placement)."""
    out: dict[int, list[int]] = {}
    for p in placements:
        for r in p.ring:
            out.setdefault(r, []).append(p.seqs[0])
    return out
