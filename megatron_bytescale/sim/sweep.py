"""Many simulated steps: every variant on every context length and every step's batch.

A sweep point is one global batch (a context length and a step index) on which every variant
is simulated (:func:`.variants.simulate_variants`). :func:`summarize` averages each
(context, variant) over the steps: throughput is total tokens over total step time, as a
training run would report it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .step import BREAKDOWN_TERMS, StepResult
from .variants import ClusterSetup, Variant, VariantOutcome, simulate_variants

LengthsFn = Callable[[int | None, int], Any]
"""``(context_length, step) -> sequence lengths of that step's global batch``."""


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    context_length: int | None
    step: int
    outcomes: tuple[VariantOutcome, ...]


@dataclass(frozen=True, kw_only=True)
class Summary:
    """One variant at one context length, averaged over the steps."""

    variant: Variant
    context_length: int | None
    steps: int
    step_time_s: float = math.nan
    tokens_per_s: float = math.nan
    tokens_per_s_per_gpu: float = math.nan
    micro_batch_phase_s: float = math.nan
    grad_reduce_s: float = math.nan
    optimizer_s: float = math.nan
    data_wait_s: float = math.nan
    plan_s: float = math.nan
    """Modelled planning time per step (an input, see :class:`.overheads.StepOverheads`)."""
    planner_wall_s: float = math.nan
    """Planner wall time per step on this machine (in no simulated time)."""
    balance_ratio: float = math.nan
    fractions: dict[str, float] = field(default_factory=dict)
    """Share of micro-batch GPU-seconds per :data:`.step.BREAKDOWN_TERMS` term (and ``comm``)."""
    max_rank_busy_s: float = math.nan
    mean_rank_busy_s: float = math.nan
    min_rank_busy_s: float = math.nan
    p2p_bytes: float = math.nan
    results: tuple[StepResult, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.steps > 0

    def to_dict(self, *, per_rank: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"variant": self.variant.name, "label": self.variant.label,
                               "context_length": self.context_length, "steps": self.steps}
        if not self.ok:
            out["error"] = self.error
            return out
        out.update(
            step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s,
            tokens_per_s_per_gpu=self.tokens_per_s_per_gpu, micro_batch_phase_s=self.micro_batch_phase_s,
            grad_reduce_s=self.grad_reduce_s, optimizer_s=self.optimizer_s, data_wait_s=self.data_wait_s,
            plan_s=self.plan_s, planner_wall_s=self.planner_wall_s, balance_ratio=self.balance_ratio,
            fractions=dict(self.fractions),
            max_rank_busy_s=self.max_rank_busy_s, mean_rank_busy_s=self.mean_rank_busy_s,
            min_rank_busy_s=self.min_rank_busy_s, p2p_bytes=self.p2p_bytes,
            step_results=[r.to_dict(per_rank=per_rank) for r in self.results],
        )  # fmt: skip
        return out


def run_sweep(
    lengths_for: LengthsFn,
    *,
    contexts: Sequence[int | None],
    steps: int,
    variants: Sequence[Variant],
    setup: ClusterSetup,
    progress: Callable[[str], None] | None = None,
) -> list[SweepPoint]:
    """Simulate every variant on the batch of every (context, step); report progress per result."""
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    total = len(contexts) * steps * len(variants)
    done = [0]
    start = time.perf_counter()

    def report(context: int | None, step: int, outcome: VariantOutcome) -> None:
        done[0] += 1
        if progress is None:
            return
        elapsed = time.perf_counter() - start
        eta = elapsed / done[0] * (total - done[0])
        where = f"context {format_tokens(context)}, " if context else ""
        if outcome.result is not None:
            r = outcome.result
            what = (f"step {r.step_time_s:.3g} s, {r.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
                    f"(planner wall time on this machine {r.planner_wall_s or 0.0:.2f} s)")
        else:
            what = "not applicable"
        progress(f"[{done[0]}/{total}] {where}step {step}, {outcome.variant.name}: {what}; eta {eta:.0f} s")

    points = []
    for context in contexts:
        for step in range(steps):
            lengths = lengths_for(context, step)
            outcomes = simulate_variants(
                lengths, variants, setup, context_length=context,
                on_result=lambda o, c=context, s=step: report(c, s, o),
            )
            points.append(SweepPoint(context_length=context, step=step, outcomes=tuple(outcomes)))
    return points


def summarize(points: Sequence[SweepPoint]) -> list[Summary]:
    """One :class:`Summary` per (context, variant), in sweep order."""
    groups: dict[tuple[int | None, str], list[VariantOutcome]] = {}
    variants: dict[str, Variant] = {}
    for p in points:
        for o in p.outcomes:
            groups.setdefault((p.context_length, o.variant.name), []).append(o)
            variants[o.variant.name] = o.variant
    out = []
    for (context, name), outcomes in groups.items():
        variant = variants[name]
        results = [o.result for o in outcomes if o.result is not None]
        if len(results) < len(outcomes):
            error = next(o.error for o in outcomes if o.result is None)
            out.append(Summary(variant=variant, context_length=context, steps=0, error=error))
            continue
        out.append(_summary(variant, context, results))
    return out


def _summary(variant: Variant, context: int | None, results: list[StepResult]) -> Summary:
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    step = sum(r.step_time_s for r in results)
    tokens = sum(r.tokens for r in results)
    gpus = results[0].num_gpus
    totals = {t: sum(r.breakdown[t] for r in results) for t in (*BREAKDOWN_TERMS, "comm")}
    gpu_s = sum(totals[t] for t in BREAKDOWN_TERMS)
    return Summary(
        variant=variant, context_length=context, steps=len(results),
        step_time_s=step / len(results),
        tokens_per_s=tokens / step if step > 0 else 0.0,
        tokens_per_s_per_gpu=tokens / step / gpus if step > 0 else 0.0,
        micro_batch_phase_s=mean([r.micro_batch_phase_s for r in results]),
        grad_reduce_s=mean([r.grad_reduce_s for r in results]),
        optimizer_s=mean([r.optimizer_s for r in results]),
        data_wait_s=mean([r.data_wait_s for r in results]),
        plan_s=mean([r.plan_s for r in results]),
        planner_wall_s=mean([r.planner_wall_s if r.planner_wall_s is not None else math.nan for r in results]),
        balance_ratio=mean([r.balance_ratio for r in results]),
        fractions={t: (totals[t] / gpu_s if gpu_s > 0 else 0.0) for t in totals},
        max_rank_busy_s=mean([float(r.rank_busy_s.max()) for r in results]),
        mean_rank_busy_s=mean([float(r.rank_busy_s.mean()) for r in results]),
        min_rank_busy_s=mean([float(r.rank_busy_s.min()) for r in results]),
        p2p_bytes=mean([r.p2p_bytes for r in results]),
        results=tuple(results),
    )


def drop_per_doubling(summaries: Sequence[Summary], variant: str) -> float:
    """How much ``variant``'s throughput falls per doubling of the context (paper §8.2:
    baseline ~2x, naive 1.23x, balance 1.08x on average): ``(T(shortest) / T(longest)) **
    (1 / doublings between them)``, the geometric mean of the per-doubling ratios. NaN
    without two context lengths."""
    points = sorted((s.context_length, s.tokens_per_s) for s in summaries
                    if s.variant.name == variant and s.ok and s.context_length)
    if len(points) < 2 or points[-1][1] <= 0:
        return math.nan
    (c0, t0), (c1, t1) = points[0], points[-1]
    return float((t0 / t1) ** (1.0 / math.log2(c1 / c0)))


def format_tokens(n: int | None) -> str:
    """``2097152 -> '2M'``, ``262144 -> '256K'``, other counts with separators."""
    if n is None:
        return "-"
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n:,}"


def parse_tokens(text: str) -> int:
    """``'256K' -> 262144``, ``'2M' -> 2097152``, ``'1.5M'``, plain integers; ValueError otherwise."""
    t = str(text).strip().upper()
    scale = 1
    if t.endswith("K"):
        scale, t = 2**10, t[:-1]
    elif t.endswith("M"):
        scale, t = 2**20, t[:-1]
    elif t.endswith("G"):
        scale, t = 2**30, t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a token count (write e.g. 262144, 256K or 2M)") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(f"{text!r} is not a whole token count >= 1")
    return int(value)
