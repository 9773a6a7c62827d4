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
    ({}, dict(ep_size=2), "expert groups of 2 HDP ranks (--expert-tensor-parallel-size x "
                          "--expert-model-parallel-size / --tensor-model-parallel-size = 2)"),
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


@pytest.mark.parametrize("tp, etp, ep, refused", [
    (2, 1, 2, None),  # the expert group is one HDP rank's TP pair: block 1, no slot rule
    (4, 1, 4, None),
    (1, None, 1, None),
    (2, None, 2, "expert groups of 2 HDP ranks (--expert-tensor-parallel-size 2 x "
                 "--expert-model-parallel-size 2 / --tensor-model-parallel-size 2 = 2)"),
    (2, 1, 4, "expert groups of 2 HDP ranks (--expert-tensor-parallel-size 1 x "
              "--expert-model-parallel-size 4 / --tensor-model-parallel-size 2 = 2)"),
    (1, 2, 2, "expert groups of 4 HDP ranks"),
])
def test_megatron_args_refuse_seq_split_by_the_expert_block_not_the_ep_size(tp, etp, ep, refused):
    """The hooks refuse ``--bytescale-seq-split`` only when an expert group spans several HDP
    ranks (``ETP x EP / TP`` > 1, what the driver refuses too), naming the flags that make it:
    an expert group inside one TP group runs the same chunks in the same order on every rank."""
    args = argparse.Namespace(bytescale_seq_split=True, bytescale_offload=False,
                              bytescale_scheduler="balance", pipeline_model_parallel_size=2,
                              tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
                              expert_model_parallel_size=ep,
                              virtual_pipeline_model_parallel_size=None)
    reasons = seq_split_refusals(args)
    if refused is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and refused in reasons[0], reasons
        assert reasons[0].startswith("--bytescale-seq-split does not run with expert groups")
