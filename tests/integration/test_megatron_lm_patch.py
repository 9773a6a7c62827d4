"""The Megatron-LM patch against a real checkout (skipped unless ``MEGATRON_LM_DIR`` is set).

With ``MEGATRON_LM_DIR`` pointing to a Megatron-LM checkout at tag core_v0.16.1, these tests
apply the patch to a throw-away worktree (or copy) of it with
``scripts/apply_megatron_patches.sh``; if that tree's ``megatron.training`` also imports
(extra packages six, regex, pydantic, pyyaml and triton can be put on
``MEGATRON_LM_PYTHONPATH``), they parse real Megatron flags with the patched ``validate_args``
and run the patched ``pretrain_gpt.py`` for four iterations on 1 and 2 CPU ranks (CPU
stand-ins for Megatron's CUDA calls, see ``CPU_PRETRAIN``), compare the losses, and resume
from a checkpoint. CI has no Megatron-LM checkout (``megatron.training`` is not in the
megatron-core wheel), so there they skip with that reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .megatron_lm_cases import TOLERANCE, random_documents, write_indexed_dataset

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
APPLY = REPO / "scripts" / "apply_megatron_patches.sh"


def _megatron_lm_dir() -> Path:
    value = os.environ.get("MEGATRON_LM_DIR")
    if not value:
        pytest.skip("MEGATRON_LM_DIR is not set: point it to a Megatron-LM checkout at tag "
                    "core_v0.16.1 to test the patch against it")
    path = Path(value)
    if not (path / "pretrain_gpt.py").is_file():
        pytest.fail(f"MEGATRON_LM_DIR={value} is not a Megatron-LM checkout (no pretrain_gpt.py)")
    return path


@pytest.fixture(scope="module")
def patched_megatron(tmp_path_factory):
    """A patched throw-away tree of $MEGATRON_LM_DIR (a git worktree at the tag, else a copy)."""
    source = _megatron_lm_dir()
    target = tmp_path_factory.mktemp("megatron") / "Megatron-LM"
    worktree = subprocess.run(
        ["git", "-C", str(source), "worktree", "add", "--detach", str(target), "core_v0.16.1"],
        capture_output=True, text=True,
    )
    if worktree.returncode != 0:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git"))
    first = subprocess.run(["bash", str(APPLY), str(target)], capture_output=True, text=True)
    second = subprocess.run(["bash", str(APPLY), str(target)], capture_output=True, text=True)
    yield target, first, second
    if worktree.returncode == 0:
        subprocess.run(["git", "-C", str(source), "worktree", "remove", "--force", str(target)],
                       capture_output=True)


def test_patch_applies_to_megatron_lm_checkout(patched_megatron):
    target, first, second = patched_megatron
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Applied" in first.stdout
    assert second.returncode == 0 and "already applied" in second.stdout
    reverse = subprocess.run(["git", "apply", "--reverse", "--check", str(PATCH)], cwd=target,
                             capture_output=True, text=True)
    assert reverse.returncode == 0, reverse.stderr
    for name in ("pretrain_gpt.py", "megatron/training/arguments.py",
                 "megatron/training/training.py"):
        assert "megatron_bytescale" in (target / name).read_text()


def _megatron_env(target: Path) -> dict[str, str]:
    extra = os.environ.get("MEGATRON_LM_PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(target), extra) if p),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    probe = subprocess.run([sys.executable, "-c", "import megatron.training.arguments"],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        missing = probe.stderr.strip().splitlines()[-1:] or ["?"]
        pytest.skip(f"megatron.training of the patched tree does not import ({missing[0]}); put "
                    "six, regex, pydantic, pyyaml and triton on MEGATRON_LM_PYTHONPATH")
    return env


PARSE = textwrap.dedent("""
    import json, sys
    from megatron.training.arguments import parse_args, validate_args
    from megatron_bytescale.integration import megatron_lm
    sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
    import contextlib, io
    report = io.StringIO()
    try:
        with contextlib.redirect_stderr(report):
            args = validate_args(parse_args(megatron_lm.chain_extra_args_provider(None)), {})
    except SystemExit as exc:  # refusals: one report (rank 0), exit status 2
        print(f"REFUSED {exc.code} " + report.getvalue().replace(chr(10), " ")); sys.exit(0)
    print("RESULT " + json.dumps(dict(cp=args.context_parallel_size, dp=args.data_parallel_size,
          per_token=args.calculate_per_token_loss, dataloader=args.dataloader_type,
          capacity=args.bytescale_capacity, context=args.bytescale_context_length)))
""")

TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
            "--transformer-impl", "local", "--attention-dropout", "0.0"]


def test_patched_megatron_parses_and_validates_bytescale_flags(patched_megatron):
    target = patched_megatron[0]
    env = dict(_megatron_env(target), WORLD_SIZE="4", RANK="0")

    def parse(*flags):
        run = subprocess.run([sys.executable, "-c", PARSE, *TINY_GPT, *flags], env=env,
                             capture_output=True, text=True, cwd=target)
        lines = [x for x in run.stdout.splitlines() if x.startswith(("RESULT", "REFUSED"))]
        assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-3000:]
        return lines[-1]

    ok = json.loads(parse("--bytescale-hdp", "--bytescale-capacity", "128")[len("RESULT "):])
    assert ok == dict(cp=1, dp=4, per_token=True, dataloader="external", capacity=128,
                      context=512)
    assert "--context-parallel-size 2" in parse("--bytescale-hdp", "--context-parallel-size", "2")
    assert "--pipeline-model-parallel-size 2" in parse("--bytescale-hdp",
                                                       "--pipeline-model-parallel-size", "2")
    plain = json.loads(parse("--bytescale-capacity", "128")[len("RESULT "):])
    assert plain["per_token"] is False and plain["dataloader"] == "single"  # flag off: Megatron


# Run by torch.distributed.run on each CPU rank: the patched pretrain_gpt.py with CPU stand-ins
# for what Megatron's start-up and loop do with CUDA (these are outside the patch).
CPU_PRETRAIN = textwrap.dedent('''
    import contextlib, functools, os, runpy, sys
    import torch, torch.distributed as dist

    class FakeStream:
        def __init__(self, *a, **k): pass
        def wait_stream(self, *a, **k): pass
        def wait_event(self, *a, **k): pass
        def synchronize(self): pass
        def record_event(self, *a, **k): pass

    def cpu_stand_ins():
        from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron
        enable_cpu_megatron()
        torch.cuda.Stream = FakeStream
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.empty_cache = lambda: None
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
        torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                     "max_memory_reserved"):
            setattr(torch.cuda, name, lambda *a, **k: 0)
        import megatron.training.initialize as init
        import megatron.training.training as training
        from megatron.core import parallel_state, tensor_parallel
        from megatron.training.global_vars import get_args

        def initialize_distributed(*a, **k):  # Megatron skips MPU set-up without GPUs
            args = get_args()
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                context_parallel_size=args.context_parallel_size)
        init._initialize_distributed = initialize_distributed
        seed = init._set_random_seed
        def set_random_seed(seed_, *a, **k):
            seed(seed_, *a, **k)
            tensor_parallel.model_parallel_cuda_manual_seed(seed_)
        init._set_random_seed = set_random_seed
        init._compile_dependencies = lambda: None  # dataset C++ helpers, fused kernels: unused
        training.initialize_megatron = functools.partial(init.initialize_megatron,
                                                         allow_no_cuda=True)

    def probes():
        import megatron.training.training as training
        from megatron_bytescale.integration import megatron_lm_step
        run = megatron_lm_step.run_micro_batches
        def probed_run(step, **kw):
            rings = sorted(mb.ring_size for mb in step.micro_batches)
            print(f"HDPCHECK rank {dist.get_rank()} micro_batches {step.num_micro_batches} "
                  f"rings {rings} forward_only {kw.get('forward_only')}", flush=True)
            return run(step, **kw)
        megatron_lm_step.run_micro_batches = probed_run
        train_step = training.train_step
        def probed_train_step(*a, **k):
            out = train_step(*a, **k)
            if dist.get_rank() == dist.get_world_size() - 1:
                print(f"HDPLOSS {float(out[0]['lm loss']):.9f}", flush=True)
            return out
        training.train_step = probed_train_step

    torch.set_num_threads(1)
    mlm = os.environ["MEGATRON_LM_DIR"]
    sys.path.insert(0, mlm)
    cpu_stand_ins()
    probes()
    sys.argv = [os.path.join(mlm, "pretrain_gpt.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
''')

PRETRAIN_FLAGS = [*(f for f in TINY_GPT[:-4] if f != "--mock-data"), "--group-query-attention", "--num-query-groups", "2",
                  "--ffn-hidden-size", "128", "--transformer-impl", "local",
                  "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                  "--lr-decay-style", "constant", "--use-cpu-initialization", "--clip-grad", "0.0",
                  "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
                  "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                  "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                  "--no-persist-layer-norm", "--distributed-backend", "gloo", "--seed", "1234",
                  "--bytescale-hdp"]


def _pretrain(target: Path, workdir: Path, ranks: int, *flags: str) -> str:
    """Run the patched pretrain_gpt.py on ``ranks`` CPU processes; its stdout."""
    env = dict(_megatron_env(target), MEGATRON_LM_DIR=str(target))
    script = workdir / "cpu_pretrain.py"
    script.write_text(CPU_PRETRAIN)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(script), *PRETRAIN_FLAGS, *flags],
        env=env, capture_output=True, text=True, cwd=workdir, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"HDPLOSS (\S+)", stdout)]


@pytest.fixture(scope="module")
def pretrain_runs(patched_megatron, tmp_path_factory):
    """Four iterations (evaluation at 2 and 4) on 2 ranks (capacity 256) and on 1 (512), on an
    indexed dataset (``--data-path``); the data flags are under the key ``"data"``."""
    target = patched_megatron[0]
    workdir = tmp_path_factory.mktemp("pretrain")
    prefix = workdir / "corpus_text_document"
    write_indexed_dataset(prefix, random_documents(3, 200, vocab=255))
    data = ["--data-path", str(prefix), "--split", "90,5,5"]
    runs: dict[Any, Any] = {"data": data}
    for ranks in (2, 1):
        runs[ranks] = _pretrain(target, workdir, ranks, *data, "--train-iters", "4",
                                "--bytescale-capacity", str(512 // ranks))
    return runs


def test_patched_pretrain_gpt_trains_on_cpu_ranks(pretrain_runs):
    """The patched train loop on 2 ranks (rings, per-rank counts) equals 1 rank, step by step."""
    one, two = _losses(pretrain_runs[1]), _losses(pretrain_runs[2])
    assert len(one) == 4 and len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) / abs(a) <= TOLERANCE
    assert "validation loss at iteration 2" in pretrain_runs[2]
    checks = re.findall(r"HDPCHECK rank (\d) micro_batches (\d+) rings \[([^\]]*)\] "
                        r"forward_only (\w+)", pretrain_runs[2])
    rings = {int(r) for *_, ring_list, _ in checks for r in ring_list.split(", ") if r}
    assert 2 in rings, "the 2-rank run never formed a ring over both ranks"
    assert any(fo == "True" for *_, fo in checks), "evaluation did not run through the hook"


def test_patched_pretrain_gpt_resumes_from_a_checkpoint(patched_megatron, pretrain_runs,
                                                        tmp_path):
    """Save at iteration 2, load, train 3-4: the same losses as the uninterrupted run."""
    target = patched_megatron[0]
    env = _megatron_env(target)
    if subprocess.run([sys.executable, "-c", "import psutil"], env=env).returncode != 0:
        pytest.skip("Megatron's torch_dist checkpointing needs psutil; add it to "
                    "MEGATRON_LM_PYTHONPATH")
    ckpt, data = tmp_path / "ckpt", pretrain_runs["data"]
    _pretrain(target, tmp_path, 2, *data, "--train-iters", "2", "--bytescale-capacity", "256",
              "--save", str(ckpt), "--save-interval", "2")
    resumed = _pretrain(target, tmp_path, 2, *data, "--train-iters", "4",
                        "--bytescale-capacity", "256", "--load", str(ckpt),
                        "--override-opt_param-scheduler")
    straight = _losses(pretrain_runs[2])
    assert len(_losses(resumed)) == 2
    for a, b in zip(_losses(resumed), straight[2:]):
        assert abs(a - b) / abs(a) <= TOLERANCE
