"""Tables (terminal and markdown) and JSON of simulated sweeps."""

from __future__ import annotations

import math
from typing import Any, Sequence

from .sweep import Summary, format_tokens

HEADERS = [
    "context", "variant", "step (s)", "tokens/s/GPU", "x first", "micro-batches (s)",
    "grad reduce (s)", "data wait (s)", "balance", "busy max/mean (s)", "compute",
    "exposed comm", "idle", "P2P", "planner wall here (s)",
]
NOTE = (
    "'x first' = throughput over the first variant at that context; 'micro-batches' = the "
    "slowest rank's micro-batch phase; 'balance' = that phase over total busy rank-seconds / "
    "ranks; 'compute', 'exposed comm' and 'idle' = shares of the phase's GPU-seconds (the rest "
    "is ring step overhead and exposed offload); P2P = ring bytes of one TP rank's group; "
    "'planner wall here' = the planner's wall time on this machine, in no simulated time "
    "('data wait' holds only the modelled --load-s and --plan-time-s)"
)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def rows(summaries: Sequence[Summary]) -> list[list[str]]:
    """One row per summary; 'x first' relative to the first successful variant of its context."""
    first: dict[Any, float] = {}
    out = []
    for s in summaries:
        ctx = format_tokens(s.context_length)
        if not s.ok:
            out.append([ctx, s.variant.name, "n/a"] + [""] * (len(HEADERS) - 3))
            continue
        base = first.setdefault(s.context_length, s.tokens_per_s)
        f = s.fractions
        out.append([
            ctx, s.variant.name, f"{s.step_time_s:.3g}", f"{s.tokens_per_s_per_gpu:,.1f}",
            f"{s.tokens_per_s / base:.2f}" if base > 0 else "-",
            f"{s.micro_batch_phase_s:.3g}", f"{s.grad_reduce_s:.3g}", f"{s.data_wait_s:.3g}",
            f"{s.balance_ratio:.2f}", f"{s.max_rank_busy_s:.3g}/{s.mean_rank_busy_s:.3g}",
            _pct(f.get("compute")), _pct(f.get("exposed_comm")), _pct(f.get("idle")), fmt_bytes(s.p2p_bytes),
            "-" if math.isnan(s.planner_wall_s) else f"{s.planner_wall_s:.3g}",
        ])  # fmt: skip
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def text_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Fixed-width columns for the terminal."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in body])


def markdown_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


def summary_table(summaries: Sequence[Summary], *, markdown: bool = False) -> str:
    body = rows(summaries)
    return markdown_table(HEADERS, body) if markdown else text_table(HEADERS, body)


def errors(summaries: Sequence[Summary]) -> list[str]:
    """One line per variant that did not apply, with the planner's reason."""
    seen, out = set(), []
    for s in summaries:
        if not s.ok and (s.variant.name, s.error) not in seen:
            seen.add((s.variant.name, s.error))
            where = f" at context {format_tokens(s.context_length)}" if s.context_length else ""
            out.append(f"{s.variant.name}{where}: not applicable: {s.error}")
    return out
