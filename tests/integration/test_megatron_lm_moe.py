"""A small Mixtral-style MoE trains through the patched Megatron-LM ``pretrain_gpt.py`` (HDP).

One run on 4 CPU gloo ranks (fixture ``patched_megatron_lm``, launcher of
``megatron_bytescale.testing.megatron_lm``): 4 experts, top-2, the all-to-all dispatcher,
SwiGLU, RMSNorm, RoPE, untied embeddings, the load-balancing loss and z-loss, pipeline
parallelism 2 and expert parallelism 2 (at each stage both pipelines form one expert group, two
experts each; a pipeline with fewer micro-batches runs empty ones through its stages). Megatron's
own loop runs the steps; the HDP summary line is in the log.
The gradients themselves are checked against megatron-core in ``test_moe_training.py``.

Megatron's own ``examples/mixtral/train_mixtral_8x7b_distributed.sh`` (PP 4, EP 8) with the
documented ``--bytescale-*`` additions passes the hooks and the patched ``validate_args`` at
32 ranks (HDP 8 per stage, the EP 8 its flags need).
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_bytescale.testing.megatron_lm import run_pretrain_gpt, validate_megatron_flags

from .megatron_lm_cases import random_documents, write_indexed_dataset
from .test_megatron_lm_parallel import (
    BYTESCALE_ADDITIONS,
    PRETRAIN,
    _losses,
    _said,
    example_flags,
)

MIXTRAL_EXAMPLE = Path("examples") / "mixtral" / "train_mixtral_8x7b_distributed.sh"

MIXTRAL_STYLE = ["--num-experts", "4", "--moe-router-topk", "2",
                 "--moe-token-dispatcher-type", "alltoall",
                 "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                 "--moe-z-loss-coeff", "1e-3", "--moe-ffn-hidden-size", "96",
                 "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_patched_pretrain_gpt_trains_a_mixtral_style_moe(patched_megatron_lm, tmp_path):
    write_indexed_dataset(tmp_path / "text_document", random_documents(7, 120, vocab=255))
    flags = [*PRETRAIN, *MIXTRAL_STYLE, "--expert-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2",
             "--data-path", str(tmp_path / "text_document"), "--split", "98,1,1"]
    run = run_pretrain_gpt(patched_megatron_lm, *flags, ranks=4, cwd=tmp_path)
    assert run.returncode == 0, run.tail()
    losses = _losses(run.stdout)
    assert len(losses) == 3 and all(x == x and 0 < x < 20 for x in losses), losses
    summaries = re.findall(r"\[ByteScale HDP\] iteration .*", run.stdout)
    assert len(summaries) == 3, run.tail()
    rings = [int(r.split("x")[0]) for line in summaries
             for r in re.search(r"\| rings ([\dx ]+) \|", line).group(1).split()]
    assert max(rings) == 2, summaries  # documents longer than the capacity ran on a ring
    # Megatron's own log of the router losses: the HDP values, not the zeros of routers whose
    # own loss paths HDP switches off (their exact value is checked in test_moe_training.py)
    for name in ("load_balancing_loss", "z_loss"):
        logged = [float(x) for x in re.findall(name + r": (\S+) \|", run.stdout)]
        assert len(logged) == 3 and all(0 < x < 100 for x in logged), (name, logged)


def test_mixtral_example_passes_the_hooks_with_its_own_layout(patched_megatron_lm, tmp_path):
    """The example as given (PP 4, EP 8, TP 1, grouped GEMM, alltoall, aux loss, the overlap
    flags, bf16, the distributed optimizer) plus the documented ``--bytescale-*`` flags passes
    the hooks' checks and the patched ``validate_args`` on the 4 nodes x 8 GPUs its EP 8 needs:
    8 HDP ranks per stage, one expert group of 8 pipelines at every stage."""
    flags = example_flags(patched_megatron_lm, MIXTRAL_EXAMPLE, tmp_path,
                          ("ckpt", "tokenizer.model", "data/text_document"))
    assert "--num-experts" in flags and "--moe-grouped-gemm" in flags  # the example's own
    assert "--expert-model-parallel-size" in flags and "--pipeline-model-parallel-size" in flags
    (served,) = validate_megatron_flags(
        patched_megatron_lm, [[*flags, *BYTESCALE_ADDITIONS]],
        ("bytescale_hdp", "num_experts", "moe_router_topk", "data_parallel_size",
         "calculate_per_token_loss", "moe_token_dispatcher_type", "expert_model_parallel_size",
         "pipeline_model_parallel_size", "tensor_model_parallel_size"), world_size=32)
    assert not served.refused, _said(served)
    assert served.values == dict(bytescale_hdp=True, num_experts=8, moe_router_topk=2,
                                 data_parallel_size=8, calculate_per_token_loss=True,
                                 moe_token_dispatcher_type="alltoall",
                                 expert_model_parallel_size=8, pipeline_model_parallel_size=4,
                                 tensor_model_parallel_size=1)


def test_expert_tensor_parallel_layouts_pass_the_patched_validate_args(patched_megatron_lm):
    """``--expert-tensor-parallel-size`` other than TP passes the hooks and Megatron's own
    ``validate_args`` on 4 ranks where ETP x EP and TP divide one another (the layouts whose
    gradients test_moe_parallel_training.py checks); other sizes are refused by flag name.
    Interleaved stages and ``--bytescale-seq-split`` pass with an expert group inside one TP
    group and are refused, naming the flags, when it spans several HDP ranks."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    vpp2 = ["--num-layers-per-virtual-pipeline-stage", "1"]
    etp1_ep2 = ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"]
    base = [*PRETRAIN, *MIXTRAL_STYLE, "--mock-data"]
    served = validate_megatron_flags(patched_megatron_lm, [
        [*base, *tp2, "--expert-tensor-parallel-size", "1",
         "--expert-model-parallel-size", "2", *BYTESCALE_ADDITIONS],
        [*base, *tp2, "--expert-tensor-parallel-size", "1",
         "--expert-model-parallel-size", "4", *BYTESCALE_ADDITIONS],
        [*base, "--expert-tensor-parallel-size", "2",
         "--expert-model-parallel-size", "2", *BYTESCALE_ADDITIONS],
        [*base, "--expert-tensor-parallel-size", "2",
         "--expert-model-parallel-size", "4", *BYTESCALE_ADDITIONS],
        [*base, *tp2, "--expert-tensor-parallel-size", "3",
         *BYTESCALE_ADDITIONS],
        # TP 2 x PP 2 x ETP 1 x EP 2: each stage's expert group is its TP pair (block 1), so
        # interleaved stages and split ring micro-batches pass; at PP 2 x EP 2 (block 2) not
        [*base, *tp2, *pp2, *vpp2, *etp1_ep2, *BYTESCALE_ADDITIONS],
        [*base, *tp2, *pp2, *etp1_ep2, *BYTESCALE_ADDITIONS, "--bytescale-seq-split"],
        [*base, *pp2, *vpp2, "--expert-model-parallel-size", "2", *BYTESCALE_ADDITIONS],
        [*base, *pp2, "--expert-model-parallel-size", "2", *BYTESCALE_ADDITIONS,
         "--bytescale-seq-split"],
    ], ("tensor_model_parallel_size", "expert_tensor_parallel_size", "expert_model_parallel_size",
        "data_parallel_size"), world_size=4)
    assert [s.values for s in served[:3]] == [
        dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
             expert_model_parallel_size=2, data_parallel_size=2),
        dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
             expert_model_parallel_size=4, data_parallel_size=2),
        dict(tensor_model_parallel_size=1, expert_tensor_parallel_size=2,
             expert_model_parallel_size=2, data_parallel_size=4),
    ], [_said(s) for s in served[:3]]
    for result, flag in zip(served[3:5], [
            "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 4 / "
            "--tensor-model-parallel-size 1 = 8 HDP ranks per expert group does not divide",
            "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 = 3 and "
            "--tensor-model-parallel-size 2 do not divide one another"]):
        assert result.refused and flag in _said(result), _said(result)
    assert [s.values for s in served[5:7]] == [
        dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
             expert_model_parallel_size=2, data_parallel_size=1)] * 2, [
                 _said(s) for s in served[5:7]]
    block = ("expert groups of 2 HDP ranks (--expert-tensor-parallel-size 1 x "
             "--expert-model-parallel-size 2 / --tensor-model-parallel-size 1 = 2)")
    for result, flag in zip(served[7:], [f"{block} with --virtual-pipeline-model-parallel-size 2",
                                         f"--bytescale-seq-split does not run with {block}"]):
        assert result.refused and flag in _said(result), _said(result)
