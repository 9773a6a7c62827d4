"""The MoE terms of the cost model (planner/moe_cost.py) against hand arithmetic, and their
reach: the ring formula, the presets, the CLI's --expert-model-parallel-size."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.moe_cost import moe_dispatch
from megatron_bytescale.planner.presets import (
    GEMM_FWD_BWD_FACTOR,
    H100,
    PAPER_FIT,
    HardwareSpec,
    ModelSpec,
    analytic_cost_model,
    layer_flops_per_token,
    preset_cost_model,
)

#: Round numbers: 8 GPUs a node, NVLink 100 GB/s, network 10 GB/s, 10 us, memory 1 TB/s.
HW = HardwareSpec(name="hand", peak_flops=1e15, gemm_efficiency=0.5, attention_efficiency=0.5,
                  layer_overhead_s=0.0, d2h_bandwidth=1e9, h2d_bandwidth=1e9, p2p_bandwidth_intra=100e9,
                  p2p_bandwidth_inter=10e9, p2p_latency_s=1e-5, gpus_per_node=8, memory_bandwidth=1e12)


def moe(**changes) -> ModelSpec:
    """h 1024, 8 experts, top-2, bf16: one routed copy of a token is 2 * 1024 * 2 = 4096 bytes."""
    values = dict(name="hand-moe", num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                  ffn_hidden_size=2048, vocab_size=1000, num_experts=8, moe_router_topk=2)
    values.update(changes)
    return ModelSpec(**values)


def test_dispatch_across_nodes_by_hand():
    # TP 2 -> 4 HDP ranks a node; EP 8 -> 3 peers on the node, 4 on the other node
    d = moe_dispatch(moe(tensor_parallel_size=2, expert_parallel_size=8), HW)
    assert d.a2a_intra_bytes_per_token == pytest.approx(4 * 4096 * 3 / 8 / 2)  # 3072
    assert d.a2a_inter_bytes_per_token == pytest.approx(4 * 4096 * 4 / 8 / 2)  # 4096
    assert d.a2a_bytes_per_token == pytest.approx(4 * 4096 * 7 / 8 / 2)
    assert d.tp_bytes_per_token == pytest.approx(4 * 4096 * 1 / 2)  # 8192
    # NVLink and the NIC at once: the network share (4096 B at 10 GB/s) is the longer
    assert d.seconds_per_token == pytest.approx(4096 / 10e9 + 8192 / 100e9)
    assert d.seconds == pytest.approx(8 * 1e-5)  # 4 all-to-alls + 4 TP collectives
    assert d.permute_bytes_per_token == pytest.approx(8 * 4096 / 2)
    assert d.permute_s_per_token == pytest.approx(8 * 4096 / 2 / 1e12)


def test_dispatch_inside_a_node_and_without_ep_by_hand():
    d = moe_dispatch(moe(tensor_parallel_size=2, expert_parallel_size=4), HW)  # 4 ranks: one node
    assert (d.a2a_intra_bytes_per_token, d.a2a_inter_bytes_per_token) == pytest.approx((4 * 4096 * 3 / 4 / 2, 0.0))
    assert d.seconds_per_token == pytest.approx(6144 / 100e9 + 8192 / 100e9)
    tp1 = moe_dispatch(moe(expert_parallel_size=2), HW)  # TP 1: no TP collectives
    assert (tp1.tp_bytes_per_token, tp1.a2a_bytes_per_token) == pytest.approx((0.0, 4 * 4096 / 2))
    assert tp1.seconds == pytest.approx(4 * 1e-5)
    ep1 = moe_dispatch(moe(tensor_parallel_size=4), HW)  # EP 1, TP 4: the dispatcher's TP gather only
    assert ep1.a2a_bytes_per_token == 0.0
    assert ep1.seconds_per_token == pytest.approx(4 * 4096 * 3 / 4 / 100e9)
    assert ep1.seconds == pytest.approx(4 * 1e-5)
    none = moe_dispatch(moe(), HW)  # EP 1, TP 1: no communication, only the copies
    assert (none.seconds_per_token, none.seconds) == (0.0, 0.0)
    assert none.permute_s_per_token == pytest.approx(8 * 4096 / 1e12)


def test_dense_model_is_unchanged_and_moe_costs_land_in_the_cost_model():
    dense = moe(num_experts=1, moe_router_topk=1, tensor_parallel_size=2)
    cm = analytic_cost_model(dense, HW)
    f = layer_flops_per_token(dense)
    assert cm.beta1 == GEMM_FWD_BWD_FACTOR * (f["attention_linear"] + f["mlp"] + f["lm_head"]) / 2 / 0.5e15
    assert (cm.moe_dispatch_s_per_token, cm.moe_dispatch_s, cm.moe_a2a_bytes_per_token,
            cm.moe_tp_bytes_per_token, cm.expert_parallel_size) == (0.0, 0.0, 0.0, 0.0, 1)
    spec = moe(tensor_parallel_size=2, expert_parallel_size=8)
    cm = analytic_cost_model(spec, HW)
    f = layer_flops_per_token(spec)
    assert f["mlp"] == pytest.approx(2 * 6 * 1024 * 2048 + 2 * 1024 * 8)  # top-2 SwiGLU + router
    assert cm.beta1 == pytest.approx(GEMM_FWD_BWD_FACTOR * (f["attention_linear"] + f["mlp"] + f["lm_head"])
                                     / 2 / 0.5e15 + 8 * 4096 / 2 / 1e12)
    assert cm.moe_dispatch_s_per_token == pytest.approx(4096 / 10e9 + 8192 / 100e9)
    assert cm.moe_dispatch_s == pytest.approx(8e-5)
    assert (cm.moe_a2a_bytes_per_token, cm.moe_tp_bytes_per_token) == pytest.approx((7168.0, 8192.0))
    assert cm.expert_parallel_size == 8
    assert CostModel.from_dict(cm.to_dict()) == cm


def bare(**changes) -> CostModel:
    values = dict(num_layers=2, alpha1=0.0, beta1=0.0, gamma=0.0, alpha2=1.0, d2h_bandwidth=1e30,
                  h2d_bandwidth=1e30, kv_bytes_per_token=1e-12, p2p_bandwidth_intra=1e30,
                  p2p_bandwidth_inter=1e30)
    values.update(changes)
    return CostModel(**values)


def test_ring_formula_charges_the_dispatch_on_each_members_share():
    cm = bare(moe_dispatch_s_per_token=1e-6, moe_dispatch_s=1e-3, moe_a2a_bytes_per_token=10.0)
    # ring of 4: 800 and 1600 tokens pad to themselves (multiples of 8); a member holds 600
    assert cm.micro_batch_time([800, 1600], 4, layers=3) == pytest.approx(3 * (1e-6 * 600 + 1e-3))
    assert cm.micro_batch_time([500], 1, layers=2) == pytest.approx(2 * (1e-6 * 500 + 1e-3))
    terms = cm.ring_time_terms(np.array([1000.0, 4000.0]), np.array([1e6, 1e7]), np.array([1, 2]), layers=2)
    assert np.asarray(terms.exposed_comm).tolist() == pytest.approx([2 * (1e-3 + 1e-3), 2 * (2e-3 + 1e-3)])
    assert np.asarray(terms.comm).tolist() == pytest.approx([4e-3, 6e-3])
    assert np.asarray(terms.compute).tolist() == [0.0, 0.0]
    assert cm.moe_a2a_bytes([800, 1600], 4, layers=3) == 3 * 10 * 2400
    assert bare().micro_batch_time([800, 1600], 4, layers=3) == pytest.approx(0.0, abs=1e-15)


def test_mistral_presets_by_hand_and_ep_costs_time():
    cm = preset_cost_model("mistral-8x7b", "paper-fit")
    copy = 2 * 4096 * 2
    assert cm.moe_dispatch_s_per_token == pytest.approx(4 * copy * 3 / 4 / 360e9)  # TP 4, EP 1
    ep8 = preset_cost_model("mistral-8x7b", "paper-fit", expert_parallel_size=8)
    assert ep8.name == "mistral-8x7b-tp4-ep8@paper-fit"
    # TP 4: 2 HDP ranks a node; EP 8: 1 peer on the node, 6 across at 57 GB/s
    assert ep8.moe_dispatch_s_per_token == pytest.approx(4 * copy * 6 / 8 / 4 / 57e9 + 4 * copy * 3 / 4 / 360e9)
    assert ep8.beta1 == cm.beta1 and ep8.alpha1 == cm.alpha1
    lengths = [8192, 30000, 4096]
    assert ep8.micro_batch_time(lengths, 4, layers=8) > cm.micro_batch_time(lengths, 4, layers=8)
    assert preset_cost_model("llama-7b", "h100").moe_dispatch_s_per_token == 0.0


def test_bad_expert_parallel_sizes_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"expert_parallel_size \(3\) must divide num_experts \(8\); choose one of \[1, 2, 4, 8\]"):
        moe(expert_parallel_size=3)
    with pytest.raises(ValueError, match="must divide num_experts"):
        moe(num_experts=1, moe_router_topk=1, expert_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size"):
        bare(expert_parallel_size=0)
    with pytest.raises(ValueError, match="memory_bandwidth"):
        replace(H100, memory_bandwidth=0.0)
    assert PAPER_FIT.memory_bandwidth == H100.memory_bandwidth == 3.35e12


def test_cli_ep_size(capsys):
    from megatron_bytescale.tools.simulate_cmd import main

    base = ["--global-tokens", "300000", "--hdp-size", "16", "--context-length", "65536", "--variants", "static", "--quiet",
            "--model", "mistral-8x7b"]
    assert main(base + ["--expert-model-parallel-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "mistral-8x7b-tp4-ep8" in out and "all-to-all over expert-parallel groups of 8" in out
    assert main(base + ["--hdp-size", "24", "--ep-size", "3"]) == 2
    assert "must divide num_experts (8)" in capsys.readouterr().err
    assert main(["--global-tokens", "300000", "--hdp-size", "12", "--quiet", "--model", "mistral-8x7b",
                 "--ep-size", "8"]) == 2
    assert "must divide --hdp-size (12)" in capsys.readouterr().err
    assert main(["--global-tokens", "300000", "--hdp-size", "16", "--quiet", "--ep-size", "2"]) == 2
    assert "llama-7b is dense" in capsys.readouterr().err


def test_expert_gradients_reduce_over_the_expert_data_parallel_group_by_hand():
    from megatron_bytescale.sim.overheads import StepOverheads, params_per_rank, parameter_count, preset_overheads

    cm = bare(p2p_bandwidth_inter=1e9, p2p_latency_s=0.0)
    o = StepOverheads(params_per_rank=1000.0, expert_params_per_rank=600.0, expert_parallel_size=4,
                      optimizer_s_per_param=1.0)
    # ZeRO-1 (4-byte grads + 2-byte params): dense 400 over 16 ranks, experts 600 over 16 / 4 = 4 ranks
    assert o.grad_reduce_s(16, cm, one_node=False) == pytest.approx(
        (15 / 16 * 400 * 6 + 3 / 4 * 600 * 6) / 1e9)
    assert o.optimizer_s(16) == pytest.approx(400 / 16 + 600 / 4)
    flat = StepOverheads(params_per_rank=1000.0, optimizer_s_per_param=1.0)
    assert flat.grad_reduce_s(16, cm, one_node=False) == pytest.approx(15 / 16 * 1000 * 6 / 1e9)
    with pytest.raises(ValueError, match="expert_params_per_rank"):
        StepOverheads(params_per_rank=1.0, expert_params_per_rank=2.0)
    spec = moe(tensor_parallel_size=2, expert_parallel_size=4)
    counts = parameter_count(spec)
    assert counts["experts_per_layer"] == 8 * 3 * 1024 * 2048
    dense_layer = counts["per_layer"] - counts["experts_per_layer"]
    assert params_per_rank(spec, tensor_parallel_size=2, pp_size=2) == pytest.approx(
        ((dense_layer + 2 * 3 * 1024 * 2048) * 2 + 1000 * 1024) / 2)  # 2 of the 8 experts per rank
    po = preset_overheads(spec, tensor_parallel_size=2, pp_size=2)
    assert (po.expert_params_per_rank, po.expert_parallel_size) == (2 * 3 * 1024 * 2048 * 2 / 2, 4)
    assert preset_overheads(moe(), tensor_parallel_size=1, pp_size=1).expert_params_per_rank == 0.0
