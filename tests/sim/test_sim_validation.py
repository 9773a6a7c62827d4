"""The demo validation's arithmetic on a fabricated run whose "measurements" obey known terms."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import micro_batch_costs
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.sim.demo_validation import (
    fit_residual_terms,
    held_out_ratio_checks,
    ratio_by_documents,
    ratio_checks,
    validate_demo,
)

SCALE, PER_DOC_STEP = 1.25, 2e-3
CM = CostModel(name="cpu", num_layers=4, alpha1=1e-8, beta1=2e-5, gamma=2e-3, alpha2=9000.0,
               d2h_bandwidth=1e10, h2d_bandwidth=1e10, kv_bytes_per_token=512.0, p2p_bandwidth_intra=2e9,
               p2p_bandwidth_inter=2e9, p2p_latency_s=1e-4, ring_step_overhead_s=3e-3, ranks_per_node=4)
SETTINGS = {"capacity": 512, "context_length": 2048, "offload": False, "align": 1, "ranks": 4}


def fabricated_results() -> dict:
    """A demo results.json whose every micro-batch took SCALE x predicted + PER_DOC_STEP x
    documents x ring size (rings), so the validation must find exactly those terms."""
    datasets = {}
    for name, mix in (("a", "github"), ("b", "byted"), ("c", "lognormal")):
        modes = {}
        for mode in ("static", "naive", "balance"):
            steps = []
            for step in range(4):
                lengths = synthetic_lengths(mix, 8192, seed=step, max_length=2048)
                plan = make_plan(lengths, scheduler=mode, hdp_size=4, capacity=512, cost_model=CM,
                                 offload=False, context_length=2048)
                costs = micro_batch_costs(plan, CM)
                seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
                records, busy = [], []
                for rp in plan.ranks:
                    mine = []
                    for mb in rp.micro_batches:
                        extra = PER_DOC_STEP * len(mb.seqs) * mb.ring_size if mb.ring_size > 1 else 0.0
                        mine.append([mb.order, mb.ring_size, mb.num_tokens, SCALE * seconds[mb.order] + extra, 0.0])
                    records.append(mine)
                    busy.append(sum(r[3] for r in mine))
                steps.append({"step": step, "lengths": [int(x) for x in lengths], "plan_hash": plan.content_hash(),
                              "busy_s": busy, "wall_s": max(busy), "phase_wall_s": max(busy),
                              "micro_batch_records": records})
            modes[mode] = {"label": mode, "steps": steps}
        datasets[name] = {"description": name, "modes": modes}
    return {"settings": SETTINGS, "calibration": {"cost_model": CM.to_dict()}, "world_size": 4,
            "cpu_count": 4, "datasets": datasets}


def test_validation_recovers_the_terms_that_generated_the_run():
    validations = validate_demo(fabricated_results())
    assert len(validations) == 9 and all(v.plans_matching == v.steps == 3 for v in validations)
    samples = [s for v in validations for s in v.samples]
    terms = fit_residual_terms(samples)
    assert terms.scale == pytest.approx(SCALE, rel=1e-9)
    assert terms.per_doc_step_s == pytest.approx(PER_DOC_STEP, rel=1e-9)
    # fitted on the other datasets, the terms predict each dataset's ratios exactly
    for check in held_out_ratio_checks(validations):
        assert check.error == pytest.approx(0.0, abs=1e-9), check
    # without them, per-rank busy is off by the scale at least, and static (many documents per
    # ring) is under-predicted more than balance
    for v in validations:
        measured, predicted = np.array(v.measured_busy_by_rank), np.array(v.predicted_busy_by_rank)
        assert np.all(measured >= SCALE * predicted * (1 - 1e-9))
    static = next(c for c in ratio_checks(validations) if c.ratio == "static / balance" and c.kind == "busy")
    assert static.error < 0
    kinds = {(k, d) for k, d, _, _ in ratio_by_documents(samples)}
    assert ("local pack", "1") in kinds or ("local pack", "2-4") in kinds


def test_validation_needs_recorded_lengths():
    results = fabricated_results()
    for data in results["datasets"].values():
        for mode in data["modes"].values():
            for step in mode["steps"]:
                del step["lengths"]
    with pytest.raises(ValueError, match="no per-step lengths; rerun bytescale demo"):
        validate_demo(results)


def test_without_document_term_keeps_single_sequences_and_drops_the_rest():
    from megatron_bytescale.planner.presets import preset_cost_model
    from megatron_bytescale.sim.demo_validation import without_document_term

    cm = preset_cost_model("llama-7b").with_(per_document_s=1e-3)
    old = without_document_term(cm)
    assert old.per_document_s == 0.0 and old.gamma == pytest.approx(cm.gamma + 1e-3)
    # a single sequence on one rank is what the calibration timed: the same under both models
    assert old.micro_batch_time([4096], 1, layers=4) == pytest.approx(cm.micro_batch_time([4096], 1, layers=4))
    # 10 documents on a ring of 4: 4 * 10 - 1 kernel calls more per layer with the term
    lengths = [800] * 10
    extra = cm.micro_batch_time(lengths, 4, layers=4) - old.micro_batch_time(lengths, 4, layers=4)
    assert extra == pytest.approx(4 * 1e-3 * (10 * 4 - 1))
