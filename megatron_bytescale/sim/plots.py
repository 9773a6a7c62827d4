"""Plots of simulated sweeps (matplotlib, imported when a plot is drawn; Agg, no display).

* :func:`plot_throughput`: tokens/s/GPU against context length, one line per variant (the
  paper's Fig. 17 form);
* :func:`plot_rank_times`: the distribution of per-rank busy time of every variant, with the
  step's micro-batch phase marked (what an imbalanced step looks like);
* :func:`plot_ablation`: speedup over the first variant, bar per variant, next to reference
  numbers (the paper's Fig. 20) when given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .step import StepResult
from .sweep import Summary, format_tokens


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), constrained_layout=True)


def _save(fig, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def plot_throughput(summaries: Sequence[Summary], path: str | Path, *, title: str = "") -> Path:
    """tokens/s/GPU against context length per variant (log2 x axis)."""
    fig = _figure(7.5, 4.5)
    ax = fig.subplots()
    names = list(dict.fromkeys(s.variant.name for s in summaries))
    contexts = sorted({s.context_length for s in summaries if s.context_length})
    for name in names:
        pts = sorted((s.context_length, s.tokens_per_s_per_gpu) for s in summaries
                     if s.variant.name == name and s.ok and s.context_length)
        if pts:
            label = next(s.variant.label for s in summaries if s.variant.name == name)
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [format_tokens(c) for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("tokens/s per GPU (simulated)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "throughput against context length", fontsize=10)
    return _save(fig, path)


def plot_rank_times(results: Sequence[StepResult], path: str | Path, *, title: str = "") -> Path:
    """Per-rank busy time of every result as a violin, its micro-batch phase as a red tick."""
    if not results:
        raise ValueError("nothing to plot")
    fig = _figure(max(6.0, 1.5 * len(results) + 2), 4.5)
    ax = fig.subplots()
    data = [np.asarray(r.rank_busy_s, dtype=np.float64) for r in results]
    pos = np.arange(1, len(results) + 1)
    parts = ax.violinplot(data, positions=pos, showextrema=True, showmedians=True, widths=0.8)
    for body in parts["bodies"]:
        body.set_alpha(0.5)
    ax.scatter(pos, [r.micro_batch_phase_s for r in results], marker="_", s=600, color="red",
               label="micro-batch phase (slowest rank incl. waits)", zorder=3)
    ax.set_xticks(pos, [r.name for r in results], rotation=20, fontsize=8)
    ax.set_ylabel("busy seconds per HDP rank")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title or "per-rank busy time (distribution over HDP ranks)", fontsize=10)
    return _save(fig, path)


def plot_ablation(
    speedups: Mapping[str, float],
    path: str | Path,
    *,
    reference: Mapping[str, float] | None = None,
    reference_label: str = "paper",
    title: str = "",
) -> Path:
    """Bars of speedup over the baseline per step of an ablation, with reference bars."""
    names = list(speedups)
    fig = _figure(max(6.0, 1.4 * len(names) + 2), 4.2)
    ax = fig.subplots()
    x = np.arange(len(names))
    width = 0.38 if reference else 0.7
    bars = ax.bar(x - (width / 2 if reference else 0), [speedups[n] for n in names], width, label="simulated")
    ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    if reference:
        ref = ax.bar(x + width / 2, [reference.get(n, np.nan) for n in names], width, label=reference_label)
        ax.bar_label(ref, fmt="%.2fx", fontsize=8)
    ax.set_xticks(x, names, rotation=15, fontsize=8)
    ax.set_ylabel("speedup over the baseline")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    ax.set_title(title or "ablation", fontsize=10)
    return _save(fig, path)


def plot_sweep(summaries: Sequence[Summary], directory: str | Path, *, title: str = "") -> list[Path]:
    """The three plots of a sweep into ``directory``: ``throughput.png`` (when there are several
    context lengths), ``rank_times.png`` (the longest context's first step) and
    ``ablation.png`` (speedups over the first variant at the longest context)."""
    d = Path(directory)
    written = []
    contexts = sorted({s.context_length for s in summaries if s.context_length})
    if len(contexts) > 1:
        written.append(plot_throughput(summaries, d / "throughput.png", title=title))
    last = contexts[-1] if contexts else None
    at_last = [s for s in summaries if s.context_length == last and s.ok]
    if at_last:
        where = f" at context {format_tokens(last)}" if last else ""
        written.append(plot_rank_times([s.results[0] for s in at_last], d / "rank_times.png",
                                       title=f"per-rank busy time{where}" + (f" - {title}" if title else "")))
        base = at_last[0].tokens_per_s
        speedups = {s.variant.name: s.tokens_per_s / base for s in at_last}
        written.append(plot_ablation(speedups, d / "ablation.png",
                                     title=f"speedup over {at_last[0].variant.name}{where}"
                                     + (f" - {title}" if title else "")))
    return written
