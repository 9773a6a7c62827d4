"""Expert parallelism inside the HDP pool on 4 CPU ranks (EP 2 x HDP 4, 4 experts, top-2).

Every gradient equals megatron-core's single-process MoE; 30 random plans train without a
deadlock. All checks share ONE 4-process spawn (module-scoped fixture); see ``moe_ep_cases.py``.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.plan import PlanError, expert_slots
from megatron_bytescale.testing.distributed import run_distributed

from .moe_ep_cases import STRESS_PLANS, ep_manual_plan, moe_ep_rank_body

TOLERANCE = 1e-5
RUNS = ["manual alltoall aux 0", "manual alltoall aux", "balance alltoall aux"]


def test_the_manual_plan_breaks_the_constraint_with_one_edit():
    """Rank 0 running doc 7 before the ring [0, 1] is a valid plan without expert parallelism,
    but puts the ring in slot 2 on rank 0 and slot 1 on rank 1: refused with EP 2."""
    ep_manual_plan().validate()
    ep_manual_plan(ep_size=1, rank0_local_first=True).validate()
    with pytest.raises(PlanError, match="ep_size 2 ring members must hold the micro-batch at the "
                                        "same local index"):
        ep_manual_plan(rank0_local_first=True).validate()
    with pytest.raises(PlanError, match=r"ep_size \(3\) must be >= 1 and divide hdp_size \(4\)"):
        ep_manual_plan(ep_size=3).validate()


def test_expert_slots_pad_a_group_to_its_busiest_rank():
    plan = ep_manual_plan()
    assert plan.micro_batch_counts() == [3, 2, 2, 2]
    assert [expert_slots(plan, r) for r in range(4)] == [3, 3, 2, 2]


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, moe_ep_rank_body, timeout_s=900)


def test_expert_groups_are_carved_out_of_the_hdp_ranks(results):
    assert [r["ep_size"] for r in results] == [2] * 4
    assert [r["expert_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["expert_dp_group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_the_manual_plan_has_rings_uneven_groups_and_an_empty_slot(results):
    info = results[0]["runs"]["manual alltoall aux 0"]
    assert info["ring_sizes"] == [1, 2]
    assert info["micro_batch_counts"] == [3, 2, 2, 2]
    assert info["slots"] == [3, 3, 2, 2]  # rank 1 runs an empty micro-batch in slot 2
    assert (1, 2) in info["rings_across_groups"]
    assert results[0]["runs"]["balance alltoall aux"]["ring_sizes"][-1] >= 2


@pytest.mark.parametrize("run", RUNS)
def test_expert_parallel_gradients_equal_megatron_alone(results, run):
    case = "aux 0" if run.endswith("aux 0") else "aux"
    loss = sum(r["runs"][run]["loss_sum"] for r in results) / results[0]["runs"][run][
        "global_loss_tokens"]
    ref = results[0]["reference_loss"][case]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r in results:
        errors = r["runs"][run]["grad_errors"]
        assert any(".mlp.router." in n for n in errors)
        # two local experts x two linears x two layers on every rank
        assert sum(".mlp.experts.local_experts." in n for n in errors) == 2 * 2 * 2
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"


def test_random_plans_train_without_deadlock(results):
    stress = [r["stress"] for r in results]
    assert all(s["steps"] == STRESS_PLANS for s in stress)
    assert sum(s["trained_tokens"] for s in stress) == stress[0]["total_tokens"]
    assert stress[0]["max_ring"] >= 3
    assert stress[0]["uneven_groups"] > 0 and sum(s["empty_slots"] for s in stress) > 0
