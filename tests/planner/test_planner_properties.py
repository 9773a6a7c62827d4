"""Property tests over random length mixes and rank counts, for every scheduler.

For every draw: ``validate()`` passes (every token in exactly one piece, the zigzag share of every
member, resident tokens within C / the Eq. 3 budget, consistent orders, same local index under
PP), the simulation finds no deadlock, the same input gives the same content hash, and every
input sequence is planned or reported as dropped/truncated.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner.order import check_deadlock_free
from megatron_bytescale.planner.plan import StepPlan, resident_tokens
from megatron_bytescale.planner.schedulers import make_plan
from planner_cases import batches, small_cost_model

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CM = small_cost_model()
CM_FAST_LINKS = small_cost_model(p2p_bandwidth_inter=1e10, p2p_bandwidth_intra=1e11)


def _plan(batch, scheduler, *, pp_size=1, offload=True, cm=CM):
    lengths, hdp, capacity, align = batch
    try:
        return make_plan(lengths, scheduler=scheduler, hdp_size=hdp, capacity=capacity, cost_model=cm,
                         pp_size=pp_size, offload=offload, overlong="truncate", align=align)
    except ValueError as exc:  # the static baseline has no CP size for some rank counts
        assume("no context-parallel size fits" not in str(exc))
        raise


def _check(plan, lengths):
    plan.validate()
    check_deadlock_free(plan)
    planned = plan.sequence_lengths()
    truncated = {t["id"]: t["to"] for t in plan.meta.get("truncated", [])}
    assert set(planned) == set(range(len(lengths))) - set(plan.meta.get("dropped", []))
    for sid, n in planned.items():
        assert n == truncated.get(sid, lengths[sid])
    for rp in plan.ranks:  # the memory budget, explicitly (validate checks it too)
        for mb in rp.micro_batches:
            assert resident_tokens(mb.num_tokens, mb.offload_ratio, plan.layers_per_stage) <= plan.capacity + 1e-9
    assert plan.estimate is not None and plan.estimate.step_time_s >= 0


@pytest.mark.parametrize("scheduler", ["naive", "balance", "static", "pow2"])
@SETTINGS
@given(batch=batches(), offload=st.booleans())
def test_plans_are_valid_and_deterministic(scheduler, batch, offload):
    plan = _plan(batch, scheduler, offload=offload)
    _check(plan, batch[0])
    again = _plan(batch, scheduler, offload=offload)
    assert again.content_hash() == plan.content_hash()
    loaded = StepPlan.from_json(plan.to_json())
    assert loaded.content_hash() == plan.content_hash() and loaded.meta == plan.meta
    assert loaded.estimate.step_time_s == plan.estimate.step_time_s
    if scheduler in ("static", "pow2"):
        assert all(mb.offload_ratio == 0 for rp in plan.ranks for mb in rp.micro_batches)


@pytest.mark.parametrize("scheduler", ["naive", "balance"])
@SETTINGS
@given(batch=batches(), offload=st.booleans(), pp_size=st.sampled_from([1, 2]))
def test_hdp_keeps_short_sequences_local(scheduler, batch, offload, pp_size):
    # data-aware sharding (paper §5.1): a sequence shorter than C never communicates
    plan = _plan(batch, scheduler, offload=offload, pp_size=pp_size)
    lengths = plan.sequence_lengths()
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            if mb.ring_size > 1:
                assert all(lengths[sid] >= plan.capacity for sid in mb.seqs), (mb.ring, mb.seqs)


@pytest.mark.parametrize("scheduler", ["naive", "balance", "static"])
@SETTINGS
@given(batch=batches(), pp_size=st.sampled_from([2, 4, 8]))
def test_pipeline_plans_are_valid_and_deadlock_free(scheduler, batch, pp_size):
    plan = _plan(batch, scheduler, pp_size=pp_size)
    assert plan.layers_per_stage == 8 // pp_size
    _check(plan, batch[0])


@SETTINGS
@given(batch=batches(max_items=40), offload=st.booleans(), fast=st.booleans(), pp_size=st.sampled_from([1, 1, 2, 4]))
def test_balance_is_never_worse_than_naive(batch, offload, fast, pp_size):
    """Zero tolerance (1e-9 relative, float noise): balance evaluates Alg. 1's fill of the same
    units as one of its candidates and emits the fastest by the same cost model, so it can only
    lose to naive if its internal makespan and the estimate disagree - which is what this test
    guards. (Plain LPT alone loses to the fill by up to 30 % on tiny batches: its worst case is
    4/3 of optimal, and rings that wait for their slowest member make it worse.)"""
    cm = CM_FAST_LINKS if fast else CM
    naive = _plan(batch, "naive", offload=offload, cm=cm, pp_size=pp_size)
    balance = _plan(batch, "balance", offload=offload, cm=cm, pp_size=pp_size)
    assert balance.estimate.step_time_s <= naive.estimate.step_time_s * (1 + 1e-9)
