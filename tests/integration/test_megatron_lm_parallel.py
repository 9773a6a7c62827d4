"""Tensor and pipeline parallelism through the patched Megatron-LM ``pretrain_gpt.py``.

Uses the session fixture ``patched_megatron_lm`` (``conftest.py``: a patched copy of the
core_v0.16.1 tree) and the CPU launcher of ``megatron_bytescale.testing.megatron_lm``:

* Megatron's own ``examples/llama/train_llama3_8b_h100_fp8.sh`` is run with ``torchrun``
  stubbed out to capture its flags; with TP 2 and/or PP 2 and the documented ``--bytescale-*``
  additions they pass the patched ``validate_args`` (one process, no training), and so do the
  flags of ``scripts/pretrain_gpt_bytescale.sh``'s multi-node TP / PP example (``DRY_RUN=1``);
* the patched ``pretrain_gpt.py`` trains three iterations on 4 CPU ranks as TP 2 x PP 2 with
  sequence parallelism, and on 2 ranks as TP 1 / PP 1 x HDP 2 with and without
  ``--bytescale-offload``, from the same checkpoint: the losses agree step by step.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_bytescale.testing.megatron_lm import (
    PatchedMegatronLM,
    repository_root,
    run_pretrain_gpt,
    validate_megatron_flags,
)

from .megatron_lm_cases import TOLERANCE, random_documents, write_indexed_dataset

LLAMA3_EXAMPLE = Path("examples") / "llama" / "train_llama3_8b_h100_fp8.sh"
# what docs/megatron_lm.md tells users to add to their launch script
BYTESCALE_ADDITIONS = ["--bytescale-hdp", "--bytescale-capacity", "4096",
                       "--bytescale-scheduler", "balance"]


def example_flags(tree: PatchedMegatronLM, script: Path, workdir: Path,
                  script_args: tuple[str, ...] = ("ckpt", "tb")) -> list[str]:
    """The flags ``script`` passes to ``pretrain_gpt.py`` (its ``torchrun`` replaced by a stub
    that writes its arguments as JSON; the script runs in ``workdir`` with ``script_args``,
    paths under ``workdir``)."""
    stub = workdir / "bin" / "torchrun"
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text('#!/usr/bin/env python3\nimport json, sys\n'
                    'print("FLAGS " + json.dumps(sys.argv[1:]))\n')
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    (workdir / "pretrain_gpt.py").write_text("")  # the script checks that it exists
    run = subprocess.run(["bash", str(tree.root / script),
                          *(str(workdir / a) for a in script_args)], cwd=workdir, capture_output=True, text=True,
                         env=dict(os.environ, PATH=f"{stub.parent}{os.pathsep}"
                                                   f"{os.environ['PATH']}"), timeout=60)
    line = next((x for x in run.stdout.splitlines() if x.startswith("FLAGS ")), None)
    assert run.returncode == 0 and line, run.stdout + run.stderr
    argv = json.loads(line[len("FLAGS "):])
    return argv[argv.index("pretrain_gpt.py") + 1:]


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """``flags`` with ``name`` set to ``value`` (replaced when present, else appended)."""
    if name in flags:
        i = flags.index(name)
        return [*flags[:i + 1], value, *flags[i + 2:]]
    return [*flags, name, value]


LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
               "data_parallel_size", "context_parallel_size", "calculate_per_token_loss",
               "dataloader_type", "bytescale_hdp", "bytescale_capacity",
               "virtual_pipeline_model_parallel_size", "overlap_grad_reduce",
               "overlap_param_gather")


def test_llama3_example_flags_with_tp_and_pp_pass_validate_args(patched_megatron_lm, tmp_path):
    flags = example_flags(patched_megatron_lm, LLAMA3_EXAMPLE, tmp_path)
    assert "--sequence-parallel" in flags and "--swiglu" in flags  # the example's own flags
    layouts = {"tp2": ("2", "1"), "pp2": ("1", "2"), "tp2 pp2": ("2", "2")}
    sets, names = [], []
    for name, (tp, pp) in layouts.items():
        layout = with_flag(with_flag(flags, "--tensor-model-parallel-size", tp),
                           "--pipeline-model-parallel-size", pp)
        sets.append([*layout, *BYTESCALE_ADDITIONS])
        names.append(name)
    sets.append([*sets[-1], "--num-layers-per-virtual-pipeline-stage", "4"])
    names.append("virtual stages")
    results = dict(zip(names, validate_megatron_flags(patched_megatron_lm, sets, LAYOUT_ARGS,
                                                      world_size=8)))
    for name, (tp, pp) in layouts.items():
        result = results[name]
        assert not result.refused, f"{name}: {_said(result)}"
        values = result.values
        assert (values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"]) == (
            int(tp), int(pp))
        assert values["data_parallel_size"] == 8 // (int(tp) * int(pp))
        assert values["sequence_parallel"] is (tp == "2")
        assert values["calculate_per_token_loss"] and values["dataloader_type"] == "external"
        assert values["bytescale_hdp"] and values["bytescale_capacity"] == 4096
        assert values["virtual_pipeline_model_parallel_size"] is None
        assert values["overlap_grad_reduce"] and values["overlap_param_gather"]  # the example's
    vpp = results["virtual stages"]
    assert vpp.refused and "interleaved pipeline stages" in _said(vpp)


def _said(result) -> str:
    """A refusal's message and what it printed (the plugin reports on stderr, then exits 2)."""
    return f"{result.message}\n{result.stderr}"


PRETRAIN = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
            "--seq-length", "512", "--max-position-embeddings", "512",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", "3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
            "--transformer-impl", "local", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--lr-decay-style", "constant", "--use-cpu-initialization", "--clip-grad", "0.0",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
            "--no-persist-layer-norm", "--distributed-backend", "gloo", "--seed", "1234",
            "--bytescale-hdp", "--bytescale-capacity", "256"]


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"HDPLOSS (\S+)", stdout)]


@pytest.fixture(scope="module")
def parallel_runs(patched_megatron_lm, tmp_path_factory):
    """Megatron initialises weights differently for every TP / PP layout (per-stage seeds,
    per-rank shards), so the runs start from one checkpoint: 2 ranks (HDP 2) train one iteration
    and save it; then HDP 2 alone, HDP 2 with activation offload and TP 2 x PP 2 with sequence
    parallelism (4 ranks, HDP 1) load its weights (``--finetune``: fresh optimizer, iteration 0; Megatron's distributed
    checkpoint reshards them) and train three iterations on the same data. Their stdout by name.
    """
    workdir = tmp_path_factory.mktemp("pretrain-parallel")
    write_indexed_dataset(workdir / "text_document", random_documents(5, 200, vocab=255))
    data = ["--data-path", str(workdir / "text_document"), "--split", "98,1,1"]
    ckpt = workdir / "ckpt"
    layouts = {
        "save": (2, ["--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"]),
        "hdp2": (2, ["--load", str(ckpt), "--finetune"]),
        "hdp2 offload": (2, ["--load", str(ckpt), "--finetune", "--bytescale-offload"]),
        "tp2 pp2 sp": (4, ["--load", str(ckpt), "--finetune", "--tensor-model-parallel-size",
                           "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                           "--bytescale-capacity", "512"]),
        # interleaved stages: 2 chunks of 1 layer per stage, HDP 2
        "pp2 vpp2": (4, ["--load", str(ckpt), "--finetune", "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"]),
    }

    def run(name: str) -> str:
        ranks, layout = layouts[name]
        cache = ["--data-cache-path", str(workdir / ("cache " + name))]  # none shared
        result = run_pretrain_gpt(patched_megatron_lm, *PRETRAIN, *data, *cache, *layout,
                                  ranks=ranks, cwd=workdir)
        assert result.returncode == 0, f"{name}: {result.tail()}"
        return result.stdout

    runs = {"save": run("save")}
    # the four runs from the checkpoint two at a time: a run's ranks leave a core idle while
    # they wait on each other
    with ThreadPoolExecutor(max_workers=2) as pool:
        names = ["hdp2", "tp2 pp2 sp", "hdp2 offload", "pp2 vpp2"]  # a 2-rank run beside a 4
        runs.update(zip(names, pool.map(run, names)))
    return runs


def test_patched_pretrain_gpt_trains_with_tp_and_pp(parallel_runs):
    """TP 2 x PP 2 (+ SP), and PP 2 x 2 virtual stages, through Megatron's own loop give the
    losses of TP 1 / PP 1."""
    base, run = _losses(parallel_runs["hdp2"]), _losses(parallel_runs["tp2 pp2 sp"])
    assert len(base) == 3 and len(run) == 3
    for a, b in zip(base, run):
        assert abs(a - b) / abs(a) <= TOLERANCE, (base, run)
    assert len(set(base)) == 3  # the three steps differ (the model trains)
    # core_v0.19.0 prints a "gtp_remat r/w" field between the TP and PP ranks
    for name, layout in (("hdp2", r"t 1/1, (?:gtp_remat \d+/\d+, )?p 1/1"),
                         ("tp2 pp2 sp", r"t 1/2, (?:gtp_remat \d+/\d+, )?p 1/2")):
        # --finetune: the weights of iteration 1, the iteration counter back at 0
        assert re.search(r"successfully loaded checkpoint from .*\[ " + layout +
                         r" \] at iteration 0", parallel_runs[name]), name
    # PP 2 x VPP 2 x HDP 2: the interleaved driver under Megatron-LM's own loop, same losses
    vpp = _losses(parallel_runs["pp2 vpp2"])
    assert len(vpp) == 3
    for a, b in zip(base, vpp):
        assert abs(a - b) / abs(a) <= TOLERANCE, (base, vpp)
    checks = re.findall(r"HDPCHECK rank (\d) micro_batches (\d+)", parallel_runs["tp2 pp2 sp"])
    assert {int(r) for r, _ in checks} == {0, 1, 2, 3}, "every rank ran HDP steps"
    # every TP rank and stage of the one replica ran the same planned micro-batches
    assert len({n for _, n in checks[-4:]}) == 1


def _summaries(stdout: str) -> list[dict[str, float]]:
    """The ``[ByteScale HDP]`` line of every training step: largest ring, offload numbers."""
    out = []
    for line in re.findall(r"\[ByteScale HDP\] iteration .*", stdout):
        rings = re.search(r"\| rings ([\dx ]+) \|", line).group(1).split()
        offload = re.search(r"offloaded micro-batches (\d+)(?: \| offload ([\d.]+) MB, peak "
                            r"saved ([\d.]+) MB)?", line)
        out.append({"largest ring": max(int(r.split("x")[0]) for r in rings),
                    "offloaded mbs": int(offload.group(1)),
                    "offload MB": float(offload.group(2) or "nan"),
                    "peak saved MB": float(offload.group(3) or "nan")})
    return out


def test_patched_pretrain_gpt_trains_with_activation_offload(parallel_runs):
    """``--bytescale-offload`` through Megatron's own loop: documents longer than the capacity
    go on fewer ranks with part of their activations in host memory (the bytes are in the
    summary and Megatron's iteration line), and the losses equal the run without offload."""
    base, run = _losses(parallel_runs["hdp2"]), _losses(parallel_runs["hdp2 offload"])
    assert len(run) == 3
    for a, b in zip(base, run):
        assert abs(a - b) / abs(a) <= TOLERANCE, (base, run)
    plain, offload = _summaries(parallel_runs["hdp2"]), _summaries(parallel_runs["hdp2 offload"])
    assert len(plain) == len(offload) == 3
    assert all(s["offloaded mbs"] == 0 and s["offload MB"] != s["offload MB"] for s in plain)
    assert any(s["largest ring"] == 2 for s in plain)  # the data needs a ring without offload
    assert any(s["offloaded mbs"] > 0 for s in offload)
    for s in offload:  # measured bytes moved where micro-batches were planned with offload
        assert (s["offload MB"] > 0) == (s["offloaded mbs"] > 0) and s["peak saved MB"] > 0
    assert sum(s["largest ring"] for s in offload) < sum(s["largest ring"] for s in plain)
    lines = [x for x in parallel_runs["hdp2 offload"].splitlines()
             if re.search(r"\] iteration\s+\d+/", x)]
    assert len(lines) == 3 and all("hdp offload MB: " in x and "hdp peak saved MB: " in x
                                   for x in lines)


def launcher_flags(tree: PatchedMegatronLM, **env: str) -> list[str]:
    """The ``pretrain_gpt.py`` flags ``scripts/pretrain_gpt_bytescale.sh`` would run with
    (``DRY_RUN=1``; mock data, placeholder paths)."""
    script = repository_root() / "scripts" / "pretrain_gpt_bytescale.sh"
    run = subprocess.run(["bash", str(script), "ckpt", "tb", "vocab.json", "merges.txt", "mock"],
                         env=dict(os.environ, DRY_RUN="1", MEGATRON_LM_DIR=str(tree.root), **env),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    words = shlex.split(run.stdout.split("&&", 1)[1])
    return words[words.index("pretrain_gpt.py") + 1:]


def test_the_multi_node_launcher_example_passes_validate_args(patched_megatron_lm):
    env = dict(NUM_NODES="4", GPUS_PER_NODE="8", NODE_RANK="1", TP_SIZE="4", PP_SIZE="2")
    flags = launcher_flags(patched_megatron_lm, **env)
    single = launcher_flags(patched_megatron_lm)
    multi, one_node = validate_megatron_flags(patched_megatron_lm, [flags, single], LAYOUT_ARGS,
                                              world_size=32)
    assert not multi.refused, _said(multi)
    assert (multi.values["tensor_model_parallel_size"], multi.values["pipeline_model_parallel_size"],
            multi.values["data_parallel_size"], multi.values["sequence_parallel"]) == (4, 2, 4, True)
    assert multi.values["bytescale_hdp"] and multi.values["calculate_per_token_loss"]
    assert not one_node.refused, _said(one_node)
    assert one_node.values["data_parallel_size"] == 32
    bad = subprocess.run(["bash", str(repository_root() / "scripts" / "pretrain_gpt_bytescale.sh"),
                          "c", "t", "v", "m", "mock"], capture_output=True, text=True,
                         env=dict(os.environ, DRY_RUN="1", MEGATRON_LM_DIR="/x", TP_SIZE="3"))
    assert bad.returncode == 2 and "not divisible by TP_SIZE x PP_SIZE = 3" in bad.stderr
