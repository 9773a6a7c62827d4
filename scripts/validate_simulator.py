#!/usr/bin/env python
"""The simulator against measured CPU runs; writes section ``validation`` of docs/reproduction.md.

Runs ``bytescale demo`` on its three datasets (stdlib, synthetic-github, synthetic-byted: one
torchrun job, 4 CPU ranks, static / naive / balance on identical batches), or reads an earlier
run's ``results.json`` (``--results``). The demo calibrates its cost model on this machine and
records each step's lengths, plan hash, per-rank busy CPU time and per-micro-batch CPU time.
:mod:`megatron_bytescale.sim.demo_validation` replans every step with that cost model (same
plan hash), simulates it and compares; the residual per micro-batch is split into a uniform
slowdown and a per-document ring-step cost, fitted on two datasets and checked on the third.
Also writes ``docs/img/sim_validation.png``.

Usage: ``.venv/bin/python scripts/validate_simulator.py [--results out/validate/results.json] [--no-write]``
Extra arguments (after ``--``) go to ``bytescale demo``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import IMG_DIR, machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.planner.cost_model import CostModel  # noqa: E402
from megatron_bytescale.sim.demo_validation import (  # noqa: E402
    fit_residual_terms,
    ratio_by_documents,
    ratio_checks,
    validate_demo,
    without_document_term,
)

REPRODUCTION_MD = Path(__file__).resolve().parent.parent / "docs" / "reproduction.md"
DATASETS = "stdlib,synthetic-github,synthetic-byted,synthetic-rings"
GOAL_RATIO = 0.15
"""Goal for every step-time ratio between modes."""
GOAL_STEP = 0.25
"""Goal for every absolute step (the slowest rank's busy time)."""


def progress(msg: str) -> None:
    print(f"[validate_simulator] {msg}", file=sys.stderr, flush=True)


def run_demo(extra: list[str]) -> tuple[dict, str]:
    from megatron_bytescale.tools.demo_cmd import build_parser, run_demo_job, settings_from_args

    args = build_parser().parse_args(["--data", DATASETS, "--out", "out/validate", "--no-plot", *extra])
    before = os.getloadavg()
    # modes interleaved step by step: the machine's load drifts, and a ratio between modes must
    # compare them under the same load
    results = run_demo_job(dataclasses.replace(settings_from_args(args), interleave_modes=True))
    after = os.getloadavg()
    load = f"load average (1 min) {before[0]:.1f} before / {after[0]:.1f} after the demo"
    return results, load


def ok(err: float, goal: float = GOAL_RATIO) -> str:
    return f"{err:+.1%}" + ("" if abs(err) <= goal else " **miss**")


def section(results: dict, load: str) -> str:
    validations = validate_demo(results)
    cm = CostModel.from_dict(results["calibration"]["cost_model"])
    before = {(v.dataset, v.mode): v for v in validate_demo(results, timing_model=without_document_term(cm))}
    samples = [s for v in validations for s in v.samples]
    terms = fit_residual_terms(samples)
    s = results["settings"]
    checks = ratio_checks(validations)
    before_checks = {(c.dataset, c.ratio, c.kind): c for c in ratio_checks(list(before.values()))}
    mode_rows = []
    for v in validations:
        b = before[(v.dataset, v.mode)]
        mode_rows.append([v.dataset, v.mode, f"{v.plans_matching}/{v.steps}", f"{v.measured_max_busy_s:.3f}",
                          f"{v.predicted_max_busy_s:.3f}", ok(v.predicted_max_busy_s / v.measured_max_busy_s - 1, GOAL_STEP),
                          f"{b.predicted_max_busy_s:.3f}", f"{b.predicted_max_busy_s / v.measured_max_busy_s - 1:+.1%}",
                          " / ".join(f"{x:.2f}" for x in v.measured_busy_by_rank),
                          " / ".join(f"{x:.2f}" for x in v.predicted_busy_by_rank), f"{v.busy_error:.0%}"])
    busy_rows = []
    for c in checks:
        if c.kind != "busy":
            continue
        b = before_checks[(c.dataset, c.ratio, c.kind)]
        busy_rows.append([c.dataset, c.ratio, f"{c.measured:.2f}", f"{c.predicted:.2f}", ok(c.error),
                          f"{b.predicted:.2f}", f"{b.error:+.1%}"])
    wall_rows = [[c.dataset, c.ratio, f"{c.measured:.2f}", f"{c.predicted:.2f}", f"{c.error:+.1%}"]
                 for c in checks if c.kind == "wall"]
    doc_rows = [[k, d, str(n), f"{r:.2f}"] for k, d, n, r in ratio_by_documents(samples)]
    ratio_misses = [c for c in checks if c.kind == "busy" and abs(c.error) > GOAL_RATIO]
    step_misses = [v for v in validations if abs(v.predicted_max_busy_s / v.measured_max_busy_s - 1) > GOAL_STEP]
    gains = {c.dataset: c for c in checks if c.kind == "busy" and c.ratio == "naive / balance"}
    plot(validations)
    fit = results["calibration"].get("ring_fit")
    fit_lines: list[str] = []
    if fit:
        rows = []
        for (d, n, tokens, m), b, a in zip(fit["samples"], fit["before"], fit["after"]):
            rows.append([str(d), str(n), str(tokens), f"{m * 1e3:.1f}", f"{b * 1e3:.1f}", f"{(b - m) / m:+.1%}",
                         f"{a * 1e3:.1f}", f"{(a - m) / m:+.1%}"])
        fit_lines = [
            "**The calibration's own fit** (all layers, forward + backward, rank 0): every micro-batch the "
            "ring terms were fitted to, single sequences and many short documents on rings and as a local "
            "pack; 'before' = the ring step overhead alone (the previous calibration), 'after' = with the "
            "per-document term:",
            "",
            markdown_table(["ring size", "documents", "tokens", "measured ms", "before ms", "error",
                            "after ms", "error"], rows),
            "",
        ]
    return "\n".join([
        "### Validation: the simulator against measured `bytescale demo` runs (CPU)",
        "",
        f"{machine_line()} {results['world_size']} CPU ranks (gloo) on {results.get('cpu_count', '?')} cores; "
        f"{load}. Demo: {s['num_layers']}-layer GPT, hidden {s['hidden_size']}, C = {s['capacity']}, context "
        f"{s['context_length']}, {s['steps']} steps per mode (the first left out). Cost model: the demo's own "
        f"calibration on this machine, T(s) = {cm.alpha1:.3g} s^2 + {cm.beta1:.3g} s + {cm.gamma:.3g} s per layer, "
        f"P2P {cm.p2p_bandwidth_intra / 1e9:.2f} GB/s, {cm.p2p_latency_s * 1e6:.0f} us, ring step overhead "
        f"{cm.ring_step_overhead_s * 1e3:.2f} ms and {cm.per_document_s * 1e3:.3f} ms per document per ring step, "
        "per layer. Every step is replanned with it (column 'same plan': plan hashes equal to the demo's) and "
        "simulated.",
        "",
        "**How busy time is measured.** The step with one core per rank is the slowest rank's busy time: "
        "the CPU time of the rank's compute thread in its micro-batches (`time.thread_time`, torch with one "
        "intra-op thread; `megatron_bytescale/integration/busy_clock.py`), and the calibration times with "
        "the same clock. Waiting for a core, for a peer, or gloo's own helper threads do not count, so the "
        "4 ranks sharing 2 cores (and other work on the machine) do not enter the comparison the way wall "
        "time or process CPU time would.",
        "",
        f"**Step-time ratios** (goal: within {GOAL_RATIO:.0%}). 'without per-document term' times the same "
        "plans with the calibrated model minus that term (what the previous calibration gave):",
        "",
        markdown_table(["dataset", "ratio", "measured", "simulated", "error",
                        "simulated, without per-document term", "error"], busy_rows),
        "",
        ("All ratios within the goal." if not ratio_misses else
         f"{len(ratio_misses)} of {len(busy_rows)} ratios miss the {GOAL_RATIO:.0%} goal: "
         + ", ".join(f"{c.dataset} {c.ratio} ({c.error:+.0%})" for c in ratio_misses) + "; see 'which term is wrong'."),
        "Balance gain (naive / balance, measured): "
        + ", ".join(f"{d} {c.measured:.2f}x (simulated {c.predicted:.2f}x)" for d, c in gains.items()) + ".",
        "",
        f"**Per mode: the step with one core per rank** (means per step, seconds; goal: within {GOAL_STEP:.0%}):",
        "",
        markdown_table(["dataset", "mode", "same plan", "measured step", "simulated step", "error",
                        "simulated, without per-document term", "error",
                        "busy per rank measured", "busy per rank simulated", "per-rank error"], mode_rows),
        "",
        ("Every absolute step within the goal." if not step_misses else
         f"{len(step_misses)} of {len(mode_rows)} absolute steps miss the {GOAL_STEP:.0%} goal."),
        "",
        *fit_lines,
        "**Which term is wrong.** Measured over simulated CPU time of every micro-batch, by kind and by "
        "the number of documents it carries:",
        "",
        markdown_table(["micro-batch", "documents", "count", "measured / simulated"], doc_rows),
        "",
        f"Least squares over all {terms.samples} micro-batches: measured = {terms.scale:.2f} x simulated "
        f"+ {terms.per_doc_step_s * 1e3:.2f} ms x documents x ring size (rings only): a uniform factor "
        "between the calibration (the bare model's decoder layers on each rank's own micro-batch) and "
        "the run (the whole DDP-wrapped model with the demo's saved-tensor hooks, inside Megatron's "
        "step functions), and what per-document cost is left beyond the model's own term ("
        + ("negative: the calibrated term is if anything too large)." if terms.per_doc_step_s < 0 else
           "positive: the calibrated term is too small by that much)."),
        "",
        "**Wall-time ratios** (micro-batch phase on the machine, predicted with the cores shared; noisy: "
        "other processes took cores at random moments, this is not what the goal is judged on):",
        "",
        markdown_table(["dataset", "ratio", "measured", "predicted (cores shared)", "error"], wall_rows),
        "",
        "![simulated vs measured busy time per rank](img/sim_validation.png)",
    ])


def plot(validations) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), constrained_layout=True)
    left, right = fig.subplots(1, 2)
    markers = {"static": "s", "naive": "^", "balance": "o"}
    top = 0.0
    for v in validations:
        left.scatter(v.measured_busy_by_rank, v.predicted_busy_by_rank, marker=markers[v.mode],
                     label=f"{v.dataset} {v.mode}", s=25)
        top = max(top, *v.measured_busy_by_rank, *v.predicted_busy_by_rank)
    left.plot([0, top * 1.05], [0, top * 1.05], color="grey", linewidth=0.8)
    left.fill_between([0, top * 1.05], [0, top * 1.05 * (1 - GOAL_STEP)], [0, top * 1.05 * (1 + GOAL_STEP)],
                      color="grey", alpha=0.15, label=f"+/- {GOAL_STEP:.0%}")
    left.set_xlabel("measured busy s per rank per step")
    left.set_ylabel("predicted busy s")
    left.set_title("busy time per rank (each point: one rank, mean over steps)", fontsize=9)
    left.legend(fontsize=6, ncol=2)
    checks = [c for c in ratio_checks(validations) if c.kind == "busy"]
    labels = [f"{c.dataset}\n{c.ratio}" for c in checks]
    xs = range(len(checks))
    right.bar([x - 0.2 for x in xs], [c.measured for c in checks], 0.4, label="measured")
    right.bar([x + 0.2 for x in xs], [c.predicted for c in checks], 0.4, label="simulated")
    right.set_xticks(list(xs), labels, fontsize=5, rotation=90)
    right.set_ylabel("step-time ratio (slowest rank's busy time)")
    right.set_title("step-time ratios", fontsize=9)
    right.legend(fontsize=7)
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG_DIR / "sim_validation.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=None, help="an earlier bytescale demo results.json instead of a new run")
    ap.add_argument("--load", default=None, help="with --results: the load line to print (how busy the machine was)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args, extra = ap.parse_known_args()
    if args.results:
        results = json.loads(Path(args.results).read_text(encoding="utf-8"))
        load = args.load or "load not recorded"
    else:
        progress(f"running bytescale demo on {DATASETS} ...")
        results, load = run_demo([x for x in extra if x != "--"])
        saved = Path("out/validate/results.json")  # rerun the analysis: --results out/validate/results.json --load ...
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(results) + "\n", encoding="utf-8")
        progress(f"saved the run to {saved} ({load})")
    body = section(results, load)
    if args.no_write:
        print(body)
    else:
        write_section("validation", body, REPRODUCTION_MD)
        progress(f"wrote section 'validation' of {REPRODUCTION_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
