"""Selective offload and "never slower" as properties of ``balance``, on seeded random batches.

Offload is a per-sequence choice inside ``balance`` (``planner/schedulers/selective.py``): it
plans Eq. 3's offloaded rings and the offload-free rings (widening any long sequence further)
and keeps the fastest by the estimate. So, for every batch, DP and PP, with and without a host
budget:

* balance with offload allowed is never slower than balance with it disallowed;
* balance is never slower than naive, with or without Eq. 3's rings;
* every plan validates, and a host budget is never exceeded.

The sample must exercise the choice both ways (some plans offload, some turn down an Eq. 3
offload), or a scheduler that always or never offloads would pass.
"""

from __future__ import annotations

import numpy as np

from megatron_bytescale.planner.schedulers import make_plan
from planner_cases import small_cost_model

RTOL = 1e-12


def _model(fast_network: bool, **changes):
    """The toy model with a fast host link, so that Eq. 3 offloads most long sequences; with a
    fast network too, wide offload-free rings cost little and offload often loses."""
    net = dict(p2p_bandwidth_intra=1e12, p2p_bandwidth_inter=1e11) if fast_network else {}
    return small_cost_model(d2h_bandwidth=1e10, h2d_bandwidth=1e10, **net, **changes)


def _batches(count: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        hdp = int(rng.choice([4, 6, 8, 12, 16]))
        cap = int(rng.integers(64, 512))
        n = int(rng.integers(8, 60))
        long_ = rng.integers(cap, cap * hdp // 2 + cap + 1, n)
        lengths = np.where(rng.random(n) < 0.6, rng.integers(1, cap, n), long_).tolist()
        yield lengths, hdp, cap, int(rng.choice([1, 2, 4])), int(rng.choice([2, 4]))


def _plan(lengths, scheduler, offload, **kw):
    return make_plan(lengths, scheduler=scheduler, offload=offload, **kw)


def test_balance_with_offload_is_never_slower_than_without_or_than_naive():
    seen = {"offloads": 0, "declines": 0, "pp": 0, "budget": 0}
    for i, (lengths, hdp, cap, pp, rpn) in enumerate(_batches(36, seed=11)):
        budget = None
        if i % 3 == 2:  # a budget of a fraction of what the unlimited plan's fullest rank parks
            free = _plan(lengths, "naive", True, hdp_size=hdp, capacity=cap, pp_size=pp,
                         cost_model=_model(i % 2 == 1, ranks_per_node=rpn))
            need = free.estimate.extra["max_host_bytes_per_rank"]
            budget = need / 3 if need > 0 else None
        cm = _model(i % 2 == 1, ranks_per_node=rpn, host_memory_bytes=budget)
        kw = dict(hdp_size=hdp, capacity=cap, cost_model=cm, pp_size=pp)
        on = _plan(lengths, "balance", True, **kw)
        off = _plan(lengths, "balance", False, **kw)
        naive_on = _plan(lengths, "naive", True, **kw)
        naive_off = _plan(lengths, "naive", False, **kw)
        for plan in (on, off, naive_on, naive_off):
            plan.validate()
            assert "dropped" not in plan.meta and "truncated" not in plan.meta
        step = on.estimate.step_time_s
        case = f"batch {i}: hdp {hdp}, C {cap}, pp {pp}, budget {budget}"
        assert step <= off.estimate.step_time_s * (1 + RTOL), (case, step, off.estimate.step_time_s)
        assert step <= naive_on.estimate.step_time_s * (1 + RTOL), (case, step, naive_on.estimate.step_time_s)
        assert step <= naive_off.estimate.step_time_s * (1 + RTOL), (case, step, naive_off.estimate.step_time_s)
        assert off.estimate.step_time_s <= naive_off.estimate.step_time_s * (1 + RTOL), case
        if budget is not None:
            assert on.estimate.extra["max_host_bytes_per_rank"] <= budget * (1 + 1e-9), case
            seen["budget"] += naive_on.meta["offloaded_micro_batches"] > 0
        if on.meta["offloaded_micro_batches"]:
            seen["offloads"] += 1
            assert on.meta["offload_choice"] == "eq3", on.meta
        elif naive_on.meta["offloaded_micro_batches"]:
            seen["declines"] += 1  # Eq. 3 would offload here; balance found it slower
            assert on.meta["offload_choice"] == "no-offload", on.meta
        seen["pp"] += pp > 1
    assert seen["offloads"] >= 3 and seen["declines"] >= 3 and seen["pp"] >= 10 and seen["budget"] >= 2, seen


# ----------------------------------------------------------------- the unit sets, by hand
# ``unit_options`` hands ``balance`` its candidate unit sets. Each case below is small enough to
# know its answer: which sets, under which name and context, with which rings and ratios.

def _request(lengths, hdp, capacity, offload, fast_host=True):
    from megatron_bytescale.planner.schedulers._common import build_request

    host = dict(d2h_bandwidth=1e10, h2d_bandwidth=1e10) if fast_host else {}
    return build_request(lengths, hdp_size=hdp, capacity=capacity, cost_model=small_cost_model(**host),
                         pp_size=1, offload=offload, overlong="error", align=1, context_length=None,
                         delta=0.05, num_buckets=4)


def _options(request):
    from megatron_bytescale.planner.schedulers.selective import unit_options

    out = []
    for name, ctx, units in unit_options(request):
        seqs = sorted(s for u in units for s in u.seqs)
        assert seqs == list(request.ids), f"{name}: every sequence once, got {seqs}"
        out.append((name, ctx.offload, sorted((u.seqs, u.ring_size, u.offload_ratio > 0) for u in units)))
    return out


def test_one_set_when_eq3_offloads_nothing_named_for_the_mode():
    short = [100, 200, 50]  # all below the capacity: packs only
    assert _options(_request(short, 4, 256, offload=True)) == [
        ("eq3", True, [((0,), 1, False), ((1, 2), 1, False)])]
    # offload off: one set, the offload-free one, under the offload-off context
    assert _options(_request([2000, 100], 8, 256, offload=False)) == [
        ("no-offload", False, [((0,), 8, False), ((1,), 1, False)])]


def test_two_sets_when_the_offload_free_ring_fits_the_ranks_exactly():
    # 2048 tokens at capacity 256 need a ring of exactly the 8 HDP ranks without offload (it
    # fits, so it is a choice), or Eq. 3's ring of 2 with offload
    assert _options(_request([2048, 50], 8, 256, offload=True)) == [
        ("no-offload", False, [((0,), 8, False), ((1,), 1, False)]),
        ("eq3", True, [((0,), 2, True), ((1,), 1, False)]),
    ]


def test_a_sequence_that_only_offload_fits_keeps_its_eq3_ring_and_one_set_remains():
    # 3000 tokens would need 12 > 8 ranks without offload: both sets hold Eq. 3's ring, so they
    # are one set, planned under the offload context; a sequence of exactly the capacity (256)
    # is a ring unit of one rank in both
    assert _options(_request([3000, 100, 256, 40], 8, 256, offload=True)) == [
        ("no-offload", True, [((0,), 3, True), ((1, 3), 1, False), ((2,), 1, False)])]
