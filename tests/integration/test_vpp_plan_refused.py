"""A plan made for virtual pipeline stages is refused by a run with one model chunk per stage, and
the other way round (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_bytescale.integration.pipeline_interleaved import check_plan_interleaved
from megatron_bytescale.integration.schedule import check_plan_pipeline
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.estimate import with_virtual_pipeline
from megatron_bytescale.planner.schedulers import make_plan


def test_training_refuses_a_plan_for_another_number_of_virtual_stages():
    cm = CostModel(name="toy", num_layers=8, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0, beta2=0.0,
                   d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0, dkv_bytes_per_token=128.0,
                   p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8, p2p_latency_s=1e-6, ranks_per_node=4)
    lengths = np.random.default_rng(0).integers(10, 600, 30).tolist()
    plan = make_plan(lengths, scheduler="balance", hdp_size=4, capacity=256, cost_model=cm, pp_size=2)
    check_plan_pipeline(SimpleNamespace(plan=plan, index=3), 2)
    with pytest.raises(ValueError, match=r"step 3: the plan is made for 2 virtual pipeline stages.*"
                                         r"--virtual-pipeline-model-parallel-size 2"):
        check_plan_pipeline(SimpleNamespace(plan=with_virtual_pipeline(plan, 2, cm), index=3), 2)
    vpp_plan = with_virtual_pipeline(plan, 2, cm)
    check_plan_interleaved(SimpleNamespace(plan=vpp_plan, index=3), 2, 2)
    for bad, pp, vpp in ((plan, 2, 2), (vpp_plan, 2, 4), (vpp_plan, 4, 2)):
        with pytest.raises(ValueError, match=rf"step 3: the plan was made for {bad.pp_size} pipeline stage\(s\) x "
                                             rf"{bad.virtual_pipeline_size} virtual.*pp_size={pp}, vpp_size={vpp}"):
            check_plan_interleaved(SimpleNamespace(plan=bad, index=3), pp, vpp)
