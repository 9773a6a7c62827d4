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


# --------------------------------------------------------------------------- expert-tensor parallelism
def _dispatch_before_etp(model, hardware):
    """The dispatch terms as computed before ETP was modelled (expert TP = TP), frozen here so
    that the ETP = TP numbers are checked bit for bit against them."""
    ep, tp = model.expert_parallel_size, model.tensor_parallel_size
    copy = model.moe_router_topk * model.hidden_size * model.dtype_bytes
    on_node = min(ep, max(1, hardware.gpus_per_node // tp))
    a2a_intra = 4 * copy * (on_node - 1) / ep / tp
    a2a_inter = 4 * copy * (ep - on_node) / ep / tp
    tp_bytes = 4 * copy * (tp - 1) / tp
    a2a_s = max(a2a_intra / hardware.p2p_bandwidth_intra, a2a_inter / hardware.p2p_bandwidth_inter)
    permute = 8.0 * copy / tp
    return (a2a_intra + a2a_inter, a2a_intra, a2a_inter, tp_bytes, permute,
            a2a_s + tp_bytes / hardware.p2p_bandwidth_intra, 4 * ((ep > 1) + (tp > 1)) * hardware.p2p_latency_s,
            permute / hardware.memory_bandwidth)


@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_etp_equal_to_tp_gives_the_numbers_from_before(tp, ep, gpus_per_node):
    hw = replace(HW, gpus_per_node=gpus_per_node)
    default, explicit = moe(tensor_parallel_size=tp, expert_parallel_size=ep), \
        moe(tensor_parallel_size=tp, expert_parallel_size=ep, expert_tensor_parallel_size=tp)
    before = _dispatch_before_etp(default, hw)
    for spec in (default, explicit):
        d = moe_dispatch(spec, hw)
        assert (d.a2a_bytes_per_token, d.a2a_intra_bytes_per_token, d.a2a_inter_bytes_per_token,
                d.tp_bytes_per_token, d.permute_bytes_per_token, d.seconds_per_token, d.seconds,
                d.permute_s_per_token) == before  # exactly, not approximately
        assert spec.expert_lockstep_size == ep
        cm = analytic_cost_model(spec, hw)
        assert (cm.expert_lockstep_size, cm.plan_ep_size) == (None, ep)
    assert analytic_cost_model(explicit, hw) == analytic_cost_model(default, hw)


def test_dispatch_tp2_etp1_ep2_by_hand():
    # the expert group is one HDP rank's TP group: 1 all-to-all peer 1 GPU away, no expert-TP gather
    spec = moe(tensor_parallel_size=2, expert_tensor_parallel_size=1, expert_parallel_size=2)
    d = moe_dispatch(spec, HW)
    assert (d.a2a_intra_bytes_per_token, d.a2a_inter_bytes_per_token) == (4 * 4096 * 1 / 2 / 2, 0.0)  # 4096
    assert d.tp_bytes_per_token == 0.0
    assert d.seconds_per_token == 4096 / 100e9
    assert d.seconds == pytest.approx(4 * 1e-5)  # the all-to-alls only
    assert d.permute_bytes_per_token == 8 * 4096 / 2  # the rank's own s / TP tokens
    assert spec.expert_lockstep_size == 1  # inside one TP group: no slot rule
    cm = analytic_cost_model(spec, HW)
    assert (cm.expert_parallel_size, cm.expert_lockstep_size, cm.plan_ep_size) == (2, 1, 1)
    assert cm.moe_tp_bytes_per_token == 0.0 and cm.moe_a2a_bytes_per_token == 4096


def test_dispatch_tp1_etp2_ep2_by_hand():
    # members 2 GPUs apart (4 a node): 1 peer on the node; each expert over 2 GPUs: 1 gather peer
    spec = moe(tensor_parallel_size=1, expert_tensor_parallel_size=2, expert_parallel_size=2)
    d = moe_dispatch(spec, HW)
    assert (d.a2a_intra_bytes_per_token, d.a2a_inter_bytes_per_token) == (4 * 4096 * 1 / 2, 0.0)  # 8192
    assert d.tp_bytes_per_token == 4 * 4096 * 1 / 1  # (ETP - 1) / TP of the share: 16384
    assert d.seconds_per_token == pytest.approx((8192 + 16384) / 100e9)
    assert d.seconds == pytest.approx(8 * 1e-5)  # 4 all-to-alls + 4 expert-TP collectives
    assert d.permute_bytes_per_token == 8 * 4096
    assert spec.expert_lockstep_size == 4  # 2 x 2 GPUs = 4 HDP ranks of TP 1
    assert analytic_cost_model(spec, HW).plan_ep_size == 4


def test_dispatch_tp4_etp2_by_hand_intra_and_inter_node():
    # EP 4 x ETP 2 = 8 GPUs, one node: all 3 peers on NVLink (with ETP = TP = 4: 1 on the node, 2 off)
    d = moe_dispatch(moe(tensor_parallel_size=4, expert_tensor_parallel_size=2, expert_parallel_size=4), HW)
    assert (d.a2a_intra_bytes_per_token, d.a2a_inter_bytes_per_token) == (4 * 4096 * 3 / 4 / 4, 0.0)  # 3072
    assert d.tp_bytes_per_token == 4 * 4096 * 1 / 4  # 4096
    assert d.seconds_per_token == pytest.approx((3072 + 4096) / 100e9)
    same_tp = moe_dispatch(moe(tensor_parallel_size=4, expert_parallel_size=4), HW)
    assert (same_tp.a2a_intra_bytes_per_token, same_tp.a2a_inter_bytes_per_token) == (1024, 2048)
    assert same_tp.tp_bytes_per_token == 4 * 4096 * 3 / 4
    # EP 8 x ETP 2 = 16 GPUs: 4 members a node, 3 peers on it and 4 on the other node
    spec = moe(tensor_parallel_size=4, expert_tensor_parallel_size=2, expert_parallel_size=8)
    d = moe_dispatch(spec, HW)
    assert (d.a2a_intra_bytes_per_token, d.a2a_inter_bytes_per_token) == (4 * 4096 * 3 / 8 / 4, 4 * 4096 * 4 / 8 / 4)
    assert d.seconds_per_token == pytest.approx(max(1536 / 100e9, 2048 / 10e9) + 4096 / 100e9)
    assert d.permute_bytes_per_token == 8 * 4096 / 4
    assert (spec.expert_lockstep_size, analytic_cost_model(spec, HW).plan_ep_size) == (4, 4)
    assert moe(tensor_parallel_size=4, expert_tensor_parallel_size=2, expert_parallel_size=4).expert_lockstep_size == 2


def test_expert_tp_wider_than_a_node_gathers_over_the_network():
    d = moe_dispatch(moe(expert_tensor_parallel_size=4), replace(HW, gpus_per_node=2))  # TP 1, EP 1
    assert d.tp_bytes_per_token == 4 * 4096 * 3
    assert d.seconds_per_token == pytest.approx(4 * 4096 * 3 / 10e9)
    assert moe_dispatch(moe(expert_tensor_parallel_size=2), replace(HW, gpus_per_node=2)).seconds_per_token \
        == pytest.approx(4 * 4096 / 100e9)


def test_bad_expert_tensor_parallel_sizes_are_refused_by_name():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"expert_tensor_parallel_size \({bad!r}\) must be an integer >= 1"):
            moe(expert_tensor_parallel_size=bad)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(3\) x expert_parallel_size \(1\) = 3 and "
                                         r"tensor_parallel_size \(2\) do not divide one another.*choose sizes"):
        moe(tensor_parallel_size=2, expert_tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(1\) x expert_parallel_size \(3\) = 3 and "
                                         r"tensor_parallel_size \(4\) do not divide one another"):
        moe(num_experts=6, tensor_parallel_size=4, expert_tensor_parallel_size=1, expert_parallel_size=3)
    assert moe(tensor_parallel_size=4, expert_tensor_parallel_size=1, expert_parallel_size=2).expert_lockstep_size == 1
    with pytest.raises(ValueError, match=r"dense \(num_experts 1\): expert_tensor_parallel_size \(1\)"):
        moe(num_experts=1, moe_router_topk=1, tensor_parallel_size=2, expert_tensor_parallel_size=1)
    moe(num_experts=1, moe_router_topk=1, tensor_parallel_size=2, expert_tensor_parallel_size=2)  # = TP: fine
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(0\) must be an integer >= 1"):
        moe_dispatch(moe(), HW, expert_tensor_parallel_size=0)
    with pytest.raises(ValueError, match="do not divide one another"):
        moe_dispatch(moe(tensor_parallel_size=2), HW, expert_tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_lockstep_size \(0\) must be an integer >= 1"):
        bare(expert_lockstep_size=0)
    with pytest.raises(ValueError, match=r"expert_lockstep_size \(True\)"):
        bare(expert_lockstep_size=True)


def test_lockstep_size_round_trips_and_old_files_load(tmp_path):
    cm = preset_cost_model("mistral-8x7b", "h100", expert_parallel_size=2, expert_tensor_parallel_size=2)
    assert cm.name == "mistral-8x7b-tp4-ep2-etp2@h100"  # TP 4 x ETP 2 x EP 2: one HDP rank
    assert (cm.expert_lockstep_size, cm.plan_ep_size) == (1, 1)
    cm8 = preset_cost_model("mistral-8x7b", "h100", expert_parallel_size=8, expert_tensor_parallel_size=2)
    assert (cm8.expert_lockstep_size, cm8.plan_ep_size) == (4, 4)
    cm8.save(tmp_path / "cm.json")
    assert CostModel.load(tmp_path / "cm.json") == cm8
    old = {k: v for k, v in cm8.to_dict().items() if k != "expert_lockstep_size"}  # written before ETP
    assert CostModel.from_dict(old).plan_ep_size == 8


def test_expert_gradients_with_expert_tensor_parallelism_by_hand():
    from megatron_bytescale.sim.overheads import StepOverheads, params_per_rank, parameter_count, preset_overheads

    cm = bare(p2p_bandwidth_inter=1e9, p2p_latency_s=0.0)

    def zero1(dense_n, experts_n):  # ZeRO-1 bytes (4 + 2) of 400 dense and 600 expert parameters
        return (((dense_n - 1) / dense_n * 400 + (experts_n - 1) / experts_n * 600) * 6) / 1e9

    def overheads(tp, etp, ep):
        return StepOverheads(params_per_rank=1000.0, expert_params_per_rank=600.0, expert_parallel_size=ep,
                             tensor_parallel_size=tp, expert_tensor_parallel_size=etp, optimizer_s_per_param=1.0)

    # expert-data-parallel group: N x TP GPUs of a stage over the ETP x E of an expert group
    o = overheads(1, 2, 2)  # TP 1 x ETP 2 x EP 2 on 16 HDP ranks: 16 / 4 = 4
    assert o.expert_data_parallel_size(16) == 4
    assert o.grad_reduce_s(16, cm, one_node=False) == pytest.approx(zero1(16, 4))
    assert o.optimizer_s(16) == pytest.approx(400 / 16 + 600 / 4)
    o = overheads(4, 2, 4)  # TP 4 x ETP 2 x EP 4 on 8: 32 GPUs / 8 = 4
    assert o.expert_data_parallel_size(8) == 4
    assert o.grad_reduce_s(8, cm, one_node=False) == pytest.approx(zero1(8, 4))
    o = overheads(4, 1, 2)  # TP 4 x ETP 1 x EP 2 on 8: the group inside a TP group, 32 / 2 = 16
    assert o.expert_data_parallel_size(8) == 16
    assert o.grad_reduce_s(8, cm, one_node=False) == pytest.approx(zero1(8, 16))
    o = overheads(2, 1, 2)  # TP 2 x ETP 1 x EP 2 on 8: 16 / 2 = 8 = N, one reduction as for dense
    assert o.expert_data_parallel_size(8) == 8
    assert o.grad_reduce_s(8, cm, one_node=False) == pytest.approx(7 / 8 * 1000 * 6 / 1e9)
    for tp, ep in ((1, 4), (4, 4), (8, 2)):  # ETP = TP (or None): N / E as before, exactly
        same, default = overheads(tp, tp, ep), overheads(tp, None, ep)
        before = StepOverheads(params_per_rank=1000.0, expert_params_per_rank=600.0, expert_parallel_size=ep,
                               optimizer_s_per_param=1.0)
        assert same.grad_reduce_s(16, cm) == default.grad_reduce_s(16, cm) == before.grad_reduce_s(16, cm)
        assert same.optimizer_s(16) == before.optimizer_s(16)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size \(0\) must be an integer >= 1"):
        overheads(1, 0, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(True\) must be an integer >= 1"):
        overheads(True, None, 2)

    # per GPU: 1 / E of the experts, each over ETP GPUs; the rest over TP
    counts = parameter_count(moe())
    dense_layer = counts["per_layer"] - counts["experts_per_layer"]
    expert = 3 * 1024 * 2048
    spec = moe(tensor_parallel_size=2, expert_tensor_parallel_size=1, expert_parallel_size=2)
    assert params_per_rank(spec, tensor_parallel_size=2, pp_size=1) == pytest.approx(
        (dense_layer * 4 + 2 * 1000 * 1024) / 2 + 4 * expert * 4 / 1)  # 4 of the 8 experts, whole
    po = preset_overheads(spec, tensor_parallel_size=2, pp_size=1)
    assert (po.expert_params_per_rank, po.expert_tensor_parallel_size, po.tensor_parallel_size) == (
        4 * expert * 4, 1, 2)
    spec = moe(tensor_parallel_size=1, expert_tensor_parallel_size=2, expert_parallel_size=2)
    assert params_per_rank(spec, tensor_parallel_size=1, pp_size=1) == pytest.approx(
        dense_layer * 4 + 2 * 1000 * 1024 + 4 * expert * 4 / 2)  # 4 experts, half of each
    spec = moe(tensor_parallel_size=4, expert_tensor_parallel_size=1)  # EP 1: every expert, whole
    po = preset_overheads(spec, tensor_parallel_size=4, pp_size=2)
    assert po.expert_params_per_rank == 8 * expert * 2 and po.expert_data_parallel_size(4) == 16
    o = overheads(4, 1, 1)  # EP 1, ETP 1 under TP 4 on 4 HDP ranks: experts over 16 GPUs, not 4
    assert o.grad_reduce_s(4, cm, one_node=False) == pytest.approx(zero1(4, 16))
    spec = moe(tensor_parallel_size=2, expert_parallel_size=4)  # ETP = TP: bit for bit as before
    assert params_per_rank(spec, tensor_parallel_size=2, pp_size=2) == (
        (dense_layer + 2 * expert) * 2 + 1000 * 1024) / 2


def test_paper_setup_takes_the_expert_tensor_parallel_size():
    from megatron_bytescale.sim.paper import paper_setup

    setup = paper_setup("mistral-8x7b", expert_parallel_size=8, expert_tensor_parallel_size=2)
    assert setup.cost_model.name == "mistral-8x7b-tp4-ep8-etp2@paper-fit" and setup.cost_model.plan_ep_size == 4
    o = setup.overheads
    assert (o.tensor_parallel_size, o.expert_tensor_parallel_size, o.expert_parallel_size) == (4, 2, 8)
    same = paper_setup("mistral-8x7b", expert_parallel_size=8, expert_tensor_parallel_size=4)
    assert same == paper_setup("mistral-8x7b", expert_parallel_size=8)  # ETP = TP: as before


@pytest.mark.parametrize("tp, etp", [(1, None), (2, None), (2, 1), (4, 2), (1, 2)])
def test_saved_activations_keep_the_expert_tp_groups_gathered_input_by_hand(tp, etp):
    """The experts' input is gathered over the expert-TP group before the first expert GEMM and
    saved whole (``ETP k s / TP`` rows of width h on each GPU): ``ETP k h`` elements per token
    before the TP split. The rest is the dense layer's count with the MLP outputs per routed
    copy: norms and their inputs 4h, attention output and output-projection input 2h, K and V,
    the gate / up / SwiGLU outputs 3 f k, and the fp32 log-sum-exp per head."""
    spec = moe(tensor_parallel_size=tp, expert_tensor_parallel_size=etp)
    kv = 2 * 8 * (1024 / 8)  # K and V: 8 groups of head_dim 128
    elements = 6 * 1024 + kv + 3 * 2048 * 2 + (etp or tp) * 2 * 1024
    assert analytic_cost_model(spec, HW).alpha2 == pytest.approx((2 * elements + 4 * 8) / tp)
    dense = moe(num_experts=1, moe_router_topk=1, tensor_parallel_size=tp)
    assert analytic_cost_model(dense, HW).alpha2 == pytest.approx(
        (2 * (6 * 1024 + kv + 3 * 2048) + 4 * 8) / tp)
