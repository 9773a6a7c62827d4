"""Eq. 3's host budget at alignments 1, 3, 4, 8 and 16 (the other tests use 1, 2 and 4 only).

A member of a ring that offloads r of a micro-batch fills ``r * (l - 2) * Act(share)`` bytes of
host memory, ``share`` being the real tokens of the fullest member. With alignment, every one of
the 2N zigzag parts is padded to a multiple of ``align``, which moves tokens between members.
The share is computed here by placing every token (token t goes to part ``t // chunk``; member
i holds parts i and 2N-1-i) and counting, not by the planner's closed form.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.offload import (
    fits_host_memory,
    host_bytes_per_member,
    max_zigzag_share,
    max_zigzag_share_array,
    solve_offload,
)
from megatron_bytescale.planner.schedulers import make_plan
from planner_cases import small_cost_model

ALIGNS = (1, 3, 4, 8, 16)
LAYERS = 8


def member_tokens(length: int, ring: int, align: int) -> np.ndarray:
    """Real tokens of each member of a ring of ``ring`` (each part padded to ``align``)."""
    if ring == 1:
        return np.array([length])
    parts = 2 * ring
    chunk = -(-length // parts)
    while chunk % align:  # pad each part up to the alignment, one token at a time
        chunk += 1
    part = np.arange(length) // chunk
    member = np.where(part < ring, part, parts - 1 - part)
    return np.bincount(member, minlength=ring)


def eq3_model(**changes):
    """Act(s) = s bytes per layer, attention slow enough that offload always overlaps."""
    return small_cost_model(**{"num_layers": LAYERS, "alpha1": 1e-3, "alpha2": 1.0, "beta2": 0.0,
                               **changes})


LENGTHS = (1, 7, 100, 999, 1000, 4097, 10007)
RINGS = (1, 2, 3, 4, 5, 8, 16)


@pytest.mark.parametrize("align", ALIGNS)
def test_the_fullest_share_and_its_host_bytes_match_token_counting(align):
    cm = eq3_model()
    grid = [(s, d) for s in LENGTHS for d in RINGS]
    counted = np.array([member_tokens(s, d, align).max() for s, d in grid])
    scalar = np.array([max_zigzag_share(s, d, align) for s, d in grid])
    vector = max_zigzag_share_array(np.array([s for s, _ in grid]), np.array([d for _, d in grid]), align)
    assert scalar.tolist() == counted.tolist()
    assert vector.tolist() == counted.tolist()
    for (s, d), share in zip(grid, counted):
        for r in (0.37, 1.0):
            want = r * (LAYERS - 2) * float(share)  # Act(share) = share bytes per layer
            got = host_bytes_per_member(s, d, r, layers=LAYERS, cost_model=cm, align=align)
            assert got == pytest.approx(want, rel=1e-12), (s, d, align, r)
            # the budget is a bound: exactly the need fits, a byte less does not (in flight 1, 2)
            for in_flight in (1, 2):
                need = in_flight * want
                fits = lambda budget: fits_host_memory(  # noqa: E731
                    s, d, r, layers=LAYERS, align=align, in_flight=in_flight,
                    cost_model=cm.with_(host_memory_bytes=budget))
                assert fits(need)
                if need > 1:
                    assert not fits(need * (1 - 1e-6) - 1)


@pytest.mark.parametrize("align", ALIGNS)
def test_eq3_keeps_its_answer_at_a_budget_of_exactly_what_it_needs_and_grows_the_ring_below(align):
    cm = eq3_model()
    capacity = 256
    for length in (2000, 4097, 10007):
        free = solve_offload(length, capacity=capacity, layers=LAYERS, cost_model=cm, align=align)
        if free.offload_ratio == 0:
            continue
        share = member_tokens(length, free.ring_size, align).max()
        need = free.offload_ratio * (LAYERS - 2) * float(share)
        exact = solve_offload(length, capacity=capacity, layers=LAYERS, align=align,
                              cost_model=cm.with_(host_memory_bytes=need))
        assert (exact.ring_size, exact.offload_ratio) == (free.ring_size, free.offload_ratio)
        tight = solve_offload(length, capacity=capacity, layers=LAYERS, align=align,
                              cost_model=cm.with_(host_memory_bytes=need / 3))
        assert tight.ring_size > free.ring_size
        tight_share = member_tokens(length, tight.ring_size, align).max()
        assert tight.offload_ratio * (LAYERS - 2) * float(tight_share) <= need / 3 * (1 + 1e-9)
        # and the real share fits the capacity (Eq. 3's resident tokens)
        resident = tight_share * (2 + (1 - tight.offload_ratio) * (LAYERS - 2)) / LAYERS
        assert resident <= capacity * (1 + 1e-9)


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("pp_size", [1, 2])
def test_plans_keep_every_ranks_host_bytes_under_the_budget_by_token_counting(align, pp_size):
    rng = np.random.default_rng(align * 10 + pp_size)
    lengths = [int(x) for x in rng.integers(1, 200, size=40)] + [3000, 2500, 1700]
    cm = eq3_model(num_layers=LAYERS * pp_size)
    kwargs = dict(scheduler="naive", hdp_size=16, capacity=256, align=align, pp_size=pp_size)
    free = make_plan(lengths, cost_model=cm, **kwargs)
    budget = 0.5 * host_need(free, lengths).max()
    assert budget > 0
    capped = make_plan(lengths, cost_model=cm.with_(host_memory_bytes=budget), **kwargs)
    capped.validate()
    assert host_need(capped, lengths).max() <= budget * (1 + 1e-9)


def host_need(plan, lengths) -> np.ndarray:
    """Per rank: the host bytes of its offloaded micro-batches, by token counting (the
    ``pp_size`` largest at once with PP: 1F1B keeps that many forwards in flight)."""
    layers = plan.layers_per_stage
    per_rank: list[list[float]] = [[] for _ in range(plan.hdp_size)]
    for rank_plan in plan.ranks:
        for mb in rank_plan.micro_batches:
            if mb.offload_ratio <= 0:
                continue
            held = sum(member_tokens(lengths[s], mb.ring_size, plan.align) for s in mb.seqs)
            share = float(np.max(held))
            per_rank[rank_plan.rank].append(mb.offload_ratio * (layers - 2) * share)
    return np.array([sum(sorted(v, reverse=True)[: plan.pp_size]) for v in per_rank])
