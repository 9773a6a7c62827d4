"""The per-document and straggler terms of the cost model, checked against hand arithmetic, and
their reach: the planner's estimate and the simulator see them through ring_time_terms."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import micro_batch_costs
from megatron_bytescale.planner.schedulers import make_plan


def bare(**changes) -> CostModel:
    """Free compute and links: only the term under test costs time."""
    values = dict(num_layers=2, alpha1=0.0, beta1=0.0, gamma=0.0, alpha2=1.0, d2h_bandwidth=1e30,
                  h2d_bandwidth=1e30, kv_bytes_per_token=1e-12, p2p_bandwidth_intra=1e30,
                  p2p_bandwidth_inter=1e30)
    values.update(changes)
    return CostModel(**values)


def test_per_document_term_by_hand():
    cm = bare(per_document_s=1e-3)
    # a member of a ring of 4 calls the kernel once per document per ring step: 3 docs * 4 steps
    assert cm.micro_batch_time([5000, 7000, 900], 4, layers=2) == pytest.approx(2 * 1e-3 * 3 * 4)
    # a local pack of 5 documents: once per document
    assert cm.micro_batch_time([10, 20, 30, 40, 50], 1, layers=2) == pytest.approx(2 * 1e-3 * 5)
    terms = cm.ring_time_terms(1000.0, 1e6, 1, layers=3, num_docs=np.array([1.0, 7.0]))
    assert np.asarray(terms.compute).tolist() == pytest.approx([3e-3, 21e-3])
    assert bare().micro_batch_time([5000, 7000, 900], 4, layers=2) == pytest.approx(0.0, abs=1e-15)


def test_straggler_term_by_hand_and_only_on_rings():
    cm = bare(ring_straggler_s=1e-3)
    t = cm.ring_time_terms(8000.0, 8e6, 8, layers=1, intra_node=False)
    assert t.exposed_comm == pytest.approx(7 * 1e-3 * math.sqrt(2 * math.log(8)))
    assert t.total == pytest.approx(t.exposed_comm)
    assert cm.micro_batch_time([100, 200], 1, layers=1) == 0.0
    # wider rings wait longer per step: 255 steps at sqrt(2 ln 256) against 38 at sqrt(2 ln 39)
    wide, narrow = cm.micro_batch_time([2**21], 256, layers=1), cm.micro_batch_time([2**21], 39, layers=1)
    assert wide / narrow == pytest.approx(255 * math.sqrt(math.log(256)) / (38 * math.sqrt(math.log(39))))


def test_estimate_counts_documents_per_micro_batch():
    lengths = [300, 40, 40, 40, 40, 900, 2500, 60, 70, 3000]
    plain, docs = bare(), bare(per_document_s=1e-3)
    plan = make_plan(lengths, scheduler="naive", hdp_size=4, capacity=1024, cost_model=plain)
    a, b = micro_batch_costs(plan, plain), micro_batch_costs(plan, docs)
    per_mb = np.bincount(b.seq_owner, minlength=len(b.orders))
    assert per_mb.sum() == len(lengths) and b.num_docs.tolist() == per_mb.tolist()
    expected = a.seconds + plan.layers_per_stage * 1e-3 * per_mb * b.ring_sizes
    assert b.seconds.tolist() == pytest.approx(expected.tolist())
    assert per_mb.max() > 1 and b.ring_sizes.max() > 1  # packs of several documents and a ring


def test_old_json_without_the_new_fields_still_loads(tmp_path):
    data = bare().to_dict()
    del data["per_document_s"], data["ring_straggler_s"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    cm = CostModel.load(path)
    assert cm.per_document_s == 0.0 and cm.ring_straggler_s == 0.0
    with pytest.raises(ValueError, match=r"per_document_s \(-1\.0\) must be a finite number >= 0"):
        bare(per_document_s=-1.0)


def test_link_time_straggler_by_hand_scales_with_bytes_and_link():
    """The wait as a multiple of the step's link time: (D - 1) * ratio * (m_f + m_b) * sqrt(2 ln D)
    per layer; half the K/V bytes wait half as long, a ring inside a node waits at NVLink's rate."""
    kv, bw_inter, bw_intra = 4096.0, 50e9, 400e9
    cm = bare(kv_bytes_per_token=kv, dkv_bytes_per_token=2 * kv, p2p_bandwidth_inter=bw_inter,
              p2p_bandwidth_intra=bw_intra, p2p_latency_s=1e-5, ring_straggler_link_ratio=1.5)
    d, sum_p = 8, 8 * 8192.0
    share = sum_p / d
    link = 2e-5 + (kv + 2 * kv + kv) * share / bw_inter  # m_f + m_b: K/V forward, K/V + dK/dV backward
    t = cm.ring_time_terms(sum_p, 8 * 8192.0**2, d, layers=3, intra_node=False)
    wait = 3 * (d - 1) * 1.5 * link * math.sqrt(2 * math.log(d))
    exposed_link = 3 * (d - 1) * link  # free compute: every link second is exposed
    assert t.exposed_comm == pytest.approx(exposed_link + wait)
    assert t.comm == pytest.approx(exposed_link + wait)
    # without latency the wait is linear in the bytes a member sends per step
    no_lat = cm.with_(p2p_latency_s=0.0)
    half = no_lat.with_(kv_bytes_per_token=kv / 2, dkv_bytes_per_token=kv)
    full_t = no_lat.ring_time_terms(sum_p, 0.0, d, layers=1, intra_node=False).exposed_comm
    half_t = half.ring_time_terms(sum_p, 0.0, d, layers=1, intra_node=False).exposed_comm
    assert half_t == pytest.approx(full_t / 2)
    intra_t = no_lat.ring_time_terms(sum_p, 0.0, d, layers=1, intra_node=True).exposed_comm
    assert intra_t == pytest.approx(full_t * bw_inter / bw_intra)
    # not a ring, no wait; the two forms add up
    assert cm.micro_batch_time([100, 200], 1, layers=1) == pytest.approx(0.0, abs=1e-15)
    both = no_lat.with_(ring_straggler_s=1e-3).ring_time_terms(sum_p, 0.0, d, layers=1, intra_node=False).exposed_comm
    assert both == pytest.approx(full_t + (d - 1) * 1e-3 * math.sqrt(2 * math.log(d)))


def test_link_time_straggler_round_trips_and_refuses_bad_values(tmp_path):
    from megatron_bytescale.planner.presets import PAPER_FIT, hardware_spec

    cm = bare(ring_straggler_link_ratio=0.75)
    path = tmp_path / "cm.json"
    cm.save(path)
    assert CostModel.load(path) == cm
    with pytest.raises(ValueError, match=r"ring_straggler_link_ratio \(-0\.5\) must be a finite number >= 0"):
        bare(ring_straggler_link_ratio=-0.5)
    with pytest.raises(ValueError, match="ring_straggler_link_ratio must be >= 0"):
        hardware_spec("paper-fit", ring_straggler_link_ratio=-1.0)
    # the fitted preset carries the link-time form into every model built from it
    from megatron_bytescale.planner.presets import preset_cost_model

    fitted = preset_cost_model("llama-70b", "paper-fit")
    assert fitted.ring_straggler_link_ratio == PAPER_FIT.ring_straggler_link_ratio > 0
    assert fitted.ring_straggler_s == 0.0
    assert preset_cost_model("llama-70b", "h100").ring_straggler_link_ratio == 0.0


def test_old_json_without_the_link_ratio_still_loads(tmp_path):
    data = bare().to_dict()
    del data["ring_straggler_link_ratio"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert CostModel.load(path).ring_straggler_link_ratio == 0.0
