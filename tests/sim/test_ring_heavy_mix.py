"""The demo's ring-heavy mix (``synthetic-rings``): the batches where the CPU validation can see
HDP balance beat Alg. 1 on 4 ranks, checked with the planner's own estimate."""

from __future__ import annotations

import numpy as np

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.schedulers import make_plan
from itertools import islice

from megatron_bytescale.tools.demo_data import RING_FRACTION, demo_global_batches, ring_heavy_documents
from megatron_bytescale.tools.demo_settings import DemoSettings


def cpu_demo_cost_model() -> CostModel:
    """A calibration of the 4-layer CPU demo model on a 2-core machine (docs/reproduction.md)."""
    return CostModel(name="cpu-demo", num_layers=4, alpha1=4.08e-8, beta1=3.69e-5, gamma=7.42e-3,
                     alpha2=10240.0, d2h_bandwidth=5e9, h2d_bandwidth=5e9, kv_bytes_per_token=1024.0,
                     p2p_bandwidth_intra=0.24e9, p2p_bandwidth_inter=0.24e9, p2p_latency_s=678e-6,
                     ring_step_overhead_s=3.14e-3, per_document_s=0.522e-3)


def test_ring_heavy_mix_lengths_and_balance_gain():
    settings = DemoSettings()
    c = settings.capacity
    flat = np.array([len(d) for d in islice(ring_heavy_documents(settings, seed=0), 2000)])
    rings = flat[flat > c]
    # every long document needs a ring of 3 of the 4 ranks; the rest fill one or two per pack
    assert rings.min() > 2 * c and rings.max() <= round(1300 * c / 512)
    assert flat[flat <= c].min() >= round(200 * c / 512) and flat[flat <= c].max() <= round(400 * c / 512)
    assert abs(rings.size / flat.size - RING_FRACTION) < 0.03
    batches, _ = demo_global_batches("synthetic-rings", settings)  # documents cut at batch ends
    lengths = [[len(t) for t in b.tokens_by_seq] for b in batches]
    cm = cpu_demo_cost_model()
    step = {s: np.array([make_plan(x, scheduler=s, hdp_size=settings.ranks, capacity=c, cost_model=cm,
                                   context_length=settings.context_length).estimate.step_time_s
                         for x in lengths]) for s in ("naive", "balance")}
    gain = step["naive"].sum() / step["balance"].sum()
    assert gain > 1.06, f"balance is only {gain:.3f}x faster than naive on the ring-heavy mix"
    assert np.all(step["balance"] <= step["naive"] * 1.001)
