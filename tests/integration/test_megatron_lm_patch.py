"""The Megatron-LM patch against a real Megatron-LM tree, through its own ``pretrain_gpt.py``.

The tree is ``$MEGATRON_LM_DIR`` or, by default, the unmodified tree in ``shared/megatron-lm``
beside the repository at the tag of the installed megatron-core (core_v0.16.1 or core_v0.19.0); the session fixture ``patched_megatron_lm``
(``conftest.py``) copies it to a temporary folder and applies the patch with
``scripts/apply_megatron_patches.sh``. These tests then parse real Megatron flags with the
patched ``validate_args`` and run the patched ``pretrain_gpt.py`` for four iterations on 1 and 2
CPU ranks (``megatron_bytescale.testing.cpu_pretrain`` stands in for Megatron's CUDA start-up
calls), compare the losses, and resume from a checkpoint. They run in CI (``.ci/run`` makes a
missing tree or package a failure, not a skip).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from megatron_bytescale.integration.compat import batch_size_ramp_flags, megatron_core_version
from megatron_bytescale.testing.megatron_lm import (
    MEGATRON_LM_TAG,
    PatchedMegatronLM,
    run_pretrain_gpt,
    validate_megatron_flags,
)

from .megatron_lm_cases import TOLERANCE, random_documents, write_indexed_dataset

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "patches" / f"megatron-lm-{MEGATRON_LM_TAG}.patch"


def test_patch_applies_to_megatron_lm_tree(patched_megatron_lm_tree):
    tree = patched_megatron_lm_tree
    assert tree.apply.returncode == 0, tree.apply.stdout + tree.apply.stderr
    assert "Applied" in tree.apply.stdout
    assert tree.reapply.returncode == 0 and "already applied" in tree.reapply.stdout
    reverse = subprocess.run(["git", "apply", "--reverse", "--check", str(PATCH)], cwd=tree.root,
                             capture_output=True, text=True)
    assert reverse.returncode == 0, reverse.stderr
    for name in ("pretrain_gpt.py", "megatron/training/arguments.py",
                 "megatron/training/training.py"):
        assert "megatron_bytescale" in (tree.root / name).read_text()
        assert "megatron_bytescale" not in (tree.source / name).read_text()  # never edited


TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
            "--transformer-impl", "local", "--attention-dropout", "0.0"]
ARGS = ("context_parallel_size", "data_parallel_size", "calculate_per_token_loss",
        "dataloader_type", "bytescale_capacity", "bytescale_context_length")


def test_patched_megatron_parses_and_validates_bytescale_flags(patched_megatron_lm):
    hdp = [*TINY_GPT, "--bytescale-hdp"]
    by_samples = [*hdp]  # Megatron ramps the batch only for sample-based training
    at = by_samples.index("--train-iters")
    by_samples[at:at + 2] = ["--train-samples", "12"]
    ok, cp, pp, plain, forgot, default, ramp = validate_megatron_flags(patched_megatron_lm, [
        [*hdp, "--bytescale-capacity", "128"],
        [*hdp, "--context-parallel-size", "2"],
        [*hdp, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
         "--num-layers-per-virtual-pipeline-stage", "1", "--no-overlap-p2p-communication"],
        TINY_GPT,
        [*TINY_GPT, "--bytescale-capacity", "128"],  # forgot --bytescale-hdp
        [*TINY_GPT, "--bytescale-scheduler", "balance"],  # its default, given
        [*by_samples, "--rampup-batch-size", "2", "2", "4"],
    ], ARGS, world_size=4)
    # --rampup-batch-size: 0.16.1's loop ramps with it; 0.19's ignores it, so HDP refuses it
    # there, naming the flag and the equivalent --step-batch-size-schedule (0:2, then 4 from
    # 4 samples = 2,048 tokens of --seq-length 512)
    if megatron_core_version() < (0, 17, 0):
        assert not ramp.refused, ramp
    else:
        assert (ramp.error, ramp.message) == ("SystemExit", "2")
        assert "--rampup-batch-size is ignored by Megatron-LM core_v0.19" in ramp.stderr
        assert '--step-batch-size-schedule "0:2 2048:4"' in ramp.stderr
    assert ok.values == dict(zip(ARGS, (1, 4, True, "external", 128, 512))), ok
    # refusals: one report from rank 0 and exit status 2, no traceback
    assert (cp.error, cp.message) == ("SystemExit", "2") and "--context-parallel-size 2" in cp.stderr
    assert (pp.error, pp.message) == ("SystemExit", "2")
    assert "--no-overlap-p2p-communication cannot be combined with interleaved pipeline stages" in pp.stderr
    # flag off: Megatron's own behaviour
    assert plain.values["calculate_per_token_loss"] is False
    assert plain.values["dataloader_type"] == "single"
    # a ByteScale flag without the switch would be silently ignored: refused, naming it
    for refused, flag in ((forgot, "--bytescale-capacity"), (default, "--bytescale-scheduler")):
        assert (refused.error, refused.message) == ("SystemExit", "2"), refused
        assert refused.stderr.count("\n") == 1
        assert f"{flag} given without --bytescale-hdp" in refused.stderr


PRETRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
                  "--seq-length", "512", "--max-position-embeddings", "512",
                  "--micro-batch-size", "1", "--lr", "1e-3",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                  "--transformer-impl", "local", "--swiglu", "--normalization", "RMSNorm",
                  "--qk-layernorm", "--recompute-granularity", "full", "--recompute-method",
                  "uniform", "--recompute-num-layers", "1",
                  "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                  "--lr-decay-style", "constant", "--use-cpu-initialization", "--clip-grad", "0.0",
                  "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
                  "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                  "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                  "--no-persist-layer-norm", "--distributed-backend", "gloo", "--seed", "1234",
                  "--bytescale-hdp"]
# Batch-size ramp-up 2 -> 4 over 4 samples: steps of 2, 2, 4, 4 samples (x 512 tokens), with
# the flags of the installed Megatron-LM (0.16.1: --global-batch-size 4 --rampup-batch-size 2 2 4;
# 0.19: --step-batch-size-schedule "0:2 2048:4" --eval-global-batch-size 4).
RAMPUP = [*batch_size_ramp_flags([2, 2, 4], global_batch_size=4, seq_length=512),
          "--train-samples", "12"]
STEP_SAMPLES = [2, 2, 4, 4]


def _pretrain(tree: PatchedMegatronLM, workdir: Path, ranks: int, *flags: str,
              launcher: str = "fork") -> str:
    """Run the patched pretrain_gpt.py on ``ranks`` CPU processes; its stdout."""
    run = run_pretrain_gpt(tree, *PRETRAIN_FLAGS, *flags, ranks=ranks, cwd=workdir,
                           launcher=launcher)
    assert run.returncode == 0, run.tail()
    return run.stdout


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"HDPLOSS (\S+)", stdout)]


@pytest.fixture(scope="module")
def pretrain_runs(patched_megatron_lm, tmp_path_factory):
    """Four iterations (evaluation at 2 and 4) with a batch-size ramp-up on a weighted blend of
    two indexed datasets, on 2 ranks (capacity 256, checkpoints at 2 and 4 in
    ``runs["ckpt"]``, TensorBoard in ``runs["tensorboard"]``) and on 1 (512); the data flags
    are under the key ``"data"``."""
    workdir = tmp_path_factory.mktemp("pretrain")
    write_indexed_dataset(workdir / "a_text_document", random_documents(3, 200, vocab=255))
    write_indexed_dataset(workdir / "b_text_document", random_documents(4, 100, vocab=255))
    data = ["--data-path", "0.7", str(workdir / "a_text_document"), "0.3",
            str(workdir / "b_text_document"), "--split", "90,5,5", *RAMPUP]
    runs: dict[Any, Any] = {"data": data, "ckpt": workdir / "ckpt"}
    runs["tensorboard"] = workdir / "tensorboard"
    runs[2] = _pretrain(patched_megatron_lm, workdir, 2, *data, "--bytescale-capacity", "256",
                        "--save", str(runs["ckpt"]), "--save-interval", "2",
                        "--tensorboard-dir", str(runs["tensorboard"]),
                        launcher="torchrun")  # as users launch it; the other runs fork
    runs[1] = _pretrain(patched_megatron_lm, workdir, 1, *data, "--bytescale-capacity", "512")
    return runs


def _train_steps(stdout: str) -> list[tuple[int, int]]:
    """(micro-batches summed over ranks, global-batch tokens) of each training step."""
    checks = re.findall(r"HDPCHECK rank (\d) micro_batches (\d+) rings \[[^\]]*\] "
                        r"forward_only False tokens (\d+)", stdout)
    ranks = len({rank for rank, _, _ in checks})
    steps = [checks[i:i + ranks] for i in range(0, len(checks), ranks)]
    return [(sum(int(c[1]) for c in step), int(step[0][2])) for step in steps]


def test_patched_pretrain_gpt_trains_on_cpu_ranks(pretrain_runs):
    """The patched train loop on 2 ranks (rings, per-rank counts) equals 1 rank, step by step,
    on a weighted blend with the token budget growing as Megatron ramps the batch size up."""
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
    for run in (pretrain_runs[1], pretrain_runs[2]):
        tokens = [t for _, t in _train_steps(run)]
        assert len(tokens) == 4
        for got, samples in zip(tokens, STEP_SAMPLES):
            assert samples * 512 - 2 < got <= samples * 512
        assert re.findall(r"global batch size:\s+(\d+)", run) == ["2", "2", "4", "4"]


def _per_step_counts(stdout: str) -> list[list[int]]:
    """Micro-batches of every rank, per training step (from the probe)."""
    checks = re.findall(r"HDPCHECK rank (\d) micro_batches (\d+) rings \[[^\]]*\] "
                        r"forward_only False", stdout)
    ranks = len({rank for rank, _ in checks})
    return [[int(c[1]) for c in checks[i:i + ranks]] for i in range(0, len(checks), ranks)]


def test_hdp_metrics_reach_megatron_log_line_and_tensorboard(pretrain_runs):
    """Every iteration line carries the HDP metrics, a summary line precedes it, and Megatron's
    TensorBoard writer records them per step (W&B, when on, gets the same keys from Megatron)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = pretrain_runs[2]
    counts = _per_step_counts(run)
    assert len(counts) == 4
    lines = [x for x in run.splitlines() if re.search(r"\] iteration\s+\d+/", x)]
    assert len(lines) == 4
    for name in ("hdp mb/rank max", "hdp busy max s", "hdp idle frac", "hdp p2p MB",
                 "hdp est. balance", "hdp rings>1"):
        assert all(f"{name}: " in line for line in lines), name
    summaries = re.findall(r"\[ByteScale HDP\] iteration\s+(\d+) \| rings ([\dx ]+) \| "
                           r"micro-batches/rank min/mean/max (\d+)/([\d.]+)/(\d+) \| "
                           r"estimated balance ([\d.]+) \| busy max ([\d.]+) s", run)
    assert [int(s[0]) for s in summaries] == [1, 2, 3, 4]
    for summary, step in zip(summaries, counts):
        assert (int(summary[2]), int(summary[4])) == (min(step), max(step))
        assert float(summary[3]) == pytest.approx(sum(step) / len(step), abs=0.005)
        assert "2x" in summary[1] or "1x" in summary[1]
    events = EventAccumulator(str(next(pretrain_runs["tensorboard"].glob("events.*"))))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"hdp mb/rank min", "hdp mb/rank max", "hdp busy max s", "hdp p2p MB",
            "hdp plan wait ms", "hdp offloaded mb"} <= scalars
    assert any(t.startswith("hdp rings of size ") for t in scalars)
    written = {e.step: e.value for e in events.Scalars("hdp mb/rank max")}
    assert written == {i + 1: max(step) for i, step in enumerate(counts)}


def test_patched_pretrain_gpt_resumes_from_a_checkpoint(patched_megatron_lm, pretrain_runs,
                                                        tmp_path):
    """Load the checkpoint of iteration 2 (mid ramp-up), train 3-4: the same batch sizes and
    losses as the uninterrupted run."""
    ckpt, data = pretrain_runs["ckpt"], pretrain_runs["data"]
    assert (ckpt / "iter_0000002").is_dir() and (ckpt / "iter_0000004").is_dir()
    resume = tmp_path / "ckpt"
    shutil.copytree(ckpt / "iter_0000002", resume / "iter_0000002")
    (resume / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _pretrain(patched_megatron_lm, tmp_path, 2, *data, "--bytescale-capacity", "256",
                        "--load", str(resume))
    assert re.search(r"successfully loaded checkpoint from .* at iteration 2", resumed)
    straight = _losses(pretrain_runs[2])
    assert len(_losses(resumed)) == 2
    assert _train_steps(resumed) == _train_steps(pretrain_runs[2])[2:]
    for a, b in zip(_losses(resumed), straight[2:]):
        assert abs(a - b) / abs(a) <= TOLERANCE


@pytest.mark.one_lane(reason="the Ray actors plan and read the same HDP steps with any megatron-core; "
                      "the data path they feed is checked on both lanes by the local loader's runs")
def test_the_ray_loader_trains_as_the_local_one(patched_megatron_lm, pretrain_runs, tmp_path):
    """``--bytescale-dataloader ray`` through the patched pretrain_gpt.py on 2 ranks: rank 0
    starts a Ray instance and the actors, rank 1 joins them; every loss (training with the
    ramp-up, on the weighted blend) equals the local loader's run: same plans, same tokens."""
    import importlib.util
    import os

    if importlib.util.find_spec("ray") is None:
        if os.environ.get("BYTESCALE_REQUIRE_RAY"):
            raise AssertionError("Ray is not installed (bash scripts/test.sh installs it)")
        pytest.skip("Ray is not installed: pip install 'megatron_bytescale[ray]'")
    run = _pretrain(patched_megatron_lm, tmp_path, 2, *pretrain_runs["data"],
                    "--bytescale-capacity", "256", "--bytescale-dataloader", "ray")
    assert "ray loader" in run
    assert _losses(run) == _losses(pretrain_runs[2]) and len(_losses(run)) == 4
