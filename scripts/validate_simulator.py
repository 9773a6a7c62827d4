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
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import IMG_DIR, machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.sim.demo_validation import (  # noqa: E402
    fit_residual_terms,
    held_out_ratio_checks,
    ratio_by_documents,
    ratio_checks,
    validate_demo,
)

REPRODUCTION_MD = Path(__file__).resolve().parent.parent / "docs" / "reproduction.md"
DATASETS = "stdlib,synthetic-github,synthetic-byted"
GOAL = 0.20


def progress(msg: str) -> None:
    print(f"[validate_simulator] {msg}", file=sys.stderr, flush=True)


def run_demo(extra: list[str]) -> tuple[dict, str]:
    from megatron_bytescale.tools.demo_cmd import build_parser, run_demo_job, settings_from_args

    args = build_parser().parse_args(["--data", DATASETS, "--out", "out/validate", "--no-plot", *extra])
    before = os.getloadavg()
    results = run_demo_job(settings_from_args(args))
    after = os.getloadavg()
    load = f"load average (1 min) {before[0]:.1f} before / {after[0]:.1f} after the demo"
    return results, load


def ok(err: float) -> str:
    return f"{err:+.1%}" + ("" if abs(err) <= GOAL else " **miss**")


def section(results: dict, load: str) -> str:
    validations = validate_demo(results)
    samples = [s for v in validations for s in v.samples]
    terms = fit_residual_terms(samples)
    cm = results["calibration"]["cost_model"]
    s = results["settings"]
    mode_rows = [[v.dataset, v.mode, f"{v.plans_matching}/{v.steps}", f"{v.measured_max_busy_s:.3f}",
                  f"{v.predicted_max_busy_s:.3f}", f"{v.predicted_max_busy_s / v.measured_max_busy_s - 1:+.1%}",
                  " / ".join(f"{x:.2f}" for x in v.measured_busy_by_rank),
                  " / ".join(f"{x:.2f}" for x in v.predicted_busy_by_rank), f"{v.busy_error:.0%}",
                  f"{v.measured_phase_wall_s:.2f}", f"{v.predicted_phase_shared_s:.2f}"]
                 for v in validations]
    checks = ratio_checks(validations)
    busy_rows = [[c.dataset, c.ratio, f"{c.measured:.2f}", f"{c.predicted:.2f}", ok(c.error)]
                 for c in checks if c.kind == "busy"]
    held = {(c.dataset, c.ratio): c for c in held_out_ratio_checks(validations)}
    for row in busy_rows:
        h = held.get((row[0], row[1]))
        row += [f"{h.predicted:.2f}", ok(h.error)] if h else ["-", "-"]
    wall_rows = [[c.dataset, c.ratio, f"{c.measured:.2f}", f"{c.predicted:.2f}", f"{c.error:+.1%}"]
                 for c in checks if c.kind == "wall"]
    doc_rows = [[k, d, str(n), f"{r:.2f}"] for k, d, n, r in ratio_by_documents(samples)]
    misses = [c for c in checks if c.kind == "busy" and abs(c.error) > GOAL]
    held_misses = [c for c in held.values() if abs(c.error) > GOAL]
    plot(validations)
    return "\n".join([
        "### Validation: the simulator against measured `bytescale demo` runs (CPU)",
        "",
        f"{machine_line()} {results['world_size']} CPU ranks (gloo) on {results.get('cpu_count', '?')} cores; "
        f"{load}: other work shared the cores during the run. Demo: {s['num_layers']}-layer GPT, hidden "
        f"{s['hidden_size']}, C = {s['capacity']}, context {s['context_length']}, {s['steps']} steps per mode "
        "(the first left out). Cost model: the demo's own calibration on this machine, "
        f"T(s) = {cm['alpha1']:.3g} s^2 + {cm['beta1']:.3g} s + {cm['gamma']:.3g} s per layer, "
        f"P2P {cm['p2p_bandwidth_intra'] / 1e9:.2f} GB/s, {cm['p2p_latency_s'] * 1e6:.0f} us, ring step "
        f"overhead {cm['ring_step_overhead_s'] * 1e3:.2f} ms per layer. Every step is replanned with it "
        "(column 'same plan': plan hashes equal to the demo's) and simulated.",
        "",
        "**Step-time ratios** (the slowest rank's busy CPU time, i.e. the step with one core per rank; "
        f"goal: predicted within {GOAL:.0%} of measured). 'held-out terms' adds the two residual terms "
        "below, fitted on the *other two* datasets' micro-batches:",
        "",
        markdown_table(["dataset", "ratio", "measured", "predicted", "error", "predicted, held-out terms",
                        "error"], busy_rows),
        "",
        ("All ratios within the goal." if not misses else
         f"{len(misses)} of {len(busy_rows)} ratios miss the goal with the calibrated model alone "
         f"({'none' if not held_misses else len(held_misses)} with the held-out terms); see 'which term is wrong'."),
        "",
        "**Per mode** (means per step; busy = CPU seconds in micro-batches; wall = the micro-batch "
        "phase's wall time, predicted with the cores shared):",
        "",
        markdown_table(["dataset", "mode", "same plan", "max busy measured", "max busy predicted", "error",
                        "busy per rank measured", "busy per rank predicted", "per-rank error",
                        "wall measured", "wall predicted"], mode_rows),
        "",
        "**Which term is wrong.** Measured over predicted CPU time of every micro-batch, by kind and by "
        "the number of documents it carries:",
        "",
        markdown_table(["micro-batch", "documents", "count", "measured / predicted"], doc_rows),
        "",
        f"Least squares over all {terms.samples} micro-batches: measured = {terms.scale:.2f} x predicted "
        f"+ {terms.per_doc_step_s * 1e3:.2f} ms x documents x ring size (rings only). Two terms:",
        "",
        f"* a uniform slowdown of {terms.scale - 1:.0%}: the calibration times one process alone, the "
        f"run has {results['world_size']} ranks on {results.get('cpu_count', '?')} cores plus other work "
        "(caches and memory bandwidth are shared, CPU time grows). It scales every mode alike, so it "
        "leaves the ratios alone;",
        f"* a cost per document per ring step ({terms.per_doc_step_s * 1e3:.2f} ms over "
        f"{s['num_layers']} layers, forward and backward) that the cost model does not have: the "
        "CPU attention backend calls the attention kernel once per document segment per ring step, "
        "so a ring micro-batch carrying many short documents (every static micro-batch: packed "
        "short documents split over the whole CP group) costs more than its tokens say. On GPUs the "
        "varlen kernels (flash-attn, Transformer Engine THD) take all segments of a step in one "
        "call, so this term is specific to the CPU path; it is why static / balance is "
        "under-predicted on the synthetic mixes (many tiny documents) and not on stdlib. The "
        "calibration measures rings of one sequence only; measuring a ring of many short "
        "documents would put this term into the model.",
        "",
        "**Wall-time ratios** (micro-batch phase on the machine; measured under the load above, so "
        "noisy: other processes took cores at random moments):",
        "",
        markdown_table(["dataset", "ratio", "measured", "predicted (cores shared)", "error"], wall_rows),
        "",
        "![predicted vs measured busy time per rank](img/sim_validation.png)",
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
    left.fill_between([0, top * 1.05], [0, top * 1.05 * (1 - GOAL)], [0, top * 1.05 * (1 + GOAL)], color="grey",
                      alpha=0.15, label=f"+/- {GOAL:.0%}")
    left.set_xlabel("measured busy s per rank per step")
    left.set_ylabel("predicted busy s")
    left.set_title("busy time per rank (each point: one rank, mean over steps)", fontsize=9)
    left.legend(fontsize=6, ncol=2)
    checks = [c for c in ratio_checks(validations) if c.kind == "busy"]
    held = {(c.dataset, c.ratio): c for c in held_out_ratio_checks(validations)}
    labels = [f"{c.dataset}\n{c.ratio}" for c in checks]
    xs = range(len(checks))
    right.bar([x - 0.27 for x in xs], [c.measured for c in checks], 0.27, label="measured")
    right.bar(list(xs), [c.predicted for c in checks], 0.27, label="predicted")
    right.bar([x + 0.27 for x in xs], [held[(c.dataset, c.ratio)].predicted if (c.dataset, c.ratio) in held
                                       else 0 for c in checks], 0.27, label="predicted, held-out terms")
    right.set_xticks(list(xs), labels, fontsize=6)
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
    body = section(results, load)
    if args.no_write:
        print(body)
    else:
        write_section("validation", body, REPRODUCTION_MD)
        progress(f"wrote section 'validation' of {REPRODUCTION_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
