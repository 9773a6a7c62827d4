"""The expert-parallel slot constraint in the planner (``StepPlan.ep_size``; no processes)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.plan import PlanError, StepPlan, expert_slots
from megatron_bytescale.planner.schedulers import make_plan


def _cost_model() -> CostModel:
    return CostModel(num_layers=2, alpha1=2e-8, beta1=2e-5, gamma=1e-4, alpha2=1000.0,
                     d2h_bandwidth=1e10, h2d_bandwidth=1e10, kv_bytes_per_token=64.0,
                     p2p_bandwidth_intra=5e8, p2p_bandwidth_inter=5e8, ranks_per_node=4)


def _aligned(plan: StepPlan) -> bool:
    local = {}
    for rank_plan in plan.ranks:
        for index, mb in enumerate(rank_plan.micro_batches):
            local.setdefault(mb.order, set()).add(index)
    return all(len(v) == 1 for v in local.values())


@pytest.mark.parametrize("ep, pp", [(2, 1), (4, 1), (2, 2)])
def test_balance_plans_rings_at_one_slot_on_every_member(ep, pp):
    """At PP 2 the HDP ranks are pipelines and an expert group is ``ep`` pipelines at one stage:
    the same contract (one slot per ring, a group runs its busiest pipeline's count)."""
    rng = np.random.default_rng(3)
    spanning = 0
    for _ in range(8):
        lengths = rng.integers(5, 250, rng.integers(3, 12)).tolist()
        plan = make_plan(lengths, scheduler="balance", hdp_size=8, capacity=64,
                         cost_model=_cost_model(), ep_size=ep, pp_size=pp, offload=False)
        plan.validate()
        assert plan.ep_size == ep and plan.pp_size == pp and _aligned(plan)
        assert StepPlan.from_json(plan.to_json()).content_hash() == plan.content_hash()
        for r in range(8):  # every rank of an expert group runs its busiest rank's count
            group = range(r - r % ep, r - r % ep + ep)
            assert expert_slots(plan, r) == max(plan.micro_batch_counts()[g] for g in group)
        spanning += any(len({m // ep for m in mb.ring}) > 1
                        for rp in plan.ranks for mb in rp.micro_batches)
    assert spanning or ep == 4  # rings span expert groups (at EP 4 a node is one group)


def test_plans_without_expert_parallelism_keep_their_json_and_hash():
    plan = make_plan([40, 120, 30], scheduler="balance", hdp_size=4, capacity=64,
                     cost_model=_cost_model(), offload=False)
    assert "ep_size" not in plan.to_dict()
    assert replace(plan, ep_size=2).content_hash() != plan.content_hash()


def test_bad_expert_parallel_sizes_are_refused():
    with pytest.raises(ValueError, match=r"ep_size \(3\) must divide hdp_size \(4\)"):
        make_plan([40, 30], scheduler="balance", hdp_size=4, capacity=64,
                  cost_model=_cost_model(), ep_size=3)
    with pytest.raises(ValueError, match="scheduler 'naive' cannot plan for expert parallelism"):
        for seed in range(20):  # some batch puts a ring at different local indices
            lengths = np.random.default_rng(seed).integers(5, 250, 12).tolist()
            make_plan(lengths, scheduler="naive", hdp_size=4, capacity=64,
                      cost_model=_cost_model(), ep_size=2, offload=False)
    plan = make_plan([40, 30], scheduler="balance", hdp_size=4, capacity=64,
                     cost_model=_cost_model(), ep_size=2)
    with pytest.raises(PlanError, match=r"ep_size \(3\)"):
        replace(plan, ep_size=3).validate()
