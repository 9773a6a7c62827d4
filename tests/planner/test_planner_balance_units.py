"""The balance scheduler's pieces on hand-made units with times computed by hand.

A linear cost model (1 ms per padded token per member, free links, one layer) makes every time a
division: a sequence of L tokens on a ring of D takes ``2 * D * ceil(L / 2D) / D`` ms per member.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.balance import dp_balance, widen_for_balance
from megatron_bytescale.planner.sharding import ShardingContext, Unit
from planner_cases import small_cost_model

CM = small_cost_model(num_layers=1, alpha1=0.0, beta1=1e-3, gamma=0.0, p2p_bandwidth_inter=1e30,
                      p2p_bandwidth_intra=1e30, p2p_latency_s=0.0, ring_step_overhead_s=0.0)


def ctx(n: int, capacity: int = 1000) -> ShardingContext:
    return ShardingContext(capacity=capacity, layers=1, cost_model=CM, hdp_size=n, offload=False)


def unit(seq: int, length: int, ring: int = 1, time: float | None = None, ratio: float = 0.0) -> Unit:
    if time is None:
        time = 2 * ring * -(-length // (2 * ring)) / ring * 1e-3 if ring > 1 else length * 1e-3
    return Unit(seqs=(seq,), lengths=(length,), ring_size=ring, min_ring_size=ring, time=time,
                offload_ratio=ratio)


def test_widening_takes_the_smallest_ring_under_the_lower_bound():
    # 4,000 tokens on Eq. 3's 4 ranks: 1.0 s. Four packs of 500: 0.5 s each. Work 6 rank-s on 8
    # ranks: LB = 0.75 s. Ring times: 5 -> 0.8, 6 -> 4008 / 6 = 0.668, 7 -> 0.572, 8 -> 0.5.
    units = [unit(0, 4000, ring=4)] + [unit(i, 500) for i in range(1, 5)]
    assert units[0].time == pytest.approx(1.0)
    widened, grown = widen_for_balance(list(units), ctx(8), 8)
    assert grown == 1 and widened[0].ring_size == 6 and widened[0].time == pytest.approx(0.668)
    assert widened[1:] == units[1:]  # packs never communicate
    # with 2 pipeline stages a micro-batch crosses both: the target is LB / 2 = 0.375, which no
    # ring meets; the fastest (8 ranks, 0.5 s) is within the 2 % aim
    widened, grown = widen_for_balance(list(units), ctx(8), 8, pp_size=2)
    assert grown == 1 and widened[0].ring_size == 8


def test_widening_bisects_between_grid_points_as_one_call_per_size_would():
    """``_smallest_ring_under`` refines the first grid size that meets the aim by bisection
    against the grid point before it, reading the sizes in between from one vectorised call.
    The bisection done with one cost-model call per size must end on the same ring, for rings
    that land strictly between grid points (lengths and targets spread over the falling part of
    the time curve, LLaMA-7B on 512 ranks, zigzag padding with align 8)."""
    import numpy as np

    from megatron_bytescale.planner.schedulers.widen import _ring_grid, _smallest_ring_under

    from megatron_bytescale.planner.presets import preset_cost_model

    c = ShardingContext(capacity=8_192, cost_model=preset_cost_model("llama-7b"), layers=32, hdp_size=512,
                        align=8, offload=False)
    between = 0
    for length in (40_000, 131_071, 333_333, 1_000_003):
        d0 = -(-length // 8_192)
        u = Unit(seqs=(0,), lengths=(length,), ring_size=d0, min_ring_size=d0, time=c.unit_time((length,), d0, 0.0))
        grid = _ring_grid(d0, 512)
        times = c.time_on_rings(u.lengths, grid)
        for target in np.geomspace(float(times.min()), float(times[0]), 25).tolist():
            aim = max(target, float(times.min()) * 1.02)
            k = int(np.flatnonzero(times[: int(np.argmin(times)) + 1] <= aim)[0])
            lo, hi = int(grid[k - 1]) if k else d0, int(grid[k])
            while hi - lo > 1:  # the bisection, one call per size
                mid = (lo + hi) // 2
                if c.time_on_rings(u.lengths, np.array([mid]))[0] <= aim:
                    hi = mid
                else:
                    lo = mid
            got = _smallest_ring_under(u, target, c, grid, times)
            assert got.ring_size == (hi if grid[int(np.argmin(times))] != d0 else d0), (length, target)
            between += hi not in grid.tolist()
    assert between > 20


def test_a_sequence_of_exactly_capacity_is_long_and_a_shorter_one_a_pack():
    # 1,000 tokens = C on one rank: 1.0 s; four packs of 250: LB = 2 / 8 = 0.25 s. 4 ranks give
    # 1000 / 4 = 0.25 s (3 ranks: 1002 / 3 = 0.334 s).
    units = [unit(0, 1000)] + [unit(i, 250) for i in range(1, 5)]
    widened, grown = widen_for_balance(list(units), ctx(8), 8)
    assert grown == 1 and widened[0].ring_size == 4
    packs = [unit(0, 999)] + [unit(i, 250) for i in range(1, 5)]
    assert widen_for_balance(list(packs), ctx(8), 8) == (packs, 0)


def test_nothing_to_widen():
    units = [unit(0, 4000, ring=4)] + [unit(i, 500) for i in range(1, 5)]
    assert widen_for_balance(list(units), ctx(1), 1) == (units, 0)  # one rank
    assert widen_for_balance([], ctx(8), 8) == ([], 0)
    full = [unit(0, 4000, ring=8)] + [unit(i, 100) for i in range(1, 5)]
    assert widen_for_balance(list(full), ctx(8), 8) == (full, 0)  # already on every rank


def test_dp_balance_backfills_the_wait_for_a_ring_and_keeps_offload_ratios():
    """Rank 0 runs A (0.6 s), then ring R (2,000 tokens on ranks 0, 1: 1.0 s) starts at 0.6;
    rank 1 would idle 0.6 s, so B (0.3 s, offload ratio 0.25) runs in that hole at t = 0."""
    a, r, b = unit(0, 600), unit(1, 2000, ring=2), unit(2, 300, ratio=0.25)
    placements, makespan = dp_balance([a, r, b], ctx(2), 2)
    got = [(p.ring, p.seqs, p.offload_ratio) for p in placements]
    assert got == [((0,), (0,), 0.0), ((1,), (2,), 0.25), ((0, 1), (1,), 0.0)]
    assert makespan == pytest.approx(1.6)


def test_balance_meta_names_its_settings():
    plan = make_plan([300, 40, 20], scheduler="balance", hdp_size=4, capacity=100, cost_model=CM,
                     delta=0.1, num_buckets=3, offload=False)
    assert plan.scheduler == "balance"
    assert (plan.meta["delta"], plan.meta["num_buckets"], plan.meta["mode"]) == (0.1, 3, "DP-Balance")
    assert plan.meta["assignment"] in ("lpt", "lpt-eq3", "fill")
    pp = make_plan([300, 40, 20], scheduler="balance", hdp_size=4, capacity=100,
                   cost_model=small_cost_model(), pp_size=2, offload=False)
    assert pp.meta["mode"] == "PP-Balance" and isinstance(pp.meta["widened_units"], int)


def test_the_bisection_finds_the_smallest_ring_between_two_grid_points():
    """A 7,800-token sequence on Eq. 3's 20 ranks (0.39 s) among 51 packs of 100 tokens (0.1 s):
    LB = (7.8 + 5.1) / 64 = 0.2016 s. Ring times: 38 -> 7828 / 38 = 0.206, 39 -> 0.200,
    40 -> 0.196, 42 -> 0.186. The grid from 20 steps 10 % (..., 35, 38, 42, ...): 42 is the first
    grid point under LB, and bisection between 38 and 42 must find 39."""
    units = [unit(0, 7800, ring=20)] + [unit(i, 100) for i in range(1, 52)]
    assert units[0].time == pytest.approx(0.39)
    widened, grown = widen_for_balance(list(units), ctx(64), 64)
    assert grown == 1 and widened[0].ring_size == 39 and widened[0].time == pytest.approx(0.2)
    assert type(widened[0].ring_size) is int


def test_the_fallback_candidates_win_on_tiny_batches():
    """On tiny batches a greedy can lose by chance, and balance keeps the fastest of three
    candidates: LPT on the widened units, LPT on Eq. 3's units, and Alg. 1's fill."""
    fast = small_cost_model(p2p_bandwidth_inter=1e10, p2p_bandwidth_intra=1e11)
    plan = make_plan([55, 75], scheduler="balance", hdp_size=6, capacity=50, cost_model=fast, offload=False)
    assert (plan.meta["assignment"], plan.meta["widened_units"]) == ("lpt-eq3", 0)
    naive = make_plan([55, 75], scheduler="naive", hdp_size=6, capacity=50, cost_model=fast, offload=False)
    assert plan.estimate.step_time_s <= naive.estimate.step_time_s
    lengths = [139, 249, 234]
    plan = make_plan(lengths, scheduler="balance", hdp_size=3, capacity=100, cost_model=small_cost_model(),
                     offload=False)
    naive = make_plan(lengths, scheduler="naive", hdp_size=3, capacity=100, cost_model=small_cost_model(),
                      offload=False)
    # Alg. 1's fill of the same units: naive's plan (and nothing was widened)
    assert (plan.meta["assignment"], plan.meta["widened_units"]) == ("fill", 0)
    assert plan.estimate.step_time_s == naive.estimate.step_time_s
    assert [[mb.ring for mb in r.micro_batches] for r in plan.ranks] == \
           [[mb.ring for mb in r.micro_batches] for r in naive.ranks]


def test_two_long_units_each_get_the_smallest_ring_under_the_same_bound():
    # two 4,000-token sequences on 4 ranks (1.0 s, 4 rank-s each) and 8 packs of 500 (0.5 s):
    # LB = 12 / 16 = 0.75 s; each goes to 6 ranks (0.668 s), the bound hardly moves (12.016 / 16)
    units = [unit(0, 4000, ring=4), unit(1, 4000, ring=4)] + [unit(i, 500) for i in range(2, 10)]
    widened, grown = widen_for_balance(list(units), ctx(16), 16)
    assert grown == 2 and [u.ring_size for u in widened[:2]] == [6, 6]


def test_two_ranks_can_still_widen_a_single():
    # 1,000 tokens = C on one rank (1.0 s) and a pack of 200 (0.2 s): LB = 0.6; 2 ranks: 0.5 s
    widened, grown = widen_for_balance([unit(0, 1000), unit(1, 200)], ctx(2), 2)
    assert grown == 1 and widened[0].ring_size == 2


def test_pipeline_balance_widens_against_the_per_stage_bound():
    """2 layers on 2 stages (1 layer each). Two 4,000-token sequences (1.0 s per stage on 4
    ranks) and 8 packs of 500: LB = 12 / 8 = 1.5 s per stage, and a micro-batch crosses both
    stages, so the target is 0.75 s: 6 ranks (0.668 s), not 4 (which LB alone would keep)."""
    cm2 = CM.with_(num_layers=2)
    plan = make_plan([4000, 4000] + [500] * 8, scheduler="balance", hdp_size=8, capacity=1000,
                     cost_model=cm2, pp_size=2, offload=False)
    rings = {s: mb.ring_size for rp in plan.ranks for mb in rp.micro_batches for s in mb.seqs}
    assert (plan.meta["assignment"], plan.meta["widened_units"]) == ("pp-steps", 2)
    assert rings[0] == rings[1] == 6


@pytest.mark.parametrize("lengths, n, capacity, fast, assignment", [
    ([229, 168], 5, 100, False, "lpt"),
    ([44, 80, 74], 3, 50, True, "fill"),
])
def test_balance_emits_the_fastest_candidate(lengths, n, capacity, fast, assignment):
    """Found by search: cases where ranking the fill candidate by a wrong makespan (rings
    charged like singles, or every ring waiting for the busiest rank) emits a slower plan."""
    cm = small_cost_model(p2p_bandwidth_inter=1e10, p2p_bandwidth_intra=1e11) if fast else small_cost_model()
    kw = dict(hdp_size=n, capacity=capacity, cost_model=cm, offload=False)
    plan = make_plan(lengths, scheduler="balance", **kw)
    naive = make_plan(lengths, scheduler="naive", **kw)  # the fill candidate, estimated alone
    assert plan.meta["assignment"] == assignment
    assert plan.estimate.step_time_s <= naive.estimate.step_time_s * (1 + 1e-12)


def test_a_widening_that_raises_the_work_bound_is_refused():
    """With 0.3 s of overhead per ring step, 1,000 tokens (1.0 s on one rank) would take
    0.5 + 0.3 = 0.8 s on two, but cost 1.6 rank-s instead of 1.0: with a 0.5 s pack the work
    bound would become 2.1 / 2 = 1.05 s > 1.0 s. The sequence stays on one rank."""
    costly = ShardingContext(capacity=1000, layers=1, hdp_size=2, offload=False,
                             cost_model=CM.with_(ring_step_overhead_s=0.3))
    units = [unit(0, 1000), unit(1, 500)]
    assert costly.unit_time([1000], 2, 0.0) == pytest.approx(0.8)
    assert widen_for_balance(list(units), costly, 2) == (units, 0)


def test_makespan_starts_a_ring_when_all_its_members_are_free():
    """The fill candidate is ranked by ``makespan``: a single on rank 1 (0.3 s), then a ring of
    2 on ranks 0 and 1 (0.5 s each, starting at 0.3 when rank 1 is free), then a single on
    rank 0 (0.2 s): 0.3 + 0.5 + 0.2 = 1.0 s; charging the ring on one member only, or like a
    single, gives less."""
    from megatron_bytescale.planner.schedulers.dp_balance import makespan
    from megatron_bytescale.planner.schedulers._common import placement

    a, r, b = unit(0, 300), unit(1, 1000, ring=2), unit(2, 200)
    placements = [placement((1,), a.seqs, 0.0), placement((0, 1), r.seqs, 0.0),
                  placement((0,), b.seqs, 0.0)]
    assert r.time == pytest.approx(0.5)
    assert makespan(placements, [a, r, b], ctx(2), 2) == pytest.approx(1.0)
    assert makespan(placements[:2], [a, r], ctx(3), 3) == pytest.approx(0.8)
    assert makespan([], [], ctx(2), 2) == 0.0


def test_the_fill_is_dropped_once_a_rank_reaches_the_best_step_and_not_before():
    """``makespan_below`` feeds balance's fill candidate step by step: the steps of the case
    above (the single on rank 1, then the ring, then the single on rank 0; finish 1.0 s) with a
    limit of the exact makespan give None, and no step is made after the one that reached it
    (the ring ends at 0.8 s: a limit of 0.8 stops in the second step); a limit just above the
    makespan gives it, with every placement in order."""
    from megatron_bytescale.planner.schedulers.dp_balance import makespan, makespan_below
    from megatron_bytescale.planner.schedulers._common import placement

    a, r, b = unit(0, 300), unit(1, 1000, ring=2), unit(2, 200)
    steps = [[placement((1,), a.seqs, 0.0)], [placement((0, 1), r.seqs, 0.0)], [placement((0,), b.seqs, 0.0)]]
    full = makespan([p for s in steps for p in s], [a, r, b], ctx(2), 2)
    made = []

    def lazy():
        for step in steps:
            made.append(len(step))
            yield step

    assert makespan_below(lazy(), [a, r, b], ctx(2), 2, full) is None and len(made) == 3
    made.clear()
    assert makespan_below(lazy(), [a, r, b], ctx(2), 2, 0.8) is None and len(made) == 2
    got = makespan_below(steps, [a, r, b], ctx(2), 2, full * (1 + 1e-12))
    assert got == ([p for s in steps for p in s], full)


@pytest.mark.parametrize("changes", [{}, dict(two_level_ring=True),
                                     dict(ring_straggler_s=2e-6, ring_straggler_link_ratio=0.05, per_document_s=1e-6)])
def test_many_one_sequence_units_timed_at_once_as_each_alone(changes):
    """``time_on_rings_each`` (widening times every unit's ring grid in one call) gives each unit
    the floats of its own ``time_on_rings`` call, and that call each size the float of a call for
    it alone: padded parts, intra- and inter-node sizes, two-level rings, the terms with a square
    root and a logarithm."""
    import numpy as np

    ctx = ShardingContext(capacity=2_048, cost_model=small_cost_model(**changes), layers=8, hdp_size=64, align=8)
    lengths = [2_048, 3_001, 9_999, 16_384, 40_000, 77]
    grids = [np.arange(1, 9), np.array([3, 5, 64]), np.array([2]), np.arange(4, 65, 3), np.array([64, 63, 1]),
             np.array([7])]
    together = ctx.time_on_rings_each(lengths, grids)
    assert len(together) == len(lengths)
    for s, g, t in zip(lengths, grids, together):
        assert np.array_equal(t, ctx.time_on_rings([s], g))
        # and each size alone (widening's bisection reads the sizes between two grid points
        # from one call)
        assert [ctx.time_on_rings([s], np.array([d]))[0] for d in g.tolist()] == t.tolist()
    assert ctx.time_on_rings_each([], []) == []
