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
