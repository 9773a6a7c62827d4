"""--bytescale-seq-split: parsed, refused in one line where it cannot run, and reaching the planner."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_bytescale.integration.config import ByteScaleConfig, add_bytescale_args
from megatron_bytescale.integration.planning import make_step_planner, seq_split_refusals
from megatron_bytescale.planner.cost_model import CostModel


def _cost_model() -> CostModel:  # tests/planner/planner_cases.small_cost_model(num_layers=16)
    return CostModel(name="toy", num_layers=16, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0,
                     d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0,
                     dkv_bytes_per_token=128.0, p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8,
                     p2p_latency_s=1e-6, ranks_per_node=4)


def _lengths() -> list[int]:  # seed 3 of tests/planner/test_seq_split_plan.py: its long rings split
    rng = np.random.default_rng(3)
    return np.concatenate([rng.integers(10, 300, int(rng.integers(10, 40))),
                           rng.integers(600, 3000, int(rng.integers(1, 4)))]).tolist()


def test_the_flag_reaches_the_planner_and_the_plan_has_chunks():
    args = add_bytescale_args(argparse.ArgumentParser()).parse_args(
        ["--bytescale-seq-split", "--bytescale-capacity", "512", "--no-bytescale-offload"])
    config = ByteScaleConfig.from_args(args)
    assert config.seq_split is True
    plans = {}
    for split in (False, True):
        plan_fn = make_step_planner(ByteScaleConfig(hdp=True, capacity=512, seq_split=split), hdp_size=8,
                                    cost_model=_cost_model(), pp_size=4)
        plans[split] = plan_fn(_lengths()).validate()
    assert not any(mb.chunk for rp in plans[False].ranks for mb in rp.micro_batches)
    assert any(mb.chunk for rp in plans[True].ranks for mb in rp.micro_batches)
    assert plans[True].estimate.step_time_s < plans[False].estimate.step_time_s


@pytest.mark.parametrize("config, kw, flag", [
    (dict(offload=True), {}, "--bytescale-offload (use --no-bytescale-offload)"),
    ({}, dict(vpp_size=2), "--virtual-pipeline-model-parallel-size 2"),
    ({}, dict(ep_size=2), "--expert-model-parallel-size 2"),
    ({}, dict(pp_size=1), "--pipeline-model-parallel-size 1"),
    (dict(scheduler="naive"), {}, "--bytescale-scheduler naive (use balance)"),
])
def test_seq_split_is_refused_naming_the_flag(config, kw, flag):
    settings = dict(hdp=True, capacity=512, seq_split=True, **config)
    with pytest.raises(ValueError, match="--bytescale-seq-split does not run with") as exc:
        make_step_planner(ByteScaleConfig(**settings), hdp_size=8, cost_model=_cost_model(),
                          **{"pp_size": 4, **kw})
    assert flag in str(exc.value) and "\n" not in str(exc.value)


def test_megatron_args_refusals_list_recomputation_too():
    args = argparse.Namespace(bytescale_seq_split=True, bytescale_offload=True, bytescale_scheduler="balance",
                              pipeline_model_parallel_size=2, expert_model_parallel_size=1,
                              virtual_pipeline_model_parallel_size=None, recompute_granularity="selective")
    reasons = seq_split_refusals(args)
    assert len(reasons) == 2
    assert "--bytescale-offload" in reasons[0] and "--recompute-granularity selective" in reasons[1]
    args.bytescale_offload, args.recompute_granularity = False, None
    assert seq_split_refusals(args) == []
    args.bytescale_seq_split = False
    args.pipeline_model_parallel_size = 1
    assert seq_split_refusals(args) == []
