"""The profile's fit and report on synthetic measurements (no torch): known coefficients come back."""

from __future__ import annotations

import json

import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.profile import SyntheticSource, format_report, profile
from planner_cases import small_cost_model

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]


def truth(**changes) -> CostModel:
    values = dict(alpha1=3e-11, beta1=2e-7, gamma=5e-5, alpha2=120_000.0, beta2=1e6,
                  d2h_bandwidth=25e9, h2d_bandwidth=22e9, p2p_bandwidth_intra=3e11,
                  p2p_bandwidth_inter=3e11, p2p_latency_s=8e-6, ring_step_overhead_s=2e-5)
    values.update(changes)
    return small_cost_model(**values)


def fields_of(cm: CostModel) -> dict:
    return dict(num_layers=cm.num_layers, kv_bytes_per_token=cm.kv_bytes_per_token)


def test_exact_measurements_give_back_the_coefficients():
    known = truth()
    result = profile(SyntheticSource(known), lengths=LENGTHS, **fields_of(known))
    cm = result.cost_model
    for name in ("alpha1", "beta1", "gamma", "alpha2", "beta2"):
        assert getattr(cm, name) == pytest.approx(getattr(known, name), rel=1e-6), name
    for name in ("d2h_bandwidth", "h2d_bandwidth", "p2p_latency_s", "ring_step_overhead_s"):
        assert getattr(cm, name) == getattr(known, name)
    assert result.time_fit.r2 == pytest.approx(1.0) and result.activation_fit.r2 == pytest.approx(1.0)
    assert result.time_fit.worst_residual < 1e-6
    assert result.warnings == ()


def test_noisy_measurements_come_close_and_report_their_residuals():
    known = truth()
    result = profile(SyntheticSource(known, noise=0.02, seed=3), lengths=LENGTHS, **fields_of(known))
    cm = result.cost_model
    assert cm.alpha1 == pytest.approx(known.alpha1, rel=0.1)
    assert cm.alpha2 == pytest.approx(known.alpha2, rel=0.05)
    assert 0.99 < result.time_fit.r2 < 1.0
    assert [n for n, _ in result.time_fit.residuals] == LENGTHS
    assert all(abs(r) < 0.1 for _, r in result.time_fit.residuals)
    assert result.warnings == ()


def test_a_poor_fit_is_flagged():
    known = truth()
    result = profile(SyntheticSource(known, noise=0.6, seed=1), lengths=LENGTHS, **fields_of(known))
    text = " ".join(result.warnings)
    assert "fits poorly" in text or "off the fit" in text
    assert "WARNING" in format_report(result)


def test_lengths_too_short_to_see_attention_are_flagged():
    known = truth(alpha1=0.0)
    result = profile(SyntheticSource(known), lengths=[64, 128, 256, 512], **fields_of(known))
    assert any("s^2) term fitted to 0" in w for w in result.warnings)


def test_three_lengths_and_one_rank_are_flagged():
    known = truth()
    result = profile(SyntheticSource(known, hdp_size=1), lengths=LENGTHS[:3], **fields_of(known),
                     p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e9)
    text = " ".join(result.warnings)
    assert "only 3 lengths" in text and "P2P link" in text
    assert result.cost_model.p2p_bandwidth_intra == 1e9  # not measured: the caller's value


@pytest.mark.parametrize("lengths", [[1024, 2048], [0, 10, 20], [5, 5, 5, 6]])
def test_too_few_lengths_are_an_error(lengths):
    with pytest.raises(ValueError, match="at least 3 distinct lengths"):
        profile(SyntheticSource(truth()), lengths=lengths, num_layers=8, kv_bytes_per_token=64.0)


def test_the_written_model_is_what_the_planner_reads(tmp_path):
    known = truth()
    result = profile(SyntheticSource(known), lengths=LENGTHS, **fields_of(known))
    path = tmp_path / "cm.json"
    result.cost_model.save(path)
    assert CostModel.load(path) == result.cost_model
    report = json.loads(json.dumps(result.to_dict()))
    assert report["fit"]["time_r2"] == pytest.approx(1.0)
    assert "R^2" in format_report(result)


def test_fit_ring_terms_recovers_overhead_and_per_document_cost():
    """Samples played from a model with both terms: the joint fit recovers them exactly, the
    overhead-only fit ("before") cannot explain the many-document micro-batches."""
    from megatron_bytescale.planner.profile import fit_ring_terms

    truth = small_cost_model().with_(ring_step_overhead_s=2e-3, per_document_s=5e-4)
    base = truth.with_(ring_step_overhead_s=0.0, per_document_s=0.0, gamma=truth.gamma + 5e-4)
    layers = 4
    cases = [(2, 1, 512), (2, 1, 1024), (4, 1, 2048), (4, 32, 2048), (2, 32, 1024), (1, 32, 512)]
    samples = []
    for d, n, tokens in cases:
        parts = [tokens // n] * n
        samples.append((d, n, tokens, truth.micro_batch_time(parts, d, layers=layers)))
    fit = fit_ring_terms(base, samples, layers=layers)
    assert fit.overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.per_document_s == pytest.approx(5e-4, rel=1e-6)
    assert max(abs(r) for r in fit.residuals("after")) < 1e-9
    assert max(abs(r) for r in fit.residuals("before")) > 0.05
    # the applied model gives gamma back the one document a single-sequence timing held
    applied = fit.apply(base)
    assert applied.gamma == pytest.approx(truth.gamma)
    for d, n, tokens, seconds in samples:
        assert applied.micro_batch_time([tokens // n] * n, d, layers=layers) == pytest.approx(seconds)


def test_report_shows_ring_micro_batches_before_and_after():
    import dataclasses

    from megatron_bytescale.planner.profile import fit_profile, fit_ring_terms

    truth = small_cost_model().with_(ring_step_overhead_s=2e-3, per_document_s=5e-4)
    samples = SyntheticSource(truth, hdp_size=4).measure([256, 512, 1024, 2048])
    base = truth.with_(ring_step_overhead_s=0.0, per_document_s=0.0, gamma=truth.gamma + 5e-4)
    ring = [(d, n, t, truth.micro_batch_time([t // n] * n, d, layers=4)) for d, n, t in
            [(2, 1, 1024), (4, 1, 2048), (4, 32, 2048), (1, 32, 512)]]
    fit = fit_ring_terms(base, ring, layers=4)
    samples = dataclasses.replace(samples, per_document_s=fit.per_document_s,
                                  ring_step_overhead_s=fit.overhead_s, ring_fit=fit)
    result = fit_profile(samples, num_layers=4, kv_bytes_per_token=64.0)
    assert result.cost_model.per_document_s == pytest.approx(5e-4)
    assert result.cost_model.gamma == pytest.approx(truth.gamma, rel=1e-6)
    text = format_report(result)
    assert "per document per ring step 0.500 ms per layer" in text
    line = next(l for l in text.splitlines() if l.strip().startswith("D=4") and "32 doc(s)" in l)
    assert line.split()[-1] in ("+0.0%", "-0.0%") and line.split()[-3] == "+46.0%"  # after exact, before off
    assert result.to_dict()["samples"]["ring_micro_batches"]["samples"][2] == [4, 32, 2048, pytest.approx(ring[2][3])]
