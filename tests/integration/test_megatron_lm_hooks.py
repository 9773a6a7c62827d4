"""The Megatron-LM hooks (``integration/megatron_lm*.py``) on CPU.

In CI ``megatron.training`` is absent (the megatron-core wheel does not ship it), so the hooks
are driven with an argparse namespace that carries Megatron's own defaults for every attribute
they read (:func:`megatron_namespace`) plus our flags parsed by the hook's provider. One 4-rank
gloo spawn runs the model builder, the data iterators on an indexed dataset written here with
megatron-core's ``IndexedDatasetBuilder``, and HDP steps through ``hdp_forward_backward``
exactly as Megatron's ``train_step`` drives it; losses and gradients are compared with ONE
process running megatron's own local GPT on every sequence alone (``hdp_cases``), fp32,
relative error <= 1e-5.

The patch itself, against a Megatron-LM checkout, is tested in ``test_megatron_lm_patch.py``.
"""

from __future__ import annotations

import argparse
import itertools
import re
from typing import Any

import numpy as np
import pytest
import torch

from megatron_bytescale.integration import megatron_lm
from megatron_bytescale.integration.megatron_lm_data import (
    budget_batches,
    indexed_document_source,
    mock_document_source,
    split_bounds,
)
from megatron_bytescale.integration.step_metrics import METRIC_NAMES
from megatron_bytescale.testing.distributed import run_distributed

from .megatron_lm_cases import TOLERANCE, random_documents, write_indexed_dataset

WORLD = 4
SEQ = 256  # --seq-length: the context; hdp_cases' model has max_sequence_length 256
CAPACITY = 64  # so a context-length document needs a ring of all 4 ranks
GLOBAL_BATCH = 4  # x SEQ = 1024 tokens per global batch

# Megatron-LM core_v0.16.1 defaults (arguments.py, after validate_args) of the attributes the
# hooks read; read off the checkout's parse_args.
MEGATRON_DEFAULTS: dict[str, Any] = dict(
    world_size=1, rank=0, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
    hybrid_context_parallel=False, expert_model_parallel_size=1, attention_dropout=0.1,
    hidden_dropout=0.1, transformer_impl="transformer_engine", cuda_graph_impl="none",
    normalization="LayerNorm", position_embedding_type="learned_absolute", rotary_percent=1.0,
    rotary_base=10000, use_rope_scaling=False, untie_embeddings_and_output_weights=False,
    fp16_lm_cross_entropy=False, qk_layernorm=False, qk_l2_norm=False, seed=1234,
    dataloader_type="single", calculate_per_token_loss=False, consumed_train_samples=0,
    consumed_valid_samples=0, split=None, data_path=None, mock_data=False,
    group_query_attention=False, num_query_groups=1, bf16=False, fp16=False,
    overlap_grad_reduce=False, ddp_average_in_collective=False, rampup_batch_size=None,
    num_experts=None, mtp_num_layers=None, multi_latent_attention=False, spec=None, sft=False,
    fim_data=False, use_legacy_models=False, check_for_nan_in_loss_and_grad=True,
    global_batch_size=GLOBAL_BATCH, micro_batch_size=1, seq_length=SEQ,
    max_position_embeddings=SEQ, num_layers=2, hidden_size=32, num_attention_heads=4,
    ffn_hidden_size=64, padded_vocab_size=256,
)


def megatron_namespace(*argv: str, **overrides: Any) -> argparse.Namespace:
    """Megatron-like ``args``: our flags parsed by the hook's provider + Megatron's defaults."""
    parser = megatron_lm.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args(list(argv))
    for name, value in {**MEGATRON_DEFAULTS, **overrides}.items():
        setattr(args, name, value)
    return args


def tiny_model_args(**overrides: Any) -> dict[str, Any]:
    """The flags of hdp_cases' tiny GPT (2 layers, hidden 32, GQA 4/2, ffn 64, RoPE)."""
    values = dict(world_size=WORLD, transformer_impl="local", attention_dropout=0.0,
                  hidden_dropout=0.0, position_embedding_type="rope",
                  group_query_attention=True, num_query_groups=2,
                  untie_embeddings_and_output_weights=True)
    values.update(overrides)
    return values


# ----------------------------------------------------------------------------- flags


def test_chained_provider_parses_ours_after_another():
    def other(parser):
        parser.add_argument("--modelopt-thing", type=int, default=0)
        return parser

    parser = megatron_lm.chain_extra_args_provider(other)(argparse.ArgumentParser())
    args = parser.parse_args(["--modelopt-thing", "3", "--bytescale-hdp", "--bytescale-capacity",
                              "128", "--bytescale-scheduler", "naive"])
    assert (args.modelopt_thing, args.bytescale_hdp, args.bytescale_capacity,
            args.bytescale_scheduler) == (3, True, 128, "naive")
    bare = megatron_lm.chain_extra_args_provider(None)(argparse.ArgumentParser())
    assert bare.parse_args([]).bytescale_hdp is False


def test_validate_sets_what_hdp_needs():
    args = megatron_namespace("--bytescale-hdp", "--bytescale-capacity", "64", mock_data=True,
                              **tiny_model_args())
    config = megatron_lm.validate_args(args)
    assert args.calculate_per_token_loss is True
    assert args.dataloader_type == "external"
    assert (config.capacity, args.bytescale_capacity) == (64, 64)
    assert args.bytescale_context_length == SEQ == config.context_length
    defaulted = megatron_namespace("--bytescale-hdp", mock_data=True, **tiny_model_args())
    megatron_lm.validate_args(defaulted)
    assert defaulted.bytescale_capacity == SEQ  # --seq-length / CP 1


@pytest.mark.parametrize(
    "argv, overrides, flag",
    [
        ((), dict(context_parallel_size=2), "--context-parallel-size 2"),
        ((), dict(pipeline_model_parallel_size=2, num_layers=4, num_layers_per_virtual_pipeline_stage=1,
                  overlap_p2p_comm=False), "--no-overlap-p2p-communication cannot be combined"),
        ((), dict(num_layers=4, num_layers_per_virtual_pipeline_stage=1),
         "with --pipeline-model-parallel-size 1"),
        ((), dict(pipeline_model_parallel_size=4, num_layers=8, num_layers_per_virtual_pipeline_stage=1,
                  overlap_grad_reduce=True), "--overlap-grad-reduce cannot be combined with interleaved"),
        (("--bytescale-offload",), dict(pipeline_model_parallel_size=4, num_layers=8,
                                        num_layers_per_virtual_pipeline_stage=1),
         "--bytescale-offload cannot be combined with interleaved"),
        ((), dict(tensor_model_parallel_size=4), "--num-query-groups 2 is not divisible by "
         "--tensor-model-parallel-size 4"),
        ((), dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1),
         "--decoder-first-pipeline-num-layers"),
        ((), dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
        ((), dict(attention_dropout=0.1), "--attention-dropout 0.1"),
        ((), dict(ddp_average_in_collective=True), "--ddp-average-in-collective"),
        ((), dict(num_experts=8, moe_expert_capacity_factor=1.0),
         "--moe-expert-capacity-factor 1.0"),
        ((), dict(num_experts=8, moe_router_load_balancing_type=["seq_aux_loss"]),
         "--moe-router-load-balancing-type seq_aux_loss"),
        ((), dict(num_experts=8, moe_router_load_balancing_type="global_aux_loss"),
         "--moe-router-load-balancing-type global_aux_loss"),
        ((), dict(num_experts=8, moe_router_enable_expert_bias=True),
         "--moe-router-enable-expert-bias"),
        ((), dict(num_experts=8, tensor_model_parallel_size=2, sequence_parallel=True,
                  pipeline_model_parallel_size=2, num_layers=4, expert_tensor_parallel_size=3),
         "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 = 3 and "
         "--tensor-model-parallel-size 2 do not divide one another"),
        ((), dict(num_experts=8, tensor_model_parallel_size=2, sequence_parallel=True,
                  expert_tensor_parallel_size=1, expert_model_parallel_size=3),
         "--expert-tensor-parallel-size 1 x --expert-model-parallel-size 3"),
        ((), dict(num_experts=8, expert_tensor_parallel_size=2, expert_model_parallel_size=4),
         "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 4 / "
         "--tensor-model-parallel-size 1 = 8 HDP ranks per expert group does not divide the 4"),
        ((), dict(num_experts=8, expert_model_parallel_size=3), "--expert-model-parallel-size 3"),
        ((), dict(num_experts=8, expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"),
         "--moe-token-dispatcher-type allgather with --expert-model-parallel-size 2"),
        ((), dict(num_experts=8, add_bias_linear=True), "--disable-bias-linear"),
        ((), dict(num_experts=8, expert_model_parallel_size=2, pipeline_model_parallel_size=2,
                  num_layers=4, num_layers_per_virtual_pipeline_stage=1),
         "expert groups of 2 HDP ranks (--expert-tensor-parallel-size 1 x "
         "--expert-model-parallel-size 2 / --tensor-model-parallel-size 1 = 2) with "
         "--virtual-pipeline-model-parallel-size 2 cannot be combined"),
        (("--bytescale-seq-split",), dict(num_experts=8, expert_model_parallel_size=2,
                                          pipeline_model_parallel_size=2, num_layers=4),
         "--bytescale-seq-split does not run with expert groups of 2 HDP ranks "
         "(--expert-tensor-parallel-size 1 x --expert-model-parallel-size 2 / "
         "--tensor-model-parallel-size 1 = 2), needs 1"),
        ((), dict(cuda_graph_impl="local"), "--cuda-graph-impl local"),
        ((), dict(iterations_to_skip=[5]), "--iterations-to-skip"),
        ((), dict(mock_data=False), "--data-path"),
        ((), dict(mock_data=False, data_path=["-3", "/d/a", "7", "/d/b"]), "weight -3.0 of /d/a"),
        ((), dict(mock_data=False, data_path=["0", "/d/a", "0", "/d/b"]), "all 0"),
        (("--bytescale-capacity", "32"), {}, "--bytescale-capacity 32"),
        (("--bytescale-context-length", "512"), {}, "--max-position-embeddings"),
        (("--bytescale-seq-split",), {}, "--bytescale-seq-split does not run with "
                                         "--pipeline-model-parallel-size 1"),
        (("--bytescale-seq-split",), dict(pipeline_model_parallel_size=2, num_layers=4,
                                          recompute_granularity="full"), "--recompute-granularity full"),
    ],
)
def test_refusals_name_the_flag(argv, overrides, flag, capsys):
    values = tiny_model_args(mock_data=True)
    values.update(overrides)
    args = megatron_namespace("--bytescale-hdp", *argv, **values)
    reasons = megatron_lm.hdp_refusals(args)
    assert any(flag in reason for reason in reasons)
    assert len(set(reasons)) == len(reasons), reasons  # each said once
    with pytest.raises(SystemExit) as exit_info:  # a report, not a traceback
        megatron_lm.check_args(args)
        megatron_lm.validate_args(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron_bytescale: error: ") and flag in err
    assert not re.search(r"later issue|not yet|\byet\b|issue \d", err)


def test_only_rank_0_reports_a_refusal_and_every_rank_exits(capsys):
    """With --bytescale-hdp too: rank 0 speaks for the job, the others exit without a word."""
    for rank, said in ((3, False), (0, True)):
        args = megatron_namespace("--bytescale-hdp", cuda_graph_impl="local", rank=rank,
                                  **tiny_model_args(mock_data=True))
        with pytest.raises(SystemExit) as exit_info:
            megatron_lm.check_args(args)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert ("--cuda-graph-impl local" in err) if said else err == "", (rank, err)


def test_arguments_without_any_bytescale_flag_are_left_to_megatron():
    """A namespace built without the plugin's arguments (a loop that never added them) is
    plain Megatron: no check, nothing refused."""
    from types import SimpleNamespace

    args = SimpleNamespace(context_parallel_size=2, tensor_model_parallel_size=1)
    assert megatron_lm.check_args(args) is None
    assert vars(args) == dict(context_parallel_size=2, tensor_model_parallel_size=1)


@pytest.mark.parametrize("layout", [
    dict(pipeline_model_parallel_size=2, num_layers=4, num_layers_per_virtual_pipeline_stage=1),
    dict(pipeline_model_parallel_size=4, num_layers=8, virtual_pipeline_model_parallel_size=2),
])
def test_interleaved_stages_pass_with_pipeline_parallelism(layout):
    args = megatron_namespace("--bytescale-hdp", mock_data=True, **{**tiny_model_args(), **layout})
    assert megatron_lm.hdp_refusals(args) == []


@pytest.mark.parametrize("dispatcher, layout", [
    ("alltoall", {}), ("allgather", {}),
    ("alltoall", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("allgather", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                       expert_tensor_parallel_size=2)),
    ("alltoall", dict(pipeline_model_parallel_size=2, num_layers=4)),
    ("alltoall", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                      pipeline_model_parallel_size=2, num_layers=4)),
    ("alltoall", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                      expert_tensor_parallel_size=1, expert_model_parallel_size=2)),
    ("alltoall", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                      expert_tensor_parallel_size=1, expert_model_parallel_size=4)),
    ("alltoall", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                      pipeline_model_parallel_size=2, num_layers=4, expert_tensor_parallel_size=1)),
    ("alltoall", dict(expert_tensor_parallel_size=2, expert_model_parallel_size=2)),
])
def test_moe_flags_pass_with_expert_parallelism_1(dispatcher, layout):
    """--num-experts, top-k, the dispatcher and the aux-loss flags train under HDP (EP 1),
    also with TP 2 (sequence parallelism, experts split like the dense layers), PP 2 or both;
    and expert-tensor parallelism other than TP where ETP x EP and TP divide one another."""
    args = megatron_namespace(
        "--bytescale-hdp", mock_data=True, **{**tiny_model_args(), **layout},
        num_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.01],
        moe_z_loss_coeff=1e-3, add_bias_linear=False)
    assert megatron_lm.hdp_refusals(args) == []


@pytest.mark.parametrize("argv, layout", [
    ((), dict(num_layers_per_virtual_pipeline_stage=1)),
    (("--bytescale-seq-split",), {}),
])
def test_an_expert_group_inside_one_tp_group_passes_virtual_stages_and_seq_split(argv, layout):
    """TP 2 x PP 2 x ETP 1 x EP 2: Megatron's EP size is 2, but each stage's expert group is its
    TP pair (lockstep block 1), whose ranks always run the same micro-batches, so neither
    interleaved stages nor split ring micro-batches are refused for experts (they are for
    expert groups over several HDP ranks: test_refusals_name_the_flag)."""
    args = megatron_namespace(
        "--bytescale-hdp", *argv, mock_data=True,
        **{**tiny_model_args(), **layout, "num_layers": 4, "world_size": 4},
        tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
        num_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        expert_tensor_parallel_size=1, expert_model_parallel_size=2,
        moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.01],
        add_bias_linear=False)
    assert megatron_lm.hdp_refusals(args) == []
    # ETP = TP on 8 ranks (HDP 2): the expert group is both HDP ranks' TP pairs (block 2), and
    # only that is refused, so the pass above is the block's doing
    args.expert_tensor_parallel_size, args.world_size = 2, 8
    (reason,) = megatron_lm.hdp_refusals(args)
    assert ("expert groups of 2 HDP ranks (--expert-tensor-parallel-size 2 x "
            "--expert-model-parallel-size 2 / --tensor-model-parallel-size 2 = 2)") in reason


def test_every_refusal_is_reported_at_once_by_rank_0_only(capsys):
    values = tiny_model_args(mock_data=False, context_parallel_size=2, attention_dropout=0.1,
                             ddp_average_in_collective=True, pipeline_model_parallel_size=2,
                             num_layers=4, num_layers_per_virtual_pipeline_stage=1,
                             overlap_p2p_comm=False)
    argv = ("--bytescale-hdp", "--bytescale-context-length", "512")
    reasons = megatron_lm.hdp_refusals(megatron_namespace(*argv, **values))
    flags = ["--context-parallel-size 2", "interleaved pipeline stages",
             "--ddp-average-in-collective", "--attention-dropout 0.1", "--data-path",
             "--max-position-embeddings"]
    assert len(reasons) == len(flags)
    for flag in flags:
        assert sum(flag in reason for reason in reasons) >= 1, (flag, reasons)
    for rank, hook in itertools.product((0, 3), (megatron_lm.check_args, megatron_lm.validate_args)):
        with pytest.raises(SystemExit) as exit_info:
            hook(megatron_namespace(*argv, **dict(values, rank=rank)))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        if rank:
            assert err == ""  # rank 0 speaks for every rank
        else:
            assert "cannot run with these" in err
            assert all(flag in err for flag in flags[:4] + ["--data-path"])


def test_capacity_above_the_sequence_length_is_warned_about(caplog):
    args = megatron_namespace("--bytescale-hdp", "--bytescale-capacity", str(2 * SEQ),
                              mock_data=True, **tiny_model_args())
    with caplog.at_level("WARNING", logger=megatron_lm.__name__):
        megatron_lm.validate_args(args)
    assert "is larger than --seq-length" in caplog.text and "no ring ever forms" in caplog.text


def test_without_the_flag_the_hooks_are_megatron():
    args = megatron_namespace(context_parallel_size=2, hybrid_context_parallel=True)
    before = dict(vars(args))
    assert megatron_lm.check_args(args) is None
    assert megatron_lm.validate_args(args).hdp is False
    assert vars(args) == before
    calls = []

    def megatron_builder(args_, pre, post, vp_stage=None, config=None, pg_collection=None):
        calls.append("builder")
        return "megatron model"

    def megatron_provider(num_samples, vp_stage=None):
        calls.append("provider")
        return "megatron datasets"

    def megatron_forward_step(data_iterator, model, return_schedule_plan=False):
        calls.append("forward")
        return "megatron forward"

    megatron_provider.is_distributed = True
    provider = megatron_lm.wrap_datasets_provider(megatron_provider)
    assert provider.is_distributed is True  # pretrain_gpt sets it before wrapping
    assert megatron_lm.wrap_model_builder(megatron_builder)(args, True, True) == "megatron model"
    assert provider([1, 1, 1]) == "megatron datasets"  # no Megatron global args here
    assert megatron_lm.wrap_forward_step(megatron_forward_step)(None, None) == "megatron forward"
    assert calls == ["builder", "provider", "forward"]


@pytest.mark.parametrize("argv", [
    ("--bytescale-capacity", "128"),
    ("--bytescale-scheduler", "balance"),  # its default value, given: still a given flag
    ("--bytescale-align", "1"),
    ("--bytescale-offload",),
    ("--no-bytescale-check-plan-hash",),
    ("--bytescale-check-plan-hash",),  # a bool flag at its default
    ("--bytescale-ranks-per-node", "8", "--bytescale-two-level-ring"),
])
def test_bytescale_flags_without_the_switch_are_refused_naming_them(argv, capsys):
    """A user who forgets --bytescale-hdp would otherwise train plain Megatron unknowingly."""
    flags = [a for a in argv if a.startswith("--")]
    for hook in (megatron_lm.check_args, megatron_lm.validate_args):
        with pytest.raises(SystemExit) as exit_info:
            hook(megatron_namespace(*argv))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("megatron_bytescale: error: "), err
        assert ", ".join(flags) + " given without --bytescale-hdp" in err
        assert "add --bytescale-hdp (or --no-bytescale-hdp to run plain Megatron on purpose)" in err
        assert ("and ignore them;" if len(flags) > 1 else "and ignore it;") in err  # each flag named
    assert len(megatron_lm.hdp_refusals(megatron_namespace(*argv))) == 1
    with_switch = megatron_lm.hdp_refusals(megatron_namespace("--bytescale-hdp", *argv))
    assert not any("without --bytescale-hdp" in reason for reason in with_switch)
    # rank 3 says nothing (rank 0 speaks for every rank) but exits the same way
    with pytest.raises(SystemExit):
        megatron_lm.check_args(megatron_namespace(*argv, rank=3))
    assert capsys.readouterr().err == ""
    # an explicit --no-bytescale-hdp chooses plain Megatron on purpose: accepted, unchanged
    args = megatron_namespace("--no-bytescale-hdp", *argv)
    before = dict(vars(args))
    assert megatron_lm.check_args(args) is None and megatron_lm.validate_args(args).hdp is False
    assert vars(args) == before and megatron_lm.hdp_refusals(args) == []


def test_with_the_flag_the_wrappers_dispatch_to_hdp(monkeypatch):
    from megatron_bytescale.integration import megatron_lm_step

    args = megatron_namespace("--bytescale-hdp", mock_data=True, **tiny_model_args())
    monkeypatch.setattr(megatron_lm, "megatron_args", lambda: args)
    monkeypatch.setattr(megatron_lm, "build_hdp_data_iterators", lambda a: ("hdp", a))
    monkeypatch.setattr(megatron_lm, "build_hdp_gpt_model", lambda *a, **k: "hdp model")
    monkeypatch.setattr(megatron_lm, "forward_step", lambda it, model: "hdp forward")
    never = lambda *a, **k: pytest.fail("Megatron's function ran under --bytescale-hdp")  # noqa: E731
    assert megatron_lm.wrap_datasets_provider(never)([1, 1, 1]) == ("hdp", args)
    assert megatron_lm.wrap_model_builder(never)(args, True, True) == "hdp model"
    assert megatron_lm.wrap_forward_step(never)(None, None) == "hdp forward"
    assert megatron_lm_step.megatron_args() is None  # the real one: no megatron.training here


# ----------------------------------------------------------------------------- data


def test_cost_model_flag_loads_a_fitted_model_or_names_the_mismatch(tmp_path):
    from megatron_bytescale.integration.config import ByteScaleConfig
    from megatron_bytescale.integration.megatron_lm_data import cost_model_from_args
    from megatron_bytescale.planner.presets import preset_cost_model

    args = megatron_namespace(**tiny_model_args())
    analytic = cost_model_from_args(args, ByteScaleConfig.from_args(args))
    assert analytic.num_layers == 2 and analytic.name.startswith("megatron-args")
    fitted = analytic.with_(name="fitted-here", ring_step_overhead_s=1e-4)
    fitted.save(tmp_path / "cm.json")
    args = megatron_namespace("--bytescale-cost-model", str(tmp_path / "cm.json"), **tiny_model_args())
    assert cost_model_from_args(args, ByteScaleConfig.from_args(args)) == fitted
    preset_cost_model("llama-7b", "h100").save(tmp_path / "7b.json")  # 32 layers
    args = megatron_namespace("--bytescale-cost-model", str(tmp_path / "7b.json"), **tiny_model_args())
    with pytest.raises(ValueError, match="--bytescale-cost-model .*32 layers.*--num-layers 2"):
        cost_model_from_args(args, ByteScaleConfig.from_args(args))


def test_split_bounds_follow_megatron():
    # 10 documents, --split 8,1,1: documents 0-7 train, 8 valid, 9 test (by hand)
    assert split_bounds([0.8, 0.1, 0.1], 10) == [(0, 8), (8, 9), (9, 10)]
    assert split_bounds([1.0, 0.0, 0.0], 10) == [(0, 10), (0, 0), (0, 0)]


def test_indexed_documents_and_token_budget_batches(tmp_path):
    docs = random_documents(0, 30)
    prefix = tmp_path / "corpus_text_document"
    write_indexed_dataset(prefix, docs)
    whole = [np.concatenate(d).astype(np.int64) for d in docs]
    train = indexed_document_source([str(prefix)], split=[0.8, 0.1, 0.1], split_index=0)
    valid = indexed_document_source([str(prefix)], split=[0.8, 0.1, 0.1], split_index=1)
    assert list(train.lengths) == [len(w) for w in whole[:24]]
    assert list(valid.lengths) == [len(w) for w in whole[24:27]]
    assert indexed_document_source([str(prefix)], split=[1.0, 0.0, 0.0], split_index=2) is None
    for doc in (0, 3, 6):  # two-sequence documents: reads across the sequence boundary
        n = len(whole[doc])
        assert np.array_equal(train.read(doc, 0, n), whole[doc])
        assert np.array_equal(train.read(doc, n // 3, n // 2), whole[doc][n // 3: n // 3 + n // 2])

    budget, context = 500, 150
    batches = budget_batches(train, tokens_per_batch=budget, context_length=context, seed=5,
                             shuffle=False)
    epoch_tokens = int(train.lengths.sum())
    seen: dict[int, list[tuple[int, int]]] = {}
    total = 0
    while total < epoch_tokens - 2 * budget:  # stay inside the first epoch
        batch = next(batches)
        assert budget - 1 <= sum(batch.lengths) <= budget
        for i, length in enumerate(batch.lengths):
            piece = batch.tokens_by_seq.pieces[i]
            assert 2 <= length <= context and length == piece.length
            tokens = batch.tokens_by_seq[i]
            assert np.array_equal(tokens, whole[piece.doc][piece.start: piece.start + length])
            seen.setdefault(piece.doc, []).append((piece.start, piece.start + length))
        total += sum(batch.lengths)
    for doc, spans in seen.items():  # in order, disjoint, never across a context boundary
        assert spans == sorted(spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(s // context == (e - 1) // context for s, e in spans)
    # fragments of < 2 tokens are all that is dropped: at most one token per cut
    fully_seen = [d for d in seen if d < max(seen)]
    for doc in fully_seen:
        covered = sum(e - s for s, e in seen[doc])
        cuts = len(seen[doc]) + (len(whole[doc]) - 1) // context
        assert len(whole[doc]) - cuts <= covered <= len(whole[doc])


def test_several_prefixes_are_split_each_and_concatenated(tmp_path):
    docs_a, docs_b = random_documents(4, 10), random_documents(5, 20)
    write_indexed_dataset(tmp_path / "a", docs_a)
    write_indexed_dataset(tmp_path / "b", docs_b)
    both = indexed_document_source([str(tmp_path / "a"), str(tmp_path / "b")],
                                   split=[0.8, 0.1, 0.1], split_index=0)
    whole = [np.concatenate(d) for d in docs_a[:8] + docs_b[:16]]  # 80 % of each, by hand
    assert list(both.lengths) == [len(w) for w in whole]
    for doc in (0, 7, 8, 23):
        assert np.array_equal(both.read(doc, 0, len(whole[doc])), whole[doc])


def test_budget_batches_resume_and_shuffle(tmp_path):
    prefix = tmp_path / "d"
    write_indexed_dataset(prefix, random_documents(1, 12))
    source = indexed_document_source([str(prefix)], split=[1.0, 0.0, 0.0], split_index=0)

    def lengths(gen, n):
        return [b.lengths for b in itertools.islice(gen, n)]

    def make(**kw):
        return budget_batches(source, tokens_per_batch=300, context_length=120, **kw)

    reference = lengths(make(seed=3), 12)  # several epochs: reshuffled every epoch
    assert lengths(make(seed=3, skip_batches=7), 5) == reference[7:12]
    resumed = next(make(seed=3, skip_batches=7))
    again = list(itertools.islice(make(seed=3), 8))[7]
    assert all(np.array_equal(resumed.tokens_by_seq[i], again.tokens_by_seq[i])
               for i in range(len(again.lengths)))
    assert lengths(make(seed=4), 12) != reference


def test_mock_documents_are_deterministic():
    a = mock_document_source(vocab_size=50, context_length=256, num_tokens=5000, seed=9)
    b = mock_document_source(vocab_size=50, context_length=256, num_tokens=5000, seed=9)
    assert int(a.lengths.sum()) == 5000 and a.lengths.max() <= 256
    assert np.array_equal(a.lengths, b.lengths)
    for doc in range(0, len(a.lengths), 7):
        tokens = a.read(doc, 0, int(a.lengths[doc]))
        assert np.array_equal(tokens, b.read(doc, 0, int(a.lengths[doc])))
        assert tokens.min() >= 0 and tokens.max() < 50
        assert np.array_equal(a.read(doc, 1, 3), tokens[1:4])


# ----------------------------------------------------------------------------- 4 gloo ranks


class _Recording:
    """Passes items through and keeps the last one (to see the step Megatron's loop consumed)."""

    def __init__(self, iterator):
        self.iterator, self.last = iterator, None

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.iterator)
        return self.last


def _megatron_train_step(ddp, optimizer, data_iterator, *, forward_only=False):
    """What Megatron's train_step / evaluate do around forward_backward_func (PP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not forward_only:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
    reports = megatron_lm.hdp_forward_backward(
        forward_step_func=megatron_lm.forward_step, data_iterator=data_iterator, model=[ddp],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=1, decoder_seq_length=None,
        forward_only=forward_only,
    )
    summed = torch.vstack([r["lm loss"].view(-1) for r in reports]).sum(dim=0)
    dist.all_reduce(summed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    # the other keys as train_step reduces one-element reports: their mean over the reports
    extra = {k: float(torch.cat([r[k].view(-1) for r in reports]).mean())
             for k in reports[0] if k != "lm loss"}
    return (float(summed[0] / summed[1]), len(reports), [r["lm loss"].tolist() for r in reports],
            extra)


def hooks_rank_body(rank: int, world_size: int, prefix: str) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.core_attention import ByteScaleCoreAttention
    from megatron_bytescale.integration.model import ByteScaleGPTModel
    from megatron_bytescale.integration.training import wrap_for_hdp
    from megatron_bytescale.planner.plan import PlanBuilder
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron
    from .hdp_cases import (
        grab_grads_before_step,
        reference_loss_and_grads,
        relative_error,
        transformer_config,
    )

    enable_cpu_megatron()
    parallel_state.initialize_model_parallel()  # what Megatron's initialize does (CP = 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    args = megatron_namespace("--bytescale-hdp", "--bytescale-capacity", str(CAPACITY),
                              data_path=[prefix], split="80,10,10", **tiny_model_args())
    megatron_lm.check_args(args)
    megatron_lm.validate_args(args)
    config = transformer_config()
    out: dict[str, Any] = {}

    def refused(*a, **k):
        raise AssertionError("Megatron's gpt_builder ran under --bytescale-hdp")

    build = megatron_lm.wrap_model_builder(refused)
    model = build(args, True, True, None, config=config)
    out["model"] = type(model).__name__ == ByteScaleGPTModel.__name__
    out["core_attention"] = sorted({type(layer.self_attention.core_attention).__name__
                                    for layer in model.decoder.layers})
    out["expected_attention"] = ByteScaleCoreAttention.__name__
    from megatron_bytescale.integration.groups import get_hdp_manager

    manager = get_hdp_manager()
    out["hdp_size"], out["megatron_cp"] = manager.size, parallel_state.get_context_parallel_world_size()
    initial_state = model.state_dict()  # "model" itself is never trained

    def fresh():
        replica = build(args, True, True, None, config=config)
        replica.load_state_dict(initial_state)
        ddp, optimizer = wrap_for_hdp(replica, lr=1e-3)
        config.no_sync_func = None  # as Megatron's train() leaves it without overlap
        return ddp, optimizer

    def compare(name, iterator, recording, forward_only=False):
        ddp, optimizer = fresh()
        grads = {} if forward_only else grab_grads_before_step(ddp, optimizer)
        loss, reports, values, metrics = _megatron_train_step(ddp, optimizer, iterator,
                                                               forward_only=forward_only)
        if not forward_only:
            optimizer.step()
        step = recording.last
        info = {"loss": loss, "reports": reports, "values": values, "metrics": metrics,
                "micro_batches": step.num_micro_batches,
                "rings": sorted({mb.ring_size for mb in step.micro_batches})}
        if rank == 0:
            sequences = [np.asarray(step.global_batch.tokens_by_seq[i])
                         for i in range(len(step.global_batch.lengths))]
            ref_loss, ref_grads = reference_loss_and_grads(config, initial_state, sequences)
            info["loss_error"] = abs(loss - ref_loss) / abs(ref_loss)
            if not forward_only:
                info["grad_error"] = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
        out[name] = info

    # 1. the training iterator from the indexed dataset, driven like Megatron's train_step
    train, valid, test = megatron_lm.build_hdp_data_iterators(args)
    out["iterators"] = [type(x).__name__ for x in (train, valid, test)]
    recording = _Recording(train)
    compare("train_step", RerunDataIterator(recording), recording)
    compare("train_step_2", RerunDataIterator(recording), recording)
    # 2. evaluate's path: forward only, on the validation split
    recording_valid = _Recording(valid)
    compare("evaluate", RerunDataIterator(recording_valid), recording_valid, forward_only=True)
    # 3. a rank with no micro-batch (rank 3) still returns a report and joins the reductions
    lengths = {0: 40, 1: 120, 2: 30, 3: 50, 4: 20, 5: 60}
    builder = PlanBuilder(hdp_size=4, capacity=CAPACITY, lengths=lengths)
    for ring, seqs in (([0], [0]), ([1, 2], [1]), ([0], [2]), ([1], [3]), ([0], [4]), ([2], [5])):
        builder.add(ring, seqs)
    plan = builder.build(scheduler="manual")
    rng = np.random.default_rng(11)
    tokens = [rng.integers(0, 256, lengths[i]).tolist() for i in range(len(lengths))]
    recording_zero = _Recording(HDPDataIterator([tokens], planner=lambda _: plan, hdp=manager.hdp))
    compare("zero_rank", RerunDataIterator(recording_zero), recording_zero)
    # 4. the plan hashes agree (every rank planned the same global batch)
    again = megatron_lm.build_hdp_data_iterators(args)[0]
    out["plan_hash"] = next(again).plan_hash
    # 5. resume: Megatron restores consumed_*_samples = k x --global-batch-size from the checkpoint
    out["resume"] = _resume_facts(args)
    return out


def _resume_facts(args) -> dict[str, Any]:
    """The iterators built after k (train) / j (valid) steps continue exactly where an
    uninterrupted run is: same plan hash, same tokens, same micro-batches on this rank."""
    facts: dict[str, Any] = {}
    for split, name, k in ((0, "train", 3), (1, "valid", 2)):
        uninterrupted = megatron_lm.build_hdp_data_iterators(args)[split]
        first = next(uninterrupted)
        for _ in range(k - 1):
            next(uninterrupted)
        expected = next(uninterrupted)
        resumed_args = argparse.Namespace(**vars(args))
        setattr(resumed_args, f"consumed_{name}_samples", k * GLOBAL_BATCH)
        resumed = next(megatron_lm.build_hdp_data_iterators(resumed_args)[split])
        batch_a, batch_b = expected.global_batch, resumed.global_batch
        facts[name] = {
            "hash_moved": first.plan_hash != expected.plan_hash,
            "same_hash": resumed.plan_hash == expected.plan_hash,
            # steps keep their global index, as an own-loop load_state_dict gives them
            "global_index": resumed.index == expected.index == k,
            "same_lengths": batch_a.lengths == batch_b.lengths,
            "same_tokens": all(np.array_equal(batch_a.tokens_by_seq[i], batch_b.tokens_by_seq[i])
                               for i in range(len(batch_a.lengths))),
            "same_micro_batches": all(
                torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels)
                for x, y in itertools.zip_longest(expected.micro_batch_tensors(),
                                                  resumed.micro_batch_tensors(), fillvalue=None)
                if x is not None and y is not None
            ) and expected.num_micro_batches == resumed.num_micro_batches,
        }
    return facts


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("indexed") / "corpus_text_document"
    write_indexed_dataset(prefix, random_documents(2, 60))
    return run_distributed(WORLD, hooks_rank_body, str(prefix), timeout_s=600)


def test_model_builder_returns_our_model_with_our_attention(rank_results):
    r = rank_results[0]
    assert r["model"] is True
    assert r["core_attention"] == [r["expected_attention"]]
    assert all(x["hdp_size"] == WORLD and x["megatron_cp"] == 1 for x in rank_results)


def test_data_iterators_plan_the_same_steps_on_every_rank(rank_results):
    assert rank_results[0]["iterators"] == ["HDPDataIterator"] * 3
    assert len({r["plan_hash"] for r in rank_results}) == 1


@pytest.mark.parametrize("name", ["train_step", "train_step_2", "zero_rank"])
def test_hdp_step_through_the_hook_matches_single_process(rank_results, name):
    infos = [r[name] for r in rank_results]
    assert len({i["loss"] for i in infos}) == 1  # train_step's all-reduce: same loss everywhere
    assert infos[0]["loss_error"] <= TOLERANCE
    assert infos[0]["grad_error"] <= TOLERANCE, f"{name}: gradient error {infos[0]['grad_error']:.2e}"


def test_balance_plans_rings_and_unequal_micro_batch_counts(rank_results):
    rings = set().union(*(r["train_step"]["rings"] for r in rank_results))
    assert max(rings) > 1 and 1 in rings
    counts = [r[name]["micro_batches"] for r in rank_results for name in ("train_step",)]
    second = [r["train_step_2"]["micro_batches"] for r in rank_results]
    assert len(set(counts)) > 1 or len(set(second)) > 1


def test_rank_without_micro_batches_returns_one_zero_report(rank_results):
    counts = [r["zero_rank"]["micro_batches"] for r in rank_results]
    assert counts == [3, 2, 2, 0]
    assert rank_results[3]["zero_rank"]["reports"] == 1
    assert rank_results[3]["zero_rank"]["values"] == [[0.0, 0.0]]
    assert all(r["zero_rank"]["reports"] == c for r, c in zip(rank_results[:3], counts[:3]))


@pytest.mark.parametrize("split", ["train", "valid"])
def test_resume_from_consumed_samples_continues_the_uninterrupted_run(rank_results, split):
    """consumed_*_samples counts SAMPLES (k steps x --global-batch-size); skipping that many
    global batches instead of k would silently train on other data after every resume."""
    for r in rank_results:
        facts = r["resume"][split]
        assert facts["hash_moved"], "the steps compared must differ from the first one"
        assert facts == {name: True for name in facts}, facts


def test_forward_only_matches_single_process_loss(rank_results):
    assert rank_results[0]["evaluate"]["loss_error"] <= TOLERANCE


def test_training_reports_carry_the_step_hdp_metrics_for_megatron_to_log(rank_results):
    """Megatron logs every report key: the metrics ride along, equal on every rank."""
    metrics = [r["zero_rank"]["metrics"] for r in rank_results]
    # (equal up to float32 rounding of the mean over each rank's number of reports)
    for m in metrics:
        assert m == pytest.approx(metrics[0], rel=1e-6)
    m = metrics[0]
    assert set(m) == set(METRIC_NAMES.values())
    # the manual plan: micro-batches 3/2/2/0, one ring of 2 ranks, the rest local
    assert (m["hdp mb/rank min"], m["hdp mb/rank mean"], m["hdp mb/rank max"]) == \
        pytest.approx((0, 1.75, 3))
    assert (m["hdp rings>1"], m["hdp largest ring"], m["hdp offloaded mb"]) == \
        pytest.approx((1, 2, 0))
    assert m["hdp busy max s"] >= m["hdp busy min s"] >= 0 and 0 <= m["hdp idle frac"] < 1
    assert m["hdp p2p MB"] > 0  # the ring of two sent its K/V
    most = max(x["train_step"]["micro_batches"] for x in rank_results)
    assert all(r["train_step"]["metrics"]["hdp mb/rank max"] == pytest.approx(most)
               for r in rank_results)
    assert rank_results[0]["evaluate"]["metrics"] == {}  # evaluation logs its loss only


def test_megatron_constant_micro_batch_line_says_what_hdp_runs(caplog):
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    megatron_lm.validate_args(megatron_namespace("--bytescale-hdp", mock_data=True,
                                                 **tiny_model_args()))
    try:
        with caplog.at_level("INFO", logger="megatron.core.num_microbatches_calculator"):
            # keywords: 0.19 dropped the positional rampup_batch_size of 0.16.1's builder
            init_num_microbatches_calculator(rank=0, rampup_batch_size=None, global_batch_size=8,
                                             micro_batch_size=1, data_parallel_size=4,
                                             decrease_batch_size_if_needed=False)
    finally:
        destroy_num_microbatches_calculator()
    line = [r.getMessage() for r in caplog.records if "constant" in r.getMessage()]
    assert line and line[0].startswith("setting number of microbatches to constant 2 ")
    assert "each rank runs the micro-batches its step plan gives it" in line[0]


# ----------------------------------------------------------------------------- Megatron-LM
