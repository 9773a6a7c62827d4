#!/usr/bin/env python
"""Simulate the paper's experiments; writes the generated sections of docs/reproduction.md.

Sections (each between ``<!-- BEGIN name -->`` / ``<!-- END name -->`` markers, so the prose
around them stays):

* ``case_study``: LLaMA-7B, 2M context, 1,024 GPUs, Byted (paper §8.3, Fig. 18);
* ``ablation``: the same setup, static -> naive -> + offload -> + balance -> + lookahead
  (paper §8.5, Fig. 20), with ``docs/img/reproduction_ablation.png``;
* ``offload``: when Eq. 3's offload helps naive HDP (network rate sweep, ring sizes);
* ``fig17``: the six models at the paper's GPU counts, GitHub-like and Byted-like, 256K-2M
  (paper §8.2, Fig. 17), with ``docs/img/reproduction_fig17.png``;
* ``doubling``: throughput drop per context doubling (paper §8.2).

Every number comes from ``megatron_bytescale.sim`` on one hardware preset for every figure,
``paper-fit`` (:data:`megatron_bytescale.planner.presets.PAPER_FIT`): the paper hides its
hardware, so its parameters are fitted to the paper's own case-study and Fig. 18 numbers by
``scripts/fit_network.py``. The case study and the ablation are also shown on the H100 datasheet
preset for comparison. No simulated step contains planning time measured on this machine.
Raw results go to ``out/reproduce/results.json``.

Usage: ``.venv/bin/python scripts/reproduce_paper.py [--only case_study,ablation,...] [--no-write]
[--models mistral-8x7b,mistral-8x22b]`` (``--models``: Fig. 17 and the doubling table for those
models only; printed, never written over the full sections, raw results to
``out/reproduce/results-subset.json``). With ``--models``, ``--datasets github`` and
``--contexts 1M,2M`` narrow the sweep to those cells, and ``--seq-split`` plans the balance
variant with ``make_plan(seq_split=True)`` (its longest rings split along the pipeline where the
estimate says it pays and the kept prefix fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import IMG_DIR, machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.sim import (  # noqa: E402
    ABLATION,
    drop_per_doubling,
    format_tokens,
    parse_tokens,
    parse_variants,
    run_sweep,
    simulate_variants,
    summarize,
)
from megatron_bytescale.sim import paper  # noqa: E402
from megatron_bytescale.sim.plots import plot_ablation  # noqa: E402

REPRODUCTION_MD = Path(__file__).resolve().parent.parent / "docs" / "reproduction.md"
OUT = Path("out/reproduce")
SECTIONS = ("case_study", "ablation", "offload", "fig17", "doubling")
FIG17_VARIANTS = ("static", "naive", "naive+offload", "balance")


def progress(msg: str) -> None:
    print(f"[reproduce_paper] {msg}", file=sys.stderr, flush=True)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def gap(ours: float, theirs: float) -> str:
    """Relative gap ours / theirs - 1, flagged when beyond 25 %."""
    g = ours / theirs - 1.0
    return f"{g:+.0%}" + (" **>25%**" if abs(g) > 0.25 else "")


# --------------------------------------------------------------------------- case study
def case_batch() -> np.ndarray:
    c = paper.CASE_STUDY
    return synthetic_lengths(c["dataset"], paper.GLOBAL_TOKENS, seed=0, max_length=c["context"])


def case_outcomes(hardware: str = paper.PAPER_HARDWARE) -> dict[str, Any]:
    c = paper.CASE_STUDY
    setup = paper.paper_setup(c["model"], c["gpus"], hardware=hardware)
    outs = simulate_variants(case_batch(), parse_variants(",".join(ABLATION)), setup, context_length=c["context"])
    return {o.variant.name: o.result for o in outs}


def fmt_s(x: float) -> str:
    return f"{int(x // 60)}m{x % 60:04.1f}s" if x >= 60 else f"{x:.1f}s"


def case_study_section(preset: dict, datasheet: dict) -> str:
    c = paper.CASE_STUDY
    rows = []

    def add(what: str, theirs: float | None, fn, fmt=fmt_s) -> None:
        a, b = fn(preset), fn(datasheet)
        rows.append([what, fmt(theirs) if theirs is not None else "-", fmt(a),
                     gap(a, theirs) if theirs else "", fmt(b), gap(b, theirs) if theirs else ""])

    add("static (MegaScale) step", c["static_step_s"], lambda r: r["static"].step_time_s)
    add("HDP naive step (slowest rank)", c["naive_step_s"], lambda r: r["naive"].step_time_s)
    add("HDP balance step", c["balance_step_s"], lambda r: r["balance"].step_time_s)
    add("speedup static / balance", c["speedup"], lambda r: r["static"].step_time_s / r["balance"].step_time_s,
        lambda x: f"{x:.2f}x")
    add("naive / balance", c["naive_step_s"] / c["balance_step_s"],
        lambda r: r["naive"].step_time_s / r["balance"].step_time_s, lambda x: f"{x:.2f}x")
    add("naive: fastest rank's busy time", c["naive_fastest_rank_s"], lambda r: float(r["naive"].rank_busy_s.min()))
    add("naive: slowest rank's busy time", c["naive_rank_max_s"], lambda r: float(r["naive"].rank_busy_s.max()))
    add("naive: std of rank busy time", c["naive_rank_std_s"], lambda r: float(r["naive"].rank_busy_s.std()))
    add("naive: max / min rank busy", c["naive_rank_max_s"] / c["naive_rank_min_s"],
        lambda r: float(r["naive"].rank_busy_s.max() / max(r["naive"].rank_busy_s.min(), 1e-9)),
        lambda x: f"{x:.1f}x")
    add("static: P2P time / micro-batch time", c["static_comm_fraction"], lambda r: comm_share(r["static"]), pct)
    add("static: micro-batches per rank", c["static_micro_batches_per_rank"],
        lambda r: float(max(r["static"].micro_batch_counts)), lambda x: f"{x:.0f}")
    header = ["quantity", "paper", "simulated, fitted preset", "gap", "simulated, H100 datasheet", "gap"]
    lines = [
        "### Case study: LLaMA-7B, 2M context, 1,024 GPUs, Byted-like 32M-token batch",
        "",
        "1,024 HDP ranks (TP 1, PP 1), C = 8K, one synthetic Byted-like batch (seed 0). 'fitted "
        "preset' = the `paper-fit` hardware of every figure on this page (section 'The network "
        "model fitted to the paper's own numbers'); 'H100 datasheet' = the planner's H100 preset, "
        "for comparison. No planning time in any step. Gaps over 25% are marked.",
        "",
        markdown_table(header, rows),
        "",
        "Where the simulated step goes (micro-batch phase, GPU-seconds shares; fitted preset; "
        "'exposed comm' includes the straggler wait):",
        "",
        breakdown_table(preset),
    ]
    return "\n".join(lines)


def comm_share(r: Any) -> float:
    """P2P link time over micro-batch time (busy, idle excluded): the paper's "communication is
    97.6% of micro-batch time" for the baseline (P2P overlaps compute, so at most 1)."""
    busy = sum(r.breakdown[t] for t in ("compute", "exposed_comm", "step_overhead", "exposed_offload"))
    return min(1.0, r.breakdown["comm"] / busy) if busy > 0 else 0.0


def breakdown_table(results: dict) -> str:
    rows = []
    for name, r in results.items():
        f = {t: r.fraction(t) for t in ("compute", "exposed_comm", "step_overhead", "exposed_offload", "idle")}
        sizes = [k for k in r.ring_sizes if k > 1]
        rows.append([name, f"{r.step_time_s:.1f}", f"{r.micro_batch_phase_s:.1f}", f"{r.grad_reduce_s:.2f}",
                     f"{r.data_wait_s:.2f}", pct(f["compute"]), pct(f["exposed_comm"]), pct(f["idle"]),
                     pct(f["exposed_offload"]), f"{min(r.micro_batch_counts)}-{max(r.micro_batch_counts)}",
                     f"{max(sizes) if sizes else 1}", str(r.offloaded_micro_batches)])
    return markdown_table(["variant", "step s", "micro-batches s", "grad reduce s", "data wait s", "compute",
                           "exposed comm", "idle", "exposed offload", "mb/rank", "largest ring", "offloaded mbs"],
                          rows)


# --------------------------------------------------------------------------- ablation
def ablation_section(preset: dict, datasheet: dict) -> str:
    base_p, base_i = preset["static"].tokens_per_s, datasheet["static"].tokens_per_s
    rows = []
    for name in ABLATION:
        theirs = paper.ABLATION_SPEEDUP[name]
        a, b = preset[name].tokens_per_s / base_p, datasheet[name].tokens_per_s / base_i
        rows.append([name, f"{theirs:.2f}x", f"{a:.2f}x", gap(a, theirs), f"{b:.2f}x", gap(b, theirs)])
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    plot_ablation({n: preset[n].tokens_per_s / base_p for n in ABLATION}, IMG_DIR / "reproduction_ablation.png",
                  reference=paper.ABLATION_SPEEDUP,
                  title="ablation, LLaMA-7B 2M 1,024 GPUs Byted-like, simulated on the fitted preset")
    return "\n".join([
        "### Ablation (Fig. 20): cumulative speedup over the baseline, case-study setup",
        "",
        markdown_table(["configuration", "paper", "simulated, fitted preset", "gap",
                        "simulated, H100 datasheet", "gap"], rows),
        "",
        f"Planner wall time on this machine: {preset['balance'].planner_wall_s:.2f} s per step for "
        "balance (reported only; it is in no simulated step). The paper quantifies neither its data "
        "loading nor its planning, so the simulated steps model none (`bytescale simulate --load-s "
        "--plan-time-s` adds them as the cluster's own costs, which lookahead then hides): balance and "
        "balance + lookahead are equal here.",
        "",
        "![ablation bars: simulated and paper](img/reproduction_ablation.png)",
    ])


# --------------------------------------------------------------------------- offload
def offload_section() -> str:
    c = paper.CASE_STUDY
    lengths = case_batch()
    rows = []
    for gbps in (2.5, 5.0, 10.0, 20.0, 40.0, 80.0):
        setup = paper.paper_setup(c["model"], c["gpus"], p2p_bandwidth_inter=gbps * 1e9)
        out = {o.variant.name: o.result for o in simulate_variants(
            lengths, parse_variants("static,naive,naive+offload"), setup, context_length=c["context"])}
        s = out["static"].step_time_s
        nv, no = out["naive"], out["naive+offload"]
        rows.append([f"{gbps:g}", f"{s:.0f}", f"{nv.step_time_s:.0f}", f"{no.step_time_s:.0f}",
                     f"{s / nv.step_time_s:.2f}x", f"{s / no.step_time_s:.2f}x",
                     f"{no.tokens_per_s / nv.tokens_per_s:.2f}x", pct(nv.fraction("exposed_comm"))])
    longest = int(max(lengths))
    setup = paper.paper_setup(c["model"], c["gpus"])
    cm = setup.cost_model
    cm_rate = cm.p2p_bandwidth_inter
    layers = cm.num_layers
    from megatron_bytescale.planner.offload import solve_offload

    dec = solve_offload(longest, capacity=paper.CAPACITY, layers=layers, cost_model=cm, max_ring_size=setup.hdp_size)
    ring_rows = []
    for d in sorted({dec.ring_size, dec.ring_size_without_offload, 64, 128, 512}):
        t = cm.micro_batch_time([longest], d, layers=layers, intra_node=d <= cm.ranks_per_node)
        terms = cm.ring_time_terms(*_sums(cm, longest, d), d, layers=layers, intra_node=d <= cm.ranks_per_node)
        ring_rows.append([str(d), f"{t:.1f}", f"{float(terms.compute):.1f}", f"{float(terms.comm):.1f}",
                          f"{float(terms.exposed_comm):.1f}", f"{t * d:.0f}"])
    recompute_rows = []
    for label, hw in (("fitted preset", paper.PAPER_HARDWARE), ("H100 datasheet", "h100")):
        setup = paper.paper_setup(c["model"], c["gpus"], hardware=hw)
        cm = setup.cost_model
        recompute = dataclasses.replace(setup, cost_model=cm.with_(
            beta1=cm.beta1 * (1 + cm.forward_fraction), gamma=cm.gamma * (1 + cm.forward_fraction),
            alpha1=cm.alpha1 * (1 + cm.attention_forward_fraction)))
        plain = {o.variant.name: o.result for o in simulate_variants(
            lengths, parse_variants("static,naive"), setup, context_length=c["context"])}
        redo = {o.variant.name: o.result for o in simulate_variants(
            lengths, parse_variants("static,naive"), recompute, context_length=c["context"])}
        st = plain["static"].step_time_s
        recompute_rows.append([label, f"{st / redo['naive'].step_time_s:.2f}x", f"{st / plain['naive'].step_time_s:.2f}x",
                               f"{redo['naive'].step_time_s / plain['naive'].step_time_s:.2f}x"])
    return "\n".join([
        "### When does offload help naive HDP? (case-study batch, network rate swept)",
        "",
        "Naive = Alg. 1 with rings of ceil(s / C) ranks; naive + offload = Alg. 1 with Eq. 3's rings "
        "(the smallest ring whose activations fit with offload, the transfer hidden by compute).",
        "",
        markdown_table(["inter-node GB/s", "static s", "naive s", "naive+offload s", "naive vs static",
                        "naive+offload vs static", "offload gain", "naive exposed comm"], rows),
        "",
        f"The longest sequence of the batch ({longest:,} tokens) on rings of different sizes, LLaMA-7B "
        f"on the fitted preset ({cm_rate / 1e9:.0f} GB/s, straggler wait included in exposed P2P), all 32 layers; Eq. 3 gives {dec.ring_size} ranks with offload ratio "
        f"{dec.offload_ratio:.2f} ({dec.ring_size_without_offload} without offload):",
        "",
        markdown_table(["ring size", "seconds per member", "compute s", "P2P s (hidden or not)",
                        "exposed P2P s", "rank-seconds"], ring_rows),
        "",
        "A different mechanism, offload *instead of activation recomputation* (not what Eq. 3 says; "
        "paper Fig. 21 compares the two): naive HDP with full recomputation (every layer's forward run "
        "again in backward: GEMMs x (1 + forward fraction 1/3), attention x (1 + 2/7), communication "
        "unchanged) against naive HDP without it, both over the same static baseline without "
        "recomputation (paper: 1.59x -> 2.01x, a 1.26x step):",
        "",
        markdown_table(["rate", "naive, recomputing", "naive, no recomputation", "gain"], recompute_rows),
    ])


def _sums(cm, length: int, d: int) -> tuple[float, float]:
    p = cm.padded_lengths([length], d).astype(np.float64)
    return float(p.sum()), float((p * p).sum())


# --------------------------------------------------------------------------- Fig. 17
def fig17_summaries(models: list[str] | None = None, variants: tuple[str, ...] = FIG17_VARIANTS,
                    *, datasets: tuple[str, ...] = ("github", "byted"), contexts: list[int] | None = None,
                    seq_split: bool = False, **setup_changes: Any) -> dict[tuple[str, str], list]:
    """Fig. 17's sweeps: every model (or ``models``), both datasets (or ``datasets``), every
    context (or those of ``contexts``); ``setup_changes`` go to
    :func:`megatron_bytescale.sim.paper.paper_setup` (e.g. ``expert_parallel_size``);
    ``seq_split`` plans balance with the sequence split (``ClusterSetup.seq_split``)."""
    out = {}
    for model in models or list(paper.FIG17_GPUS):
        setup = paper.paper_setup(model, **setup_changes)  # no planning time: the paper does not give its planner's
        if seq_split:
            setup = dataclasses.replace(setup, seq_split=True)
        cells = [c for c in paper.FIG17_CONTEXTS if c <= paper.FIG17_MAX_CONTEXT.get(model, 1 << 40)]
        cells = [c for c in cells if contexts is None or c in contexts]
        for dataset in datasets:
            progress(f"Fig. 17: {model} on {setup.num_gpus:,} GPUs, {dataset}")
            points = run_sweep(
                lambda ctx, step, ds=dataset: synthetic_lengths(ds, paper.GLOBAL_TOKENS, seed=step, max_length=ctx),
                contexts=cells, steps=1, variants=parse_variants(",".join(variants)), setup=setup,
            )
            out[(model, dataset)] = summarize(points)
    return out


def fig17_section(data: dict, *, plot: bool = True) -> str:
    rows = []
    for (model, dataset), summaries in data.items():
        by = {(s.context_length, s.variant.name): s for s in summaries}
        for ctx in sorted({s.context_length for s in summaries}):
            st = by[(ctx, "static")]
            cells = [model, dataset, format_tokens(ctx), f"{paper.FIG17_GPUS[model]:,}"]
            for v in FIG17_VARIANTS:
                s = by[(ctx, v)]
                cells.append(f"{s.tokens_per_s / 1e3:,.0f}k" if s.ok else "n/a")
            bal = by[(ctx, "balance")]
            cells.append(f"{bal.tokens_per_s / st.tokens_per_s:.2f}x" if st.ok and bal.ok else "n/a")
            rows.append(cells)
    speed_rows = []
    for group, models in (("DP-Balance", paper.DP_BALANCE_MODELS), ("PP-Balance", paper.PP_BALANCE_MODELS)):
        for dataset in ("github", "byted"):
            vals = []
            for model in models:
                if (model, dataset) not in data:  # a --models subset
                    continue
                summaries = data[(model, dataset)]
                top = max(s.context_length for s in summaries)
                by = {s.variant.name: s for s in summaries if s.context_length == top}
                vals.append((model, top, by["balance"].tokens_per_s / by["static"].tokens_per_s))
            lo, hi = paper.GITHUB_2M_SPEEDUP[group] if dataset == "github" else (None, paper.BYTED_MAX_SPEEDUP)
            theirs = f"{lo:.2f}-{hi:.2f}x" if lo else f"up to {hi:.2f}x (any model)"
            ours = ", ".join(f"{m} {v:.2f}x" + ("" if t == 2 * paper.M else f" (at {format_tokens(t)})")
                             for m, t, v in vals)
            if vals:
                speed_rows.append([group, dataset, theirs, ours])
    if plot:
        plot_fig17(data)
    return "\n".join([
        "### Fig. 17: throughput against context length, six models at the paper's GPU counts",
        "",
        "32M-token synthetic batches (seed 0 at every context: documents longer than the context are "
        "cut to it), C = 8K, preset TP x PP per model, the fitted `paper-fit` hardware (the case "
        "study's), no planning time. tokens/s of the whole "
        "cluster; naive = Alg. 1 without offload, naive+offload = Alg. 1 with Eq. 3 (the paper's "
        "'HDP naive' in Fig. 17 is Alg. 1, which includes Eq. 3).",
        "",
        "HDP balance over the baseline at the longest context:",
        "",
        markdown_table(["models", "dataset", "paper", "simulated"], speed_rows),
        "",
        "![Fig. 17 simulated](img/reproduction_fig17.png)",
        "",
        "<details><summary>All cells (tokens/s)</summary>",
        "",
        markdown_table(["model", "dataset", "context", "GPUs", *FIG17_VARIANTS, "balance / static"], rows),
        "",
        "</details>",
    ])


def plot_fig17(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    models = list(paper.FIG17_GPUS)
    fig = Figure(figsize=(15, 6.5), constrained_layout=True)
    axes = fig.subplots(2, len(models), squeeze=False)
    for row, dataset in enumerate(("github", "byted")):
        for col, model in enumerate(models):
            ax = axes[row][col]
            summaries = data[(model, dataset)]
            for v in FIG17_VARIANTS:
                pts = sorted((s.context_length, s.tokens_per_s) for s in summaries if s.variant.name == v and s.ok)
                ax.plot([c for c, _ in pts], [t / 1e3 for _, t in pts], marker="o", label=v)
            ctxs = sorted({s.context_length for s in summaries})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ctxs, [format_tokens(c) for c in ctxs], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{model}, {paper.FIG17_GPUS[model]:,} GPUs, {dataset}", fontsize=8)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("thousand tokens/s")
    axes[0][0].legend(fontsize=7)
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG_DIR / "reproduction_fig17.png", dpi=100)


def doubling_section(data: dict) -> str:
    rows = []
    names = {"static": "static", "naive": "naive", "naive+offload": "naive", "balance": "balance"}
    per_variant: dict[str, list[float]] = {v: [] for v in FIG17_VARIANTS}
    bounds, shares = [], []
    for (model, dataset), summaries in data.items():
        cells = [model, dataset]
        for v in FIG17_VARIANTS:
            d = drop_per_doubling(summaries, v)
            per_variant[v].append(d)
            cells.append(f"{d:.2f}x")
        bound = _bound_per_doubling(summaries)
        bounds.append(bound)
        share = _attention_share(model, dataset, summaries)
        shares.append(share)
        cells += [f"{bound:.2f}x", f"{share[0]:.0%} -> {share[1]:.0%}"]
        rows.append(cells)
    geo = lambda xs: float(np.exp(np.nanmean(np.log(xs))))  # noqa: E731
    mean = {v: geo(per_variant[v]) for v in FIG17_VARIANTS}
    summary = [[v, f"{paper.DROP_PER_DOUBLING[names[v]]:.2f}x", f"{mean[v]:.2f}x",
                gap(mean[v], paper.DROP_PER_DOUBLING[names[v]])] for v in FIG17_VARIANTS]
    summary.append(["perfect balance (the lower bound)", "-", f"{geo(bounds):.2f}x", ""])
    return "\n".join([
        "### Throughput drop per context doubling (256K -> 2M; 8x22B 256K -> 1M)",
        "",
        markdown_table(["variant", "paper (average)", "simulated (geometric mean of the 12 panels)", "gap"], summary),
        "",
        "'perfect balance' is the same drop for the lower bound of the micro-batch phase (total busy "
        "GPU-seconds / ranks of the balance plan): a schedule that reached the bound at every context "
        "would still fall this much, because the work itself grows with the context. 'attention share' "
        "is the quadratic term's share of T(s) summed over the batch (shortest -> longest context).",
        "",
        "<details><summary>Per panel</summary>",
        "",
        markdown_table(["model", "dataset", *FIG17_VARIANTS, "perfect balance", "attention share"], rows),
        "",
        "</details>",
    ])


def _bound_per_doubling(summaries) -> float:
    pts = sorted((s.context_length, float(np.mean([r.lower_bound_s for r in s.results])))
                 for s in summaries if s.variant.name == "balance" and s.ok)
    (c0, b0), (c1, b1) = pts[0], pts[-1]
    return (b1 / b0) ** (1.0 / math.log2(c1 / c0))


def _attention_share(model: str, dataset: str, summaries) -> tuple[float, float]:
    """alpha1 * sum(s^2) / sum(T(s) - gamma) of the batch at the shortest and the longest context
    (the quadratic term's share of the compute, whatever the schedule)."""
    cm = paper.paper_setup(model).cost_model
    ctxs = sorted({s.context_length for s in summaries})
    out = []
    for ctx in (ctxs[0], ctxs[-1]):
        s = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=ctx).astype(np.float64)
        attention = cm.alpha1 * float(np.sum(s * s))
        out.append(attention / (attention + cm.beta1 * float(np.sum(s))))
    return out[0], out[1]


# --------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run (default all: {','.join(SECTIONS)})")
    ap.add_argument("--no-write", action="store_true", help="print the sections instead of writing them")
    ap.add_argument("--models", default=None,
                    help="Fig. 17 / doubling for these comma-separated models only (e.g. mistral-8x7b,"
                         "mistral-8x22b); printed instead of written, since the sections cover all six")
    ap.add_argument("--datasets", default="github,byted", help="with --models: Fig. 17's datasets to run")
    ap.add_argument("--contexts", default=None, help="with --models: Fig. 17's contexts to run (e.g. 1M,2M)")
    ap.add_argument("--seq-split", action="store_true",
                    help="with --models: plan balance with the sequence split along the pipeline")
    args = ap.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    models = None
    if args.models is not None:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        bad = sorted(set(models) - set(paper.FIG17_GPUS))
        if bad or not models:
            ap.error(f"--models {args.models!r}: choose from {', '.join(paper.FIG17_GPUS)}")
        if set(only) - {"fig17", "doubling"}:
            ap.error("--models selects Fig. 17's models; use it with --only fig17 (or fig17,doubling)")
        args.no_write = True
    datasets = tuple(d.strip() for d in args.datasets.split(",") if d.strip())
    contexts = None if args.contexts is None else [parse_tokens(c) for c in args.contexts.split(",") if c.strip()]
    narrowed = args.seq_split or contexts is not None or set(datasets) != {"github", "byted"}
    if narrowed and models is None:
        ap.error("--datasets, --contexts and --seq-split narrow or change Fig. 17: use them with --models")
    if not datasets or set(datasets) - {"github", "byted"}:
        ap.error(f"--datasets {args.datasets!r}: choose from github, byted")
    start = time.perf_counter()
    sections: dict[str, str] = {}
    raw: dict[str, Any] = {}
    if {"case_study", "ablation"} & set(only):
        progress("case study and ablation on the fitted preset ...")
        preset = case_outcomes()
        progress("case study and ablation on the H100 datasheet preset ...")
        datasheet = case_outcomes("h100")
        raw["case_study"] = {"hardware": paper.PAPER_HARDWARE,
                             "preset": {k: v.to_dict(per_rank=False) for k, v in preset.items()},
                             "h100": {k: v.to_dict(per_rank=False) for k, v in datasheet.items()}}
        if "case_study" in only:
            sections["case_study"] = case_study_section(preset, datasheet)
        if "ablation" in only:
            sections["ablation"] = ablation_section(preset, datasheet)
    if "offload" in only:
        progress("offload sweep ...")
        sections["offload"] = offload_section()
    if {"fig17", "doubling"} & set(only):
        data = fig17_summaries(models, datasets=datasets, contexts=contexts, seq_split=args.seq_split)
        raw["fig17"] = {f"{m}/{d}": [s.to_dict() for s in ss] for (m, d), ss in data.items()}
        if "fig17" in only:
            sections["fig17"] = fig17_section(data, plot=models is None)
        if "doubling" in only:
            sections["doubling"] = doubling_section(data)
    stamp = (f"\n\n_Generated by `scripts/reproduce_paper.py` in {time.perf_counter() - start:.0f} s. "
             f"{machine_line()} Load average {os.getloadavg()[0]:.1f}._")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ("results.json" if models is None else "results-subset.json")).write_text(json.dumps(raw, indent=1, default=float) + "\n", encoding="utf-8")
    for name, body in sections.items():
        if args.no_write:
            print(body + "\n")
        else:
            write_section(name, body + (stamp if name in ("case_study", "fig17", "offload") else ""), REPRODUCTION_MD)
            progress(f"wrote section '{name}' of {REPRODUCTION_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
