"""The host-memory budget of selective offload: Eq. 3 never needs more host memory than a rank has."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import host_bytes_per_rank
from megatron_bytescale.planner.offload import host_bytes_per_member, max_zigzag_share, solve_offload
from megatron_bytescale.planner.schedulers import make_plan
from planner_cases import batches, small_cost_model


def eq3_model(**changes) -> CostModel:
    """Act(s) = s bytes per layer; T(s) huge, so the overlap bound never limits the ratio."""
    return small_cost_model(num_layers=32, alpha1=1.0, beta1=1.0, gamma=1.0, alpha2=1.0, beta2=0.0,
                            **changes)


def test_the_paper_illustration_needs_host_memory_and_a_budget_caps_it():
    """2M tokens, l = 32, C = 8K: 16 ranks at r = 1 park 30 layers x 128K tokens each on the host."""
    unlimited = solve_offload(2_097_152, capacity=8192, layers=32, cost_model=eq3_model())
    assert (unlimited.ring_size, unlimited.offload_ratio) == (16, pytest.approx(1.0))
    need = host_bytes_per_member(2_097_152, 16, 1.0, layers=32, cost_model=eq3_model())
    assert need == 30 * 131072
    capped = solve_offload(2_097_152, capacity=8192, layers=32,
                           cost_model=eq3_model(host_memory_bytes=need / 2))
    assert 16 < capped.ring_size < 256
    share = max_zigzag_share(2_097_152, capped.ring_size)
    assert capped.offload_ratio * 30 * share <= need / 2 * (1 + 1e-9)
    # with two micro-batches in flight (PP = 2) the same budget gives a larger ring
    pp2 = solve_offload(2_097_152, capacity=8192, layers=32, in_flight=2,
                        cost_model=eq3_model(host_memory_bytes=need / 2))
    assert pp2.ring_size > capped.ring_size


def test_no_budget_left_means_no_offload():
    tiny = solve_offload(2_097_152, capacity=8192, layers=32, cost_model=eq3_model(host_memory_bytes=1.0))
    assert (tiny.ring_size, tiny.offload_ratio) == (256, 0.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="host_memory_bytes"):
        small_cost_model(host_memory_bytes=bad)


def test_the_budget_survives_json():
    cm = small_cost_model(host_memory_bytes=2.5e9)
    assert CostModel.from_dict(cm.to_dict()) == cm


def test_a_budget_too_small_for_the_longest_sequence_is_an_error_naming_it():
    cm = eq3_model()
    lengths = [8 * 8192, 100, 200]  # 65K tokens on 4 ranks of 8K needs offload
    plan = make_plan(lengths, scheduler="naive", hdp_size=4, capacity=8192, cost_model=cm)
    assert plan.estimate.extra["max_host_bytes_per_rank"] > 0
    with pytest.raises(ValueError, match=r"host memory budget of 1e-06 GB per rank .*"
                                         r"--bytescale-host-memory-gb"):
        make_plan(lengths, scheduler="naive", hdp_size=4, capacity=8192,
                  cost_model=cm.with_(host_memory_bytes=1000.0))


@settings(max_examples=60, deadline=None)
@given(batch=batches(), scheduler=st.sampled_from(("naive", "balance")),
       fraction=st.sampled_from((0.02, 0.1, 0.5)), pp_size=st.sampled_from((1, 2)))
def test_plans_never_exceed_the_host_budget(batch, scheduler, fraction, pp_size):
    lengths, hdp, capacity, align = batch
    cm = small_cost_model(alpha1=1e-3)  # slow attention: offload is always overlap-feasible
    unlimited = make_plan(lengths, scheduler=scheduler, hdp_size=hdp, capacity=capacity, cost_model=cm,
                          align=align, pp_size=pp_size, overlong="drop")
    need = unlimited.estimate.extra["max_host_bytes_per_rank"]
    budget = max(1.0, fraction * need)
    capped = make_plan(lengths, scheduler=scheduler, hdp_size=hdp, capacity=capacity, align=align,
                       cost_model=cm.with_(host_memory_bytes=budget), pp_size=pp_size, overlong="drop")
    capped.validate()
    host = host_bytes_per_rank(capped, capped_cost := cm.with_(host_memory_bytes=budget))
    assert host.max(initial=0.0) <= budget * (1 + 1e-9)
    assert capped.estimate.extra["host_memory_bytes"] == capped_cost.host_memory_bytes
    assert capped.estimate.extra["max_host_bytes_per_rank"] == pytest.approx(host.max(initial=0.0))
