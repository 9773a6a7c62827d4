"""Shared pieces of the planner tests: small cost models and hypothesis strategies."""

from __future__ import annotations

from hypothesis import strategies as st

from megatron_bytescale.planner.cost_model import CostModel

SCHEDULER_NAMES = ("naive", "balance", "static", "pow2")


def small_cost_model(**changes) -> CostModel:
    """A cost model for toy batches (tens to thousands of tokens per rank).

    Chosen so that every regime shows up at these sizes: attention matters from a few hundred
    tokens, offload is only overlap-feasible for long sequences (r_max = (alpha1*s + beta1) *
    B / alpha2), and rings across nodes (4 ranks per node) can be communication-bound.
    """
    values = dict(
        name="toy", num_layers=8, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0, beta2=0.0,
        d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0, dkv_bytes_per_token=128.0,
        p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8, p2p_latency_s=1e-6, ranks_per_node=4,
    )
    values.update(changes)
    return CostModel(**values)


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
