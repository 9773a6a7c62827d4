"""The CPU demo: settings checks, the report's arithmetic, and one small end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_bytescale.tools.demo_report import comparison_rows, summarize
from megatron_bytescale.tools.demo_settings import DemoSettings


def test_settings_refuse_a_context_the_ranks_cannot_hold():
    with pytest.raises(ValueError, match="--bytescale-context-length"):
        DemoSettings(ranks=4, capacity=512, context_length=4096)
    with pytest.raises(ValueError, match="--modes"):
        DemoSettings(modes=("fast",))
    assert DemoSettings().static_cp_size == 4


def _mode(label, busy, wall, p2p, loss):
    steps = [
        {
            "tokens": 1000,
            "wall_s": w,
            "busy_s": b,
            "p2p_bytes": p,
            "loss": l,
            "micro_batches": [1, 1],
        }
        for b, w, p, l in zip(busy, wall, p2p, loss)
    ]
    return {"label": label, "steps": steps}


def test_report_averages_skip_the_warm_up_step_and_compare_with_static():
    results = {
        "datasets": {
            "d": {
                "description": "",
                "modes": {
                    "static": _mode(
                        "S", [[9, 9], [2, 2], [2, 2]], [9, 1, 1], [0, 100, 300], [3, 2, 1]
                    ),
                    "balance": _mode(
                        "B", [[9, 9], [1, 0.5], [1, 0.5]], [9, 0.5, 0.5], [0, 10, 30], [3, 2, 1]
                    ),
                },
            }
        }
    }
    static, balance = summarize(results)["d"]
    assert (static.tokens_per_s, balance.tokens_per_s) == (1000.0, 2000.0)
    assert (balance.max_busy_s, balance.mean_busy_s) == (1.0, 0.75)
    assert balance.p2p_bytes == 20 and static.p2p_bytes == 200
    headers, rows = comparison_rows([static, balance])
    assert rows[1][headers.index("vs static")] == "2.00x"
    assert rows[1][headers.index("P2P MB/step") + 1] == "0.10x"


FATAL_MARKERS = ("terminate called", "Fatal Python error", "Aborted", "Segmentation fault", "exception not rethrown")


def fatal_lines(stderr: str) -> str:
    """The lines of a worker's crash that torchrun's summary (the tail) pushes out of view."""
    lines = [line for line in stderr.splitlines() if any(m in line for m in FATAL_MARKERS)]
    return "\n".join(lines[:20]) + "\n" if lines else ""


def run_small_demo(out, *flags: str, layers: int = 1, steps: int = 3):
    """``bytescale demo`` with a tiny model; returns the finished process (checked)."""
    command = [
        sys.executable, "-m", "megatron_bytescale.cli", "demo", "--steps", str(steps),
        "--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--ffn-hidden-size", "64", "--bytescale-capacity", "128",
        "--micro-batches-per-rank", "3", "--out", str(out), *flags,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + fatal_lines(done.stderr) + done.stderr[-3000:]
    return done


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    done = run_small_demo(out)
    results = json.loads((out / "results.json").read_text())
    modes = results["datasets"]["stdlib"]["modes"]
    assert set(modes) == {"static", "naive", "balance"}
    losses = {m: [s["loss"] for s in modes[m]["steps"]] for m in modes}
    assert all(len(v) == 3 for v in losses.values())
    for m in ("naive", "balance"):
        assert max(abs(a - b) for a, b in zip(losses[m], losses["static"])) <= 1e-4
    sent = {m: sum(s["p2p_bytes"] for s in modes[m]["steps"]) for m in modes}
    assert sent["balance"] < sent["static"]
    settings = results["settings"]
    tokens_per_step = settings["ranks"] * settings["capacity"] * settings["micro_batches_per_rank"]
    for m, mode in modes.items():
        for s in mode["steps"]:
            # every token of the global batch trains once: the batch, the plan and the ranks agree
            assert tokens_per_step - 1 <= s["batch_tokens"] <= tokens_per_step
            assert s["tokens"] == s["batch_tokens"] == sum(s["rank_tokens"]), (m, s)
            assert s["loss_tokens"] == s["tokens"] - s["sequences"], (m, s)
            # every micro-batch of every ring is counted once per member
            assert sum(s["micro_batches"]) == sum(int(size) * n for size, n in s["ring_sizes"].items())
            # what the counters measured is what the runtime formula says the plan sends
            assert s["p2p_bytes"] == s["p2p_bytes_formula"], (m, s)
    assert all(s["p2p_bytes"] > 0 for s in modes["static"]["steps"])  # static CP always rings
    assert "HDP balance" in done.stdout and "vs static" in done.stdout
    assert (out / "demo.png").stat().st_size > 0
    # the calibrated cost model is saved for reuse (--bytescale-cost-model) and has the ring
    # step overhead the CPU calibration measured
    saved = json.loads((out / "cost_model.json").read_text())
    assert saved == results["calibration"]["cost_model"]
    assert saved["num_layers"] == 1
    # the header reports the numbers the planner then uses (the same model, to the digit shown)
    header = next(line for line in done.stdout.splitlines() if "cost model (per layer" in line)
    assert f"{saved['alpha1']:.3g} s^2 + {saved['beta1']:.3g} s + {saved['gamma']:.3g} seconds" in header
    assert f"ring step overhead {saved['ring_step_overhead_s'] * 1e3:.2f} ms per layer" in header
    # every step is recorded well enough for the simulator to replan it identically
    from megatron_bytescale.sim.demo_validation import validate_demo

    for v in validate_demo(results, skip_first=False):
        assert v.plans_matching == v.steps == 3, (v.dataset, v.mode)
        assert len(v.samples) == sum(sum(s["micro_batches"]) for s in modes[v.mode]["steps"])
        assert all(s.measured_s > 0 and s.predicted_s > 0 for s in v.samples)


def test_demo_refuses_flags_it_would_ignore_and_unreadable_cost_models(tmp_path):
    from megatron_bytescale.tools.demo_cmd import build_parser, settings_from_args

    parser = build_parser()
    with pytest.raises(ValueError, match="--bytescale-scheduler.*--modes"):
        settings_from_args(parser.parse_args(["--bytescale-scheduler", "naive"]))
    with pytest.raises(ValueError, match="--bytescale-cost-model.*missing.json"):
        settings_from_args(parser.parse_args(["--bytescale-cost-model", str(tmp_path / "missing.json")]))
    with pytest.raises(ValueError, match="--bytescale-dataloader ray serves pretrain_gpt.py"):
        settings_from_args(parser.parse_args(["--bytescale-dataloader", "ray"]))
    settings = settings_from_args(parser.parse_args(["--bytescale-plan-prefetch", "0"]))
    assert settings.plan_prefetch == 0


def test_demo_offload_mode_puts_long_sequences_on_fewer_ranks_with_the_same_loss(tmp_path):
    """``--bytescale-offload`` adds HDP balance with selective offload next to the other modes."""
    out = tmp_path / "demo"
    done = run_small_demo(out, "--modes", "balance", "--bytescale-offload", "--data", "synthetic-byted",
                          "--no-plot", layers=4, steps=2)
    results = json.loads((out / "results.json").read_text())
    modes = results["datasets"]["synthetic-byted"]["modes"]
    assert set(modes) == {"balance", "offload"}
    plain, offload = modes["balance"]["steps"], modes["offload"]["steps"]
    for a, b in zip(plain, offload):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
    assert sum(s["offloaded_bytes"] for s in offload) > 0
    assert all(s["offloaded_bytes"] == 0 for s in plain)
    assert max(s["max_ring_size"] for s in offload) < max(s["max_ring_size"] for s in plain)
    assert all(s["peak_saved_bytes"] for s in plain + offload)
    assert "HDP offload" in done.stdout and "offloaded MB/step" in done.stdout
