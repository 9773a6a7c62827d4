"""Configurations HDP cannot serve are refused with messages that name the flag (no processes)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_bytescale.integration.groups import HDPParallelLayout
from megatron_bytescale.testing import cpu_compat


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(context_parallel_size=2), "--context-parallel-size 2"),
        (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
        (dict(virtual_pipeline_model_parallel_size=2), "interleaved pipeline stages"),
        (dict(expert_model_parallel_size=3), "--expert-model-parallel-size 3 does not divide the "
                                             "8 HDP ranks"),
        (dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2,
              virtual_pipeline_model_parallel_size=2),
         re.escape("expert groups of 2 HDP ranks (--expert-tensor-parallel-size 1 x "
                   "--expert-model-parallel-size 2 / --tensor-model-parallel-size 1 = 2) with "
                   "--virtual-pipeline-model-parallel-size 2")),
        (dict(tensor_model_parallel_size=3), "not divisible by TP x PP = 3"),
        (dict(tensor_model_parallel_size=4, num_attention_heads=6),
         "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
        (dict(tensor_model_parallel_size=4, num_attention_heads=8, num_query_groups=2),
         "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    ],
)
def test_layout_refuses_unsupported_parallelism(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        HDPParallelLayout(world_size=8, **kwargs)
    assert not re.search(r"later issue|not yet|\byet\b|issue \d", str(info.value))


@pytest.mark.parametrize("tp, etp, ep, block", [
    (2, 1, 2, 1), (4, 1, 4, 1), (4, 2, 2, 1), (2, None, 1, 1),  # inside one TP group
    (2, None, 2, 2), (2, 1, 4, 2), (1, 2, 2, 4), (1, None, 2, 2),
])
def test_interleaved_stages_with_experts_are_refused_by_the_expert_block(tp, etp, ep, block):
    """Interleaved stages keep no slot rule across HDP ranks, so the layout refuses them exactly
    when an expert group spans several HDP ranks (``ETP x EP / TP`` > 1), naming the flags that
    make the block; an expert group inside one TP group (TP 2 x ETP 1 x EP 2, whose EP size is
    2) passes, as at EP 1."""
    kwargs = dict(world_size=16, tensor_model_parallel_size=tp, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=2, expert_tensor_parallel_size=etp,
                  expert_model_parallel_size=ep)
    if block == 1:
        assert HDPParallelLayout(**kwargs).hdp_size == 8 // tp
        return
    with pytest.raises(ValueError) as info:
        HDPParallelLayout(**kwargs)
    assert list(info.value.reasons) == [
        f"expert groups of {block} HDP ranks (--expert-tensor-parallel-size {etp or tp} x "
        f"--expert-model-parallel-size {ep} / --tensor-model-parallel-size {tp} = {block}) with "
        "--virtual-pipeline-model-parallel-size 2 cannot be combined with --bytescale-hdp: the "
        "interleaved driver keeps no slot rule across the HDP ranks of an expert group; run "
        "without virtual stages, or with sizes whose expert group lies inside one TP group "
        "(ETP x EP <= TP, e.g. --expert-model-parallel-size 1)"]
    # without virtual stages the same sizes train
    HDPParallelLayout(**{**kwargs, "virtual_pipeline_model_parallel_size": None})


def test_layout_reports_every_refusal_at_once():
    with pytest.raises(ValueError) as info:
        # CP is refused, EP 3 does not divide the 8 HDP ranks, virtual stages need PP > 1
        HDPParallelLayout(world_size=8, context_parallel_size=2, expert_model_parallel_size=3,
                          virtual_pipeline_model_parallel_size=2)
    assert len(info.value.reasons) == 3
    assert "cannot run with these 3 arguments" in str(info.value)


def test_layout_serves_expert_parallelism_that_divides_the_hdp_ranks():
    assert HDPParallelLayout(world_size=8, expert_model_parallel_size=8).hdp_size == 8
    assert HDPParallelLayout(world_size=8, tensor_model_parallel_size=2,
                             expert_model_parallel_size=2).hdp_size == 4
    # with pipeline stages: expert groups of the pipelines at one stage (Mixtral's PP 4 x EP 8)
    assert HDPParallelLayout(world_size=32, pipeline_model_parallel_size=4,
                             expert_model_parallel_size=8).hdp_size == 8


def test_layout_serves_tensor_and_pipeline_parallelism():
    layout = HDPParallelLayout(world_size=8, tensor_model_parallel_size=2, num_attention_heads=8,
                               num_query_groups=2)
    assert layout.hdp_size == 4
    assert HDPParallelLayout(world_size=8, tensor_model_parallel_size=2,
                             pipeline_model_parallel_size=2).hdp_size == 2
    assert HDPParallelLayout(world_size=8, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2).hdp_size == 4


def test_layout_from_megatron_args():
    class Args:
        world_size = 8
        tensor_model_parallel_size = 1
        pipeline_model_parallel_size = 1
        context_parallel_size = 4
        hybrid_context_parallel = False

    with pytest.raises(ValueError, match="HDP replaces Megatron's static context parallelism"):
        HDPParallelLayout.from_megatron_args(Args())
    Args.context_parallel_size = 1
    assert HDPParallelLayout.from_megatron_args(Args()).hdp_size == 8


def test_cpu_compat_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(cpu_compat.CpuCompatError, match="CUDA is available"):
        cpu_compat.enable_cpu_megatron()
    assert not cpu_compat.cpu_megatron_enabled()


def _cost_model():
    from .hdp_cases import cost_model

    return cost_model()


def test_capacity_too_small_for_the_context_is_refused():
    from megatron_bytescale.integration.config import ByteScaleConfig
    from megatron_bytescale.integration.planning import make_step_planner

    config = ByteScaleConfig(hdp=True, capacity=64, context_length=1024)
    with pytest.raises(ValueError, match="--bytescale-capacity 64 is too small"):
        make_step_planner(config, hdp_size=4, cost_model=_cost_model())


def test_sequence_longer_than_all_ranks_hold_is_refused_by_the_planner():
    from megatron_bytescale.integration.config import ByteScaleConfig
    from megatron_bytescale.integration.planning import make_step_planner

    plan = make_step_planner(
        ByteScaleConfig(hdp=True, capacity=64), hdp_size=4, cost_model=_cost_model()
    )
    assert plan([100, 30]).hdp_size == 4
    with pytest.raises(ValueError, match="sequence 1 has 300 tokens"):
        plan([100, 300])


@pytest.mark.parametrize("changes, flag", [
    (dict(moe_expert_capacity_factor=1.25), "--moe-expert-capacity-factor 1.25"),
    (dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01),
     "--moe-router-load-balancing-type seq_aux_loss"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type sinkhorn"),
    (dict(moe_input_jitter_eps=0.01), "--moe-input-jitter-eps 0.01"),
    (dict(add_bias_linear=True), "--disable-bias-linear"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=3),
     "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 = 3 and "
     "--tensor-model-parallel-size 2 do not divide one another"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
          pipeline_dtype=torch.float32, expert_tensor_parallel_size=1,
          expert_model_parallel_size=3),
     "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 3"),
])
def test_moe_settings_without_a_placement_independent_meaning_are_refused(changes, flag):
    """The model builder refuses them before building, naming the flag (docs/moe.md)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bytescale.integration.moe import check_moe_config

    settings = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                    moe_router_topk=2, add_bias_linear=False, calculate_per_token_loss=True)
    check_moe_config(TransformerConfig(**settings))  # the plain MoE settings pass
    with pytest.raises(ValueError, match=re.escape(flag)) as info:
        check_moe_config(TransformerConfig(**{**settings, **changes}))
    assert not re.search(r"later issue|not yet|\byet\b|issue \d", str(info.value))


@pytest.mark.parametrize("layout", [
    dict(tensor_model_parallel_size=2, sequence_parallel=True),
    dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
    dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
         pipeline_dtype=torch.float32),
    dict(tensor_model_parallel_size=4, sequence_parallel=True, pipeline_model_parallel_size=4,
         pipeline_dtype=torch.float32, expert_model_parallel_size=8,
         moe_token_dispatcher_type="alltoall"),
    dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1,
         expert_model_parallel_size=4, moe_token_dispatcher_type="alltoall"),
    dict(expert_tensor_parallel_size=2, expert_model_parallel_size=2,
         moe_token_dispatcher_type="alltoall"),
])
def test_moe_trains_with_tensor_and_pipeline_parallelism(layout):
    """TP, PP and TP x PP (the Mistral presets' TP 4 x PP 4, here with EP 8), and expert-tensor
    parallelism other than TP where ETP x EP and TP divide one another, pass the model
    builder's MoE checks (the gradients: tests/integration/test_moe_parallel_training.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bytescale.integration.moe import moe_refusals

    settings = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                    moe_router_topk=2, add_bias_linear=False, calculate_per_token_loss=True)
    assert moe_refusals(TransformerConfig(**settings, **layout)) == []


def test_expert_parallel_drivers_refuse_what_they_cannot_keep_in_step():
    """The drivers refuse, before anything runs, interleaved stages with expert groups over
    several HDP ranks (a list of model chunks) and a plan with split ring micro-batches there:
    both would let the pipelines of an expert group run their all-to-alls in different orders.
    The rule is the lockstep block (``manager.ep_size``, ``ETP x EP / TP``), named with the
    flags that make it."""
    from types import SimpleNamespace

    from megatron_bytescale.integration.pipeline_schedule import pipeline_slots
    from megatron_bytescale.integration.schedule import run_micro_batches

    # TP 2 x ETP 1 x EP 4: expert groups of 2 HDP ranks
    manager = SimpleNamespace(ep_size=2, tp_size=2, expert_model_parallel_size=4)
    words = ("expert groups of 2 HDP ranks (--expert-tensor-parallel-size 1 x "
             "--expert-model-parallel-size 4 / --tensor-model-parallel-size 2 = 2)")
    with pytest.raises(ValueError, match=re.escape(words) + " do not run with interleaved "
                                         "pipeline stages"):
        run_micro_batches(None, model=[torch.nn.Linear(1, 1)] * 2, config=None, manager=manager)
    chunk = SimpleNamespace(order=3, chunk=(0, 2))
    plan = SimpleNamespace(ep_size=2, ranks=[SimpleNamespace(micro_batches=[chunk])] * 2)
    step = SimpleNamespace(plan=plan, hdp_rank=0, index=7, micro_batches=[chunk],
                           num_micro_batches=1)
    with pytest.raises(ValueError, match=r"step 7: the plan splits ring micro-batches \(orders "
                                         r"\[3\]\) into chunks, which " + re.escape(words)):
        pipeline_slots(step, manager)
    assert pipeline_slots(SimpleNamespace(**{**vars(step), "micro_batches": []}), manager) == 1
    # a manager without the sizes (or a block its sizes do not explain) names the flags only
    bare = SimpleNamespace(ep_size=2)
    with pytest.raises(ValueError, match=re.escape(
            "expert groups of 2 HDP ranks (--expert-tensor-parallel-size x "
            "--expert-model-parallel-size / --tensor-model-parallel-size = 2) do not run")):
        run_micro_batches(None, model=[torch.nn.Linear(1, 1)] * 2, config=None, manager=bare)


def test_expert_groups_inside_one_tp_group_pass_the_drivers_expert_checks():
    """TP 2 x ETP 1 x EP 2: Megatron's EP size is 2 but the expert group is one HDP rank's TP
    pair (block 1), whose ranks always run the same micro-batches and chunks, so neither the
    interleaved driver nor a split plan is refused for experts (the interleaved driver goes on
    to its next check, here --overlap-grad-reduce)."""
    from types import SimpleNamespace

    from megatron_bytescale.integration.pipeline_schedule import pipeline_slots
    from megatron_bytescale.integration.schedule import run_micro_batches

    manager = SimpleNamespace(ep_size=1, tp_size=2, expert_model_parallel_size=2)
    chunk = torch.nn.Linear(1, 1)
    chunk.ddp_config = SimpleNamespace(overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="^--overlap-grad-reduce does not run with interleaved"):
        run_micro_batches(None, model=[chunk, chunk], config=None, manager=manager)
    split = SimpleNamespace(order=3, chunk=(0, 2))
    plan = SimpleNamespace(ep_size=1, ranks=[SimpleNamespace(micro_batches=[split])])
    step = SimpleNamespace(plan=plan, hdp_rank=0, index=7, micro_batches=[split],
                           num_micro_batches=1)
    assert pipeline_slots(step, manager) == 1
