"""The estimate of plans with split micro-batches and the split kept only where it pays."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.chunk_estimate import split_where_faster
from megatron_bytescale.planner.chunk_split import split_micro_batch
from megatron_bytescale.planner.estimate import estimate_plan
from megatron_bytescale.planner.pipeline_floor import time_plan
from megatron_bytescale.planner.plan import PlanBuilder
from megatron_bytescale.planner.schedulers import make_plan

from planner_cases import small_cost_model


def pp_plan(scheduler: str, seed: int, pp: int = 4):
    cm = small_cost_model(num_layers=16)
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(10, 200, 40), rng.integers(600, 1600, 4)]).tolist()
    return make_plan(lengths, scheduler=scheduler, hdp_size=8, capacity=256, cost_model=cm, pp_size=pp), cm


def test_a_plan_with_every_ring_split_is_estimated_as_the_floor_model_times_it():
    plan, cm = pp_plan("balance", 0)
    rings = sorted({mb.order for rp in plan.ranks for mb in rp.micro_batches if mb.ring_size > 1})
    split = plan
    for i, order in enumerate(rings):
        split = split_micro_batch(split, order + 3 * i, 4)  # earlier splits moved it by 3 each
    floor = time_plan(plan, cm, split_chunks=4, split_costing="cached")
    estimate = estimate_plan(split, cm)
    assert estimate.step_time_s == pytest.approx(floor.step_s, rel=1e-12)
    assert estimate.p2p_bytes == pytest.approx(plan.estimate.p2p_bytes, rel=1e-9)  # k chunks of 1 / k
    assert estimate.step_time_s != plan.estimate.step_time_s


def test_a_long_ring_over_a_deep_pipeline_is_split_where_it_pays():
    cm = small_cost_model(num_layers=16)
    b = PlanBuilder(hdp_size=2, capacity=8192, lengths={0: 4000, 1: 100, 2: 120})
    b.add((0, 1), (0,))
    b.add((0,), (1,))
    b.add((1,), (2,))
    plan = b.build(scheduler="manual", pp_size=4, layers_per_stage=4).validate()
    before = estimate_plan(plan, cm).step_time_s
    out = split_where_faster(plan, cm).validate()
    assert [mb.chunk for mb in out.ranks[1].micro_batches][:2] == [(0, 8), (1, 8)]
    assert out.estimate.step_time_s < 0.5 * before  # the fill and drain of one long ring, mostly gone
    # without PP there is no fill to remove: the plan comes back as it was
    flat = b.build(scheduler="manual", pp_size=1, layers_per_stage=4)
    assert split_where_faster(flat, cm) is flat


@pytest.mark.parametrize("scheduler", ["balance", "naive"])
def test_the_split_is_never_slower_in_the_estimate(scheduler):
    for seed in range(3):
        plan, cm = pp_plan(scheduler, seed)
        out = split_where_faster(plan, cm)
        out.validate()
        split = any(mb.chunk for rp in out.ranks for mb in rp.micro_batches)
        assert out.estimate.step_time_s <= plan.estimate.step_time_s
        assert split == (out.estimate.step_time_s < plan.estimate.step_time_s)
