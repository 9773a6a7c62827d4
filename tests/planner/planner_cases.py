"""Shared pieces of the planner tests: small cost models and hypothesis strategies."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.presets import toy_cost_model
from megatron_bytescale.planner.sharding import ShardingContext, Unit

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


LINEAR_CM = small_cost_model(num_layers=1, alpha1=0.0, beta1=1e-3, gamma=0.0, p2p_bandwidth_inter=1e30,
                             p2p_bandwidth_intra=1e30, p2p_latency_s=0.0, ring_step_overhead_s=0.0)
"""A cost model whose times are worked out by hand: 1 ms per padded token per member, free
links, one layer, 4 ranks per node (:func:`linear_unit`)."""


def linear_ctx(n: int) -> ShardingContext:
    """A sharding context of ``n`` HDP ranks on :data:`LINEAR_CM`, offload off."""
    return ShardingContext(capacity=1000, layers=1, cost_model=LINEAR_CM, hdp_size=n, offload=False)


def linear_unit(seq: int, length: int, ring: int = 1, ratio: float = 0.0) -> Unit:
    """Sequence ``seq`` of ``length`` tokens on a ring of ``ring``: ``2 D ceil(L / 2D) / D`` ms
    per member (zigzag padding), a single ``L`` ms (:data:`LINEAR_CM`)."""
    time = 2 * ring * -(-length // (2 * ring)) / ring * 1e-3 if ring > 1 else length * 1e-3
    return Unit(seqs=(seq,), lengths=(length,), ring_size=ring, min_ring_size=ring, time=time,
                offload_ratio=ratio)


def nothing_skipped(patch) -> None:
    """``balance`` with no unit set or candidate skipped by a floor, and every candidate timed to
    its end (``patch``: a pytest ``MonkeyPatch``): the reference a plan made with the skips must
    equal."""
    import megatron_bytescale.planner.schedulers.balance as balance_mod

    real = balance_mod.candidate_finish_times
    patch.setattr(balance_mod, "_units_floor", lambda *args: 0.0)
    patch.setattr(balance_mod, "alone_floors", lambda candidates, *args, **kwargs: [0.0] * len(candidates))
    patch.setattr(balance_mod, "order_free_floor", lambda *args, **kwargs: 0.0)
    patch.setattr(balance_mod, "candidate_finish_times",
                  lambda request, placements, cost_model, seconds=None, stop_above=None:
                  real(request, placements, cost_model, seconds))


def random_pipeline_lists(rng: random.Random) -> tuple[list[list[int]], dict[int, float], int]:
    """Pipelines with single micro-batches and rings at one local index on all members (a ring's
    members are first padded with singles to the same count), durations of mixed scales and
    zeros, orders ascending on every pipeline."""
    n, pp = rng.randint(1, 7), rng.randint(1, 6)
    lists: list[list[int]] = [[] for _ in range(n)]
    dur: dict[int, float] = {}
    order = 0
    for _ in range(rng.randint(0, 14)):
        if n > 1 and rng.random() < 0.35:
            members = rng.sample(range(n), rng.randint(2, n))
            depth = max(len(lists[r]) for r in members)
            for r in members:
                while len(lists[r]) < depth:
                    lists[r].append(order)
                    dur[order] = rng.choice([0.0, rng.random()])
                    order += 1
            for r in members:
                lists[r].append(order)
        else:
            lists[rng.randrange(n)].append(order)
        dur[order] = rng.random() * rng.choice([1.0, 1e-3, 100.0])
        order += 1
    return lists, dur, pp
