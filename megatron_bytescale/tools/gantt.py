"""Gantt charts of plans: HDP ranks x estimated time, micro-batches coloured by ring size.

matplotlib is imported inside :func:`plot_gantt` (Agg, no display), so importing this module is
free. With many ranks only an evenly spaced sample is drawn (always including the slowest rank),
and the panel title says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..planner.cost_model import CostModel
from ..planner.estimate import simulate_plan
from ..planner.plan import StepPlan


def rank_intervals(plan: StepPlan, cost_model: CostModel) -> list[list[tuple[float, float, int]]]:
    """Per rank: ``(start, end, ring size)`` of every micro-batch (stage 0's F and B with PP,
    one bar per model chunk with virtual pipeline stages)."""
    _, sim = simulate_plan(plan, cost_model, record=True)
    times = sim.node_times
    out: list[list[tuple[float, float, int]]] = []
    for rp in plan.ranks:
        bars = []
        for mb in rp.micro_batches:
            if plan.pp_size == 1:
                start, end = times[mb.order]
                bars.append((start, end, mb.ring_size))
            else:
                for phase in ("F", "B"):
                    if plan.virtual_pipeline_size == 1:
                        bars.append((*times[(mb.order, phase, 0)], mb.ring_size))
                        continue
                    for chunk in range(plan.virtual_pipeline_size):
                        bars.append((*times[(mb.order, phase, chunk, 0)], mb.ring_size))
        out.append(bars)
    return out


def sample_ranks(plan: StepPlan, max_ranks: int) -> list[int]:
    """All ranks, or ``max_ranks`` evenly spaced ones plus the slowest."""
    n = plan.hdp_size
    if n <= max_ranks:
        return list(range(n))
    picks = set(np.linspace(0, n - 1, max_ranks - 1).round().astype(int).tolist())
    if plan.estimate is not None and plan.estimate.rank_time_s:
        picks.add(int(np.argmax(plan.estimate.rank_time_s)))
    return sorted(picks)


def plot_gantt(
    panels: Sequence[tuple[str, StepPlan]],
    cost_model: CostModel,
    path: str | Path,
    *,
    max_ranks: int = 64,
) -> Path:
    """Write one Gantt panel per ``(label, plan)`` to ``path`` (PNG); returns the path written
    (``path`` with ``.png`` added when it has no extension, as matplotlib would).

    All panels share the time axis, so schedulers compare at a glance (clipped at 3x the fastest
    plan, which the clipped panels' titles say).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import colors
    from matplotlib.cm import ScalarMappable
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("nothing to plot")
    out = Path(path)
    if not out.suffix:  # matplotlib would add ".png" behind our back
        out = out.with_name(out.name + ".png")
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    data = [(label, plan, rank_intervals(plan, cost_model)) for label, plan in panels]
    max_ring = max([b[2] for _, _, iv in data for bars in iv for b in bars] + [2])
    norm = colors.LogNorm(vmin=1, vmax=max_ring)
    cmap = matplotlib.colormaps["viridis"]
    ends = [max([b[1] for bars in iv for b in bars] + [1e-9]) for _, _, iv in data]
    # one shared time axis, but a plan 10x slower than the best would squash the others:
    # clip at 3x the fastest plan's step and say so in the clipped panels' titles
    horizon = min(max(ends), 3.0 * min(ends)) if len(ends) > 1 else ends[0]
    fig = Figure(figsize=(12, 2.2 + 2.6 * len(data)), constrained_layout=True)
    axes = fig.subplots(len(data), 1, squeeze=False)[:, 0]
    for ax, end, (label, plan, intervals) in zip(axes, ends, data):
        ranks = sample_ranks(plan, max_ranks)
        for row, r in enumerate(ranks):
            bars = intervals[r]
            if bars:
                ax.broken_barh([(s, e - s) for s, e, _ in bars], (row - 0.4, 0.8),
                               facecolors=[cmap(norm(d)) for _, _, d in bars], edgecolor="white", linewidth=0.3)
        est = plan.estimate
        title = f"{label}: {plan.hdp_size} HDP ranks"
        if est is not None:
            lb = est.extra.get("lower_bound_s")
            title += f", step {est.step_time_s:.3g} s"
            if lb:
                title += f", lower bound {lb:.3g} s (ratio {est.step_time_s / lb:.2f})"
                ax.axvline(lb, color="red", linestyle="--", linewidth=0.8)
        if len(ranks) < plan.hdp_size:
            title += f" - sampled {len(ranks)} of {plan.hdp_size} ranks"
        if plan.pp_size > 1:
            title += f" - stage 0 of {plan.pp_size}, F and B bars"
        if end > horizon * 1.02:
            title += f" - time axis clipped (runs to {end:.3g} s)"
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_ylim(-0.6, len(ranks) - 0.4)
        step = max(1, len(ranks) // 8)
        ax.set_yticks(range(0, len(ranks), step), [str(ranks[i]) for i in range(0, len(ranks), step)])
        ax.set_ylabel("HDP rank")
        ax.invert_yaxis()
    axes[-1].set_xlabel("estimated time (s)")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), label="ring size", shrink=0.8)
    fig.savefig(out, dpi=110)
    return out
