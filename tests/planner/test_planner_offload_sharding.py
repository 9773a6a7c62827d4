"""Eq. 3 (hand-computed cases) and data-aware sharding."""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.offload import (
    fits_at_all,
    max_fitting_length,
    max_zigzag_share,
    ring_size_without_offload,
    solve_offload,
)
from megatron_bytescale.planner.plan import resident_tokens
from megatron_bytescale.planner.sharding import ShardingContext, best_fit_decreasing, shard_batch
from megatron_bytescale.planner.zigzag import zigzag_share
from planner_cases import small_cost_model


def eq3_model(num_layers: int, *, r_max_one: bool = True, **changes):
    """Act(s) = s bytes; T(s) huge (r_max = 1) or tiny (r_max ~ 0)."""
    t = dict(alpha1=1.0, beta1=1.0, gamma=1.0) if r_max_one else dict(alpha1=0.0, beta1=1e-12, gamma=0.0)
    return small_cost_model(num_layers=num_layers, alpha2=1.0, beta2=0.0, **{**t, **changes})


def test_paper_illustration_2m_on_16_ranks():
    """paper.md §4.3: l = 32, C = 8K, s = 2M, full offload feasible: 16 ranks instead of 256."""
    cm = eq3_model(32)
    dec = solve_offload(2_097_152, capacity=8192, layers=32, cost_model=cm)
    assert dec.ring_size == 16
    assert dec.ring_size_without_offload == 256
    assert dec.offload_ratio == pytest.approx(1.0)
    # the validator's check: 131072 tokens per rank, 2 of 32 layers resident -> exactly C
    assert resident_tokens(131072, dec.offload_ratio, 32) <= 8192 + 1e-9


def test_smallest_ratio_that_reaches_the_ring_size():
    """l = 4, C = 100, s = 300: D0 = 3; with offload D = 2 needs (2 + 2(1-r)) * 150 / 4 <= 100,
    i.e. r >= 2/3, which is also Eq. 3's lower bound 4*100 / (2*300)."""
    cm = eq3_model(4)
    dec = solve_offload(300, capacity=100, layers=4, cost_model=cm)
    assert (dec.ring_size, dec.ring_size_without_offload) == (2, 3)
    assert dec.offload_ratio == pytest.approx(2 / 3, abs=1e-9)


def test_one_rank_with_offload():
    """l = 32, C = 8192, s = 3C: D = 1 needs (2 + 30(1-r)) / 32 * 3C <= C, i.e. r >= 64/90."""
    cm = eq3_model(32)
    dec = solve_offload(3 * 8192, capacity=8192, layers=32, cost_model=cm)
    assert dec.ring_size == 1
    assert dec.offload_ratio == pytest.approx(64 / 90, abs=1e-9)


def test_no_offload_when_overlap_cannot_hide_it():
    """T tiny: r_max ~ 0 < lower bound 2/3, so r = 0 and D = D0."""
    cm = eq3_model(4, r_max_one=False)
    dec = solve_offload(300, capacity=100, layers=4, cost_model=cm)
    assert (dec.ring_size, dec.offload_ratio) == (3, 0.0)


def test_overlap_bound_caps_the_ratio():
    """r_max = T*B/Act between the lower bound and 1: D is as small as r_max allows.

    l = 32, C = 100, s = 1000, Act = s: D0 = 10. Choose T so r_max = 0.5:
    D(0.5) = ceil((2 + 15) * 1000 / 3200) = 6. At D = 6 Eq. 3 alone needs
    1 - (6*3200/1000 - 2)/30 = 0.4267 (>= lower bound 32*100/(30*1000) = 0.1067), but the zigzag
    parts are ceil(1000/12) = 84 tokens, so the fullest member holds 168 > 1000/6 real tokens and
    needs (2 + 30(1-r)) * 168 / 32 <= 100, i.e. r >= 1 - (3200/168 - 2)/30 = 0.43175."""
    b = 1e8
    t_needed = 0.5 * 1000 / b  # T(s) = Act * r_max / B
    cm = eq3_model(32, alpha1=0.0, beta1=t_needed / 1000, gamma=0.0, d2h_bandwidth=b, h2d_bandwidth=b)
    dec = solve_offload(1000, capacity=100, layers=32, cost_model=cm)
    assert dec.ring_size == 6
    assert dec.offload_ratio == pytest.approx(1 - (3200 / 168 - 2) / 30, abs=1e-9)
    assert dec.offload_ratio <= 0.5


def test_two_layers_cannot_offload():
    for layers in (1, 2):
        cm = eq3_model(layers)
        dec = solve_offload(300, capacity=100, layers=layers, cost_model=cm)
        assert (dec.ring_size, dec.offload_ratio) == (3, 0.0)


def test_offload_disabled():
    dec = solve_offload(2_097_152, capacity=8192, layers=32, cost_model=eq3_model(32), offload=False)
    assert (dec.ring_size, dec.offload_ratio) == (256, 0.0)


def test_ring_size_bumped_until_the_padded_share_fits():
    """14 tokens, C = 7, align 4: on 2 ranks the parts are 4,4,4,2 and position 1 holds 8 > 7;
    on 3 ranks (parts 4,4,4,2,0,0) the fullest member holds 6."""
    cm = eq3_model(1)
    assert max_zigzag_share(14, 2, 4) == 8
    assert max_zigzag_share(14, 3, 4) == 6
    assert ring_size_without_offload(14, capacity=7, cost_model=cm, layers=1, align=4) == 3


def test_max_zigzag_share_matches_the_real_shares():
    for length in (1, 2, 7, 30, 31, 100, 257):
        for ring in (1, 2, 3, 5, 8, 40):
            for align in (1, 2, 8):
                want = max(sum(b - a for a, b in zigzag_share(length, ring, p, align)) for p in range(ring))
                assert max_zigzag_share(length, ring, align) == want, (length, ring, align)


def test_fitting_limit_with_and_without_offload():
    cm = eq3_model(32)
    assert max_fitting_length(capacity=100, layers=32, cost_model=cm, max_ring_size=4, offload=False) == 400
    with_offload = max_fitting_length(capacity=100, layers=32, cost_model=cm, max_ring_size=4, offload=True)
    assert with_offload == 4 * 100 * 32 // 2  # full offload keeps 2 of 32 layers
    assert fits_at_all(with_offload, capacity=100, layers=32, cost_model=cm, max_ring_size=4, offload=True)
    assert not fits_at_all(with_offload + 1, capacity=100, layers=32, cost_model=cm, max_ring_size=4, offload=True)


# --------------------------------------------------------------------------- sharding
def test_best_fit_decreasing_hand_case():
    # items 6,5,4,3,2 into bins of 10: 6 -> A; 5 -> B; 4 -> A (room 4 is the best fit); 3 -> B;
    # 2 -> B (room 2)
    bins = best_fit_decreasing([0, 1, 2, 3, 4], [5, 6, 2, 4, 3], 10)
    assert bins == [[1, 3], [0, 4, 2]]


def test_shard_batch_units():
    cm = small_cost_model()
    ctx = ShardingContext(capacity=100, layers=8, cost_model=cm, hdp_size=8, offload=False)
    ids, lengths = [0, 1, 2, 3, 4], [30, 250, 70, 100, 60]
    units = shard_batch(ids, lengths, ctx)
    rings = {u.seqs: u.ring_size for u in units}
    assert rings[(1,)] == 3 and rings[(3,)] == 1  # s >= C gets its own micro-batch
    packs = [u for u in units if u.seqs not in ((1,), (3,))]
    assert sorted(sorted(u.seqs) for u in packs) == [[0, 2], [4]]
    assert all(sum(u.lengths) <= 100 for u in packs)
    assert sorted(s for u in units for s in u.seqs) == ids
    assert shard_batch(ids, lengths, ctx) == units  # deterministic


def test_shard_batch_sizes_every_long_sequence_as_solve_offload_does():
    """Each long unit is Eq. 3's decision for its sequence (ring, ratio, and that ring as its
    minimum), with the context's alignment, layers (2 cannot offload, 3 can), offload switch and
    HDP size (a ring wider than the ranks takes the ratio that fits them); each pack sits on one
    rank with a minimum of one."""
    import numpy as np

    from megatron_bytescale.planner.offload import solve_offload

    rng = np.random.default_rng(8)
    lengths = np.concatenate([rng.integers(1, 100, 40), rng.integers(100, 3000, 60)]).tolist()
    ids = list(range(len(lengths)))
    seen_offload = seen_capped = 0
    for layers, align, offload, hdp in ((8, 1, True, 64), (3, 8, True, 64), (2, 1, True, 64),
                                        (8, 8, False, 64), (16, 1, True, 6), (4, 24, True, 12)):
        ctx = ShardingContext(capacity=100, layers=layers, cost_model=small_cost_model(), hdp_size=hdp,
                              align=align, offload=offload, in_flight=2)
        for u in shard_batch(ids, lengths, ctx):
            if len(u.seqs) > 1 or u.lengths[0] < 100:
                assert (u.ring_size, u.offload_ratio, u.min_ring_size) == (1, 0.0, 1)
                continue
            dec = solve_offload(u.lengths[0], capacity=100, layers=layers, cost_model=ctx.cost_model, align=align,
                                offload=offload, max_ring_size=hdp, in_flight=2)
            assert (u.ring_size, u.offload_ratio, u.min_ring_size) == (dec.ring_size, dec.offload_ratio,
                                                                       dec.ring_size)
            assert u.time == ctx.unit_time(u.lengths, u.ring_size, u.offload_ratio)
            seen_offload += u.offload_ratio > 0
            seen_capped += dec.ring_size == hdp < dec.ring_size_without_offload
    assert seen_offload > 20 and seen_capped > 5


def test_shard_batch_names_a_sequence_no_ring_holds():
    """An alignment above the capacity leaves no ring that holds a long sequence: the error
    names its length, as the scalar search does."""
    ctx = ShardingContext(capacity=64, layers=8, cost_model=small_cost_model(), hdp_size=8, align=100, offload=False)
    with pytest.raises(ValueError, match="500"):
        shard_batch([0, 1], [30, 500], ctx)
