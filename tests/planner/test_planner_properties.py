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


def _padded(length: int, ring: int, align: int) -> int:
    """Tokens a ring member's buffer holds for one sequence: 2 parts of the aligned ceil(L / 2N)."""
    return length if ring == 1 else 2 * ring * align * -(-length // (2 * ring * align))


def _check_estimate(plan, cm):
    """The estimate against numbers recomputed here from the cost model's public API."""
    est = plan.estimate
    assert est is not None and len(est.rank_time_s) == plan.hdp_size
    assert est.step_time_s == max(est.rank_time_s, default=0.0)
    lengths = plan.sequence_lengths()
    seconds, p2p = {}, 0
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            if mb.order not in seconds:
                ls = [lengths[s] for s in mb.seqs]
                seconds[mb.order] = cm.micro_batch_time(
                    ls, mb.ring_size, layers=plan.layers_per_stage, offload_ratio=mb.offload_ratio,
                    align=plan.align, intra_node=cm.ring_is_intra_node(mb.ring))
                # every hop moves K+V forward, K+V and dK+dV backward, per padded token and layer
                p2p += (cm.num_layers * (mb.ring_size - 1) * (2 * cm.kv_bytes_per_token + cm.dkv_bytes)
                        * sum(_padded(n, mb.ring_size, plan.align) for n in ls))
    assert est.p2p_bytes == pytest.approx(p2p, rel=1e-9, abs=1)
    for rp, finish in zip(plan.ranks, est.rank_time_s):
        # a rank (stage 0 of its pipeline) runs every op of its micro-batches one after another
        busy = sum(seconds[mb.order] for mb in rp.micro_batches)
        assert finish >= busy * (1 - 1e-9) and (finish > 0) == bool(rp.micro_batches)
        barriers = plan.meta.get("barrier_after_orders")
        if plan.pp_size == 1 and not barriers and all(mb.ring_size == 1 for mb in rp.micro_batches):
            assert finish == pytest.approx(busy, rel=1e-9)  # nothing to wait for


def _check(plan, lengths, cm=CM):
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
    _check_estimate(plan, cm)


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
    _check_estimate(balance, cm)
    assert balance.estimate.step_time_s <= naive.estimate.step_time_s * (1 + 1e-9)
