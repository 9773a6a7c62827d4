"""bytescale profile's MoE terms on synthetic measurements (no torch): the all-to-all fit gives
back a known dispatch cost, alongside the dense terms, and reaches the report and the JSON."""

from __future__ import annotations

import json

import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.moe_cost import a2a_bytes_per_token, fit_moe_dispatch
from megatron_bytescale.planner.profile import SyntheticSource, format_report, profile
from planner_cases import small_cost_model

LENGTHS = [1024, 2048, 4096, 8192, 16384]


def moe_truth(**changes) -> CostModel:
    values = dict(alpha1=3e-11, beta1=2e-7, gamma=5e-5, alpha2=120_000.0, beta2=1e6, d2h_bandwidth=25e9,
                  h2d_bandwidth=22e9, p2p_bandwidth_intra=3e11, p2p_bandwidth_inter=3e11, p2p_latency_s=8e-6,
                  expert_parallel_size=4, moe_dispatch_s_per_token=3e-7, moe_dispatch_s=2e-4,
                  moe_a2a_bytes_per_token=a2a_bytes_per_token(hidden_size=64, topk=2, element_size=4,
                                                              expert_parallel_size=4))
    values.update(changes)
    return small_cost_model(**values)


def test_fit_by_hand():
    # one all-to-all: 1e-7 s per token + 5e-5 s; the layer has four
    fit = fit_moe_dispatch([(100, 1e-5 + 5e-5), (1000, 1e-4 + 5e-5), (4000, 4e-4 + 5e-5)])
    assert fit.seconds_per_token == pytest.approx(4e-7) and fit.seconds == pytest.approx(2e-4)
    assert fit.predicted == pytest.approx((6e-5, 1.5e-4, 4.5e-4))
    # noise that would make the constant negative: clamped at 0, slope through the origin
    fit = fit_moe_dispatch([(100, 1e-5), (200, 3e-5)])
    assert fit.seconds == 0.0 and fit.seconds_per_token == pytest.approx(4 * (100 * 1e-5 + 200 * 3e-5) / (100**2 + 200**2))
    with pytest.raises(ValueError, match="at least 2 distinct token counts"):
        fit_moe_dispatch([(100, 1e-5), (100, 2e-5)])
    assert a2a_bytes_per_token(hidden_size=64, topk=2, element_size=4, expert_parallel_size=4) == 4 * 2 * 64 * 4 * 3 / 4


def test_profile_recovers_the_moe_terms_with_the_dense_ones():
    known = moe_truth()
    result = profile(SyntheticSource(known), lengths=LENGTHS, num_layers=known.num_layers,
                     kv_bytes_per_token=known.kv_bytes_per_token)
    cm = result.cost_model
    for name in ("alpha1", "beta1", "gamma", "moe_dispatch_s_per_token", "moe_dispatch_s"):
        assert getattr(cm, name) == pytest.approx(getattr(known, name), rel=1e-6), name
    assert (cm.expert_parallel_size, cm.moe_a2a_bytes_per_token) == (4, known.moe_a2a_bytes_per_token)
    report = format_report(result)
    assert "MoE all-to-all over 4 ranks: 0.300 us per token + 0.200 ms per layer" in report
    data = json.loads(json.dumps(result.to_dict()))
    assert data["samples"]["expert_parallel_size"] == 4 and len(data["samples"]["moe_all_to_all"]) == 5
    assert CostModel.from_dict(data["cost_model"]) == cm
    noisy = profile(SyntheticSource(known, noise=0.02, seed=5), lengths=LENGTHS, num_layers=known.num_layers,
                    kv_bytes_per_token=known.kv_bytes_per_token).cost_model
    assert noisy.moe_dispatch_s_per_token == pytest.approx(known.moe_dispatch_s_per_token, rel=0.05)


def test_dense_and_ep1_profiles_have_no_dispatch():
    for known in (moe_truth(expert_parallel_size=1, moe_dispatch_s_per_token=0.0, moe_dispatch_s=0.0,
                            moe_a2a_bytes_per_token=0.0), moe_truth(expert_parallel_size=1)):
        result = profile(SyntheticSource(known), lengths=LENGTHS, num_layers=known.num_layers,
                         kv_bytes_per_token=known.kv_bytes_per_token)
        assert result.samples.moe_dispatch_samples == ()
        assert (result.cost_model.moe_dispatch_s_per_token, result.cost_model.expert_parallel_size) == (0.0, 1)
        assert "MoE all-to-all" not in format_report(result)


def test_profile_records_expert_tensor_parallelism_and_the_plans_expert_groups():
    """A profile of a run at ETP other than TP records ETP and the HDP ranks an expert group
    spans; the fitted cost model hands that span to plans. A profile without them (ETP = TP,
    or written before ETP was modelled) plans with E."""
    from dataclasses import replace

    from megatron_bytescale.planner.profile import fit_profile

    known = moe_truth()
    samples = SyntheticSource(known).measure(LENGTHS)
    assert (samples.expert_tensor_parallel_size, samples.expert_lockstep_size) == (None, None)
    plain = fit_profile(samples, num_layers=known.num_layers, kv_bytes_per_token=known.kv_bytes_per_token)
    assert (plain.cost_model.expert_lockstep_size, plain.cost_model.plan_ep_size) == (None, 4)
    assert not any("expert-tensor" in w for w in plain.warnings)
    etp = fit_profile(replace(samples, expert_tensor_parallel_size=2, expert_lockstep_size=8),
                      num_layers=known.num_layers, kv_bytes_per_token=known.kv_bytes_per_token)
    assert (etp.cost_model.expert_parallel_size, etp.cost_model.plan_ep_size) == (4, 8)  # TP 1 x ETP 2 x EP 4
    data = json.loads(json.dumps(etp.to_dict()))
    assert (data["samples"]["expert_tensor_parallel_size"], data["samples"]["expert_lockstep_size"]) == (2, 8)
    assert CostModel.from_dict(data["cost_model"]).plan_ep_size == 8
    assert "MoE all-to-all over 4 ranks (2 GPU(s) apart):" in format_report(etp)
    assert any("expert-tensor parallelism 2: the layers were timed with every expert" in w for w in etp.warnings)
    # an EP 1 run whose experts span HDP ranks (TP 1 x ETP 2): no all-to-all, still a lockstep of 2
    ep1 = fit_profile(replace(SyntheticSource(moe_truth(expert_parallel_size=1)).measure(LENGTHS),
                              expert_tensor_parallel_size=2, expert_lockstep_size=2),
                      num_layers=known.num_layers, kv_bytes_per_token=known.kv_bytes_per_token)
    assert (ep1.cost_model.moe_dispatch_s_per_token, ep1.cost_model.plan_ep_size) == (0.0, 2)
    # the synthetic source plays a truth's lockstep back
    truth = moe_truth(expert_lockstep_size=2)
    assert SyntheticSource(truth).measure(LENGTHS).expert_lockstep_size == 2


def test_expert_parallel_groups_sit_etp_ranks_apart():
    from megatron_bytescale.planner.expert_layout import expert_parallel_group

    assert expert_parallel_group(0, etp=1, ep=2) == [0, 1]  # TP 2 x ETP 1 x EP 2: inside a TP group
    assert expert_parallel_group(3, etp=2, ep=2) == [1, 3]  # TP 1 x ETP 2 x EP 2: 2 apart
    assert expert_parallel_group(13, etp=2, ep=4) == [9, 11, 13, 15]  # second block of 8
    assert [expert_parallel_group(r, etp=4, ep=2) for r in (0, 5, 11)] == [[0, 4], [1, 5], [11, 15]]
