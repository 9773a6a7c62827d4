"""Training runs plain 1F1B: a plan estimated with virtual pipeline stages is refused (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_bytescale.integration.schedule import check_plan_pipeline
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import with_virtual_pipeline
from megatron_bytescale.planner.schedulers import make_plan


def test_training_refuses_a_plan_estimated_with_virtual_stages():
    cm = CostModel(name="toy", num_layers=8, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0, beta2=0.0,
                   d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0, dkv_bytes_per_token=128.0,
                   p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8, p2p_latency_s=1e-6, ranks_per_node=4)
    lengths = np.random.default_rng(0).integers(10, 600, 30).tolist()
    plan = make_plan(lengths, scheduler="balance", hdp_size=4, capacity=256, cost_model=cm, pp_size=2)
    check_plan_pipeline(SimpleNamespace(plan=plan, index=3), 2)
    with pytest.raises(ValueError, match=r"step 3: the plan is estimated with 2 virtual pipeline stages.*"
                                         r"plan with virtual_pipeline_size 1"):
        check_plan_pipeline(SimpleNamespace(plan=with_virtual_pipeline(plan, 2, cm), index=3), 2)
