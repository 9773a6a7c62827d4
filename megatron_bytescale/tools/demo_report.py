"""Turn the demo's ``results.json`` into the comparison table, the plot and benchmark markdown.

Measures (per dataset and mode, averaged over the steps after the first, which pays one-time
set-up costs):

* tokens/s: global-batch tokens / step wall time (first rank starting the step to the last
  finishing it, optimizer included, planning excluded). On the CPU demo 4 ranks share 2 cores,
  so wall time also counts time a rank waited for a core;
* busy time: CPU seconds (the thread's CPU time with one torch thread, see
  :mod:`megatron_bytescale.integration.busy_clock`) a rank spent in its micro-batches, the max
  and the mean over ranks; max is what the slowest rank needs, max/mean the imbalance;
* tokens per busy-second: tokens / max busy time, the throughput if every rank had its own core;
* P2P: bytes sent by all ranks in ring attention per step;
* max ring: the widest ring of a step (the largest over the measured steps);
* peak saved MB: the most bytes of saved activations one rank kept resident at once (measured
  by the offload context's hooks in every mode, the largest rank, averaged over steps); with
  offload, each micro-batch of a long sequence holds more tokens but keeps only Eq. 3's share
  of them resident;
* offloaded MB/step: activation bytes all ranks sent to host memory (the ``offload`` mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODE_ORDER = ("static", "naive", "balance", "offload")


@dataclass(frozen=True, kw_only=True)
class ModeSummary:
    """Averages of one mode on one dataset."""

    mode: str
    label: str
    steps_measured: int
    tokens_per_s: float
    tokens_per_busy_s: float
    max_busy_s: float
    mean_busy_s: float
    p2p_bytes: float
    final_loss: float
    losses: tuple[float, ...]
    busy_by_rank: tuple[float, ...]
    micro_batches_by_rank: tuple[float, ...]
    max_ring: int | None = None
    peak_saved_bytes: float | None = None
    offloaded_bytes: float = 0.0

    @property
    def imbalance(self) -> float:
        return self.max_busy_s / self.mean_busy_s if self.mean_busy_s > 0 else math.nan


def summarize_mode(mode: str, data: dict[str, Any]) -> ModeSummary:
    steps = data["steps"]
    measured = steps[1:] if len(steps) >= 3 else steps
    n = len(measured)
    ranks = len(measured[0]["busy_s"])
    tokens = sum(s["tokens"] for s in measured)
    wall = sum(s["wall_s"] for s in measured)
    max_busy = [max(s["busy_s"]) for s in measured]
    return ModeSummary(
        mode=mode,
        label=data["label"],
        steps_measured=n,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        tokens_per_busy_s=tokens / sum(max_busy) if sum(max_busy) > 0 else 0.0,
        max_busy_s=sum(max_busy) / n,
        mean_busy_s=sum(sum(s["busy_s"]) / ranks for s in measured) / n,
        p2p_bytes=sum(s["p2p_bytes"] for s in measured) / n,
        final_loss=steps[-1]["loss"],
        losses=tuple(s["loss"] for s in steps),
        busy_by_rank=tuple(sum(s["busy_s"][r] for s in measured) / n for r in range(ranks)),
        micro_batches_by_rank=tuple(
            sum(s["micro_batches"][r] for s in measured) / n for r in range(ranks)
        ),
        max_ring=max((s["max_ring_size"] for s in measured), default=None) if "max_ring_size" in measured[0] else None,
        peak_saved_bytes=(sum(max(s["peak_saved_bytes"]) for s in measured) / n
                          if measured[0].get("peak_saved_bytes") else None),
        offloaded_bytes=sum(s.get("offloaded_bytes", 0) for s in measured) / n,
    )


def summarize(results: dict[str, Any]) -> dict[str, list[ModeSummary]]:
    """Per dataset, the summaries of its modes in static, naive, balance, offload order."""
    out: dict[str, list[ModeSummary]] = {}
    for name, data in results["datasets"].items():
        modes = [m for m in MODE_ORDER if m in data["modes"]]
        out[name] = [summarize_mode(m, data["modes"][m]) for m in modes]
    return out


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def comparison_rows(summaries: list[ModeSummary]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table (ratios against static when it ran)."""
    base = next((s for s in summaries if s.mode == "static"), None)
    headers = [
        "mode",
        "tokens/s",
        "vs static",
        "tokens/busy-s",
        "vs static",
        "max busy s",
        "mean busy s",
        "max/mean",
        "P2P MB/step",
        "vs static",
        "max ring",
        "peak saved MB",
        "offloaded MB/step",
        "final loss",
    ]
    rows = []
    for s in summaries:
        rows.append([
            s.label,
            f"{s.tokens_per_s:,.0f}",
            _ratio(s.tokens_per_s, base.tokens_per_s) if base else "-",
            f"{s.tokens_per_busy_s:,.0f}",
            _ratio(s.tokens_per_busy_s, base.tokens_per_busy_s) if base else "-",
            f"{s.max_busy_s:.3f}",
            f"{s.mean_busy_s:.3f}",
            f"{s.imbalance:.2f}",
            f"{s.p2p_bytes / 1e6:.2f}",
            _ratio(s.p2p_bytes, base.p2p_bytes) if base and base.p2p_bytes > 0 else "-",
            "-" if s.max_ring is None else str(s.max_ring),
            "-" if s.peak_saved_bytes is None else f"{s.peak_saved_bytes / 1e6:.2f}",
            f"{s.offloaded_bytes / 1e6:.2f}",
            f"{s.final_loss:.3f}",
        ])  # fmt: skip
    return headers, rows


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """A fixed-width table for the terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def settings_line(results: dict[str, Any]) -> str:
    s = results["settings"]
    ranks = results["world_size"]
    tokens = s["ranks"] * s["capacity"] * s["micro_batches_per_rank"]
    return (
        f"{ranks} CPU ranks (gloo, Megatron CP=1 / DP={ranks}), GPT {s['num_layers']} layers, "
        f"hidden {s['hidden_size']}, {s['num_attention_heads']} heads "
        f"({s['num_query_groups']} KV groups), vocab {results['vocab_size']}; "
        f"capacity C={s['capacity']}, context {s['context_length']} "
        f"(static CP={s['context_length'] // s['capacity']}), {tokens} tokens/step, "
        f"{s['steps']} steps per mode (first excluded from averages), same initial weights and "
        "global batches in every mode"
    )


def write_plot(results: dict[str, Any], path: str | Path) -> Path:
    """Loss curves and per-rank busy time (mean per step) per mode, one row per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = summarize(results)
    rows = len(summaries)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.6 * rows), squeeze=False)
    for row, (name, modes) in enumerate(summaries.items()):
        loss_ax, busy_ax = axes[row]
        for s in modes:
            loss_ax.plot(range(len(s.losses)), s.losses, marker=".", label=s.label)
        loss_ax.set_title(f"{name}: loss per step (same math in every mode: curves coincide)")
        loss_ax.set_xlabel("step")
        loss_ax.set_ylabel("token-level loss")
        loss_ax.legend()
        ranks = len(modes[0].busy_by_rank)
        width = 0.8 / len(modes)
        for i, s in enumerate(modes):
            xs = [r + (i - (len(modes) - 1) / 2) * width for r in range(ranks)]
            busy_ax.bar(xs, [b * 1000 for b in s.busy_by_rank], width=width, label=s.label)
        busy_ax.set_xticks(range(ranks))
        busy_ax.set_xticklabels([f"rank {r}" for r in range(ranks)])
        busy_ax.set_title(f"{name}: busy CPU time per rank per step")
        busy_ax.set_ylabel("ms")
        busy_ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def benchmark_markdown(results: dict[str, Any], machine: str) -> str:
    """The ``demo`` section of docs/benchmarks.md."""
    parts = [
        "## demo: static DP x CP vs HDP naive vs HDP balance (bytescale demo)",
        "",
        machine,
        "",
        settings_line(results) + ".",
        "",
        "tokens/s = tokens / step wall time (4 ranks share 2 cores, so wall time includes waiting "
        "for a core); tokens/busy-s = tokens / busy CPU time of the slowest rank (the rate with "
        "one core per rank); busy = CPU time in micro-batches per rank; P2P = ring-attention bytes "
        "sent by all ranks per step.",
    ]
    for name, modes in summarize(results).items():
        headers, rows = comparison_rows(modes)
        parts += [
            "",
            f"### {name}: {results['datasets'][name]['description']}",
            "",
            markdown_table(headers, rows),
        ]
    return "\n".join(parts) + "\n"
