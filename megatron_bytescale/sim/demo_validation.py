"""The simulator against measured runs: predict ``bytescale demo``'s steps and compare.

``bytescale demo`` trains the same global batches three ways (static DP x CP, HDP naive, HDP
balance) on CPU ranks, calibrates the cost model it plans with on that machine, and records
per step the batch's lengths, the plan's hash, every rank's busy CPU time and every
micro-batch's CPU time (``results.json``). Here every step is planned again with the demo's own
calibrated cost model (the plan hash must match: same plan, so any difference is the model of
time, not the plan), simulated with :func:`.step.simulate_step`, and compared:

* **busy time per rank**: CPU seconds in micro-batches, predicted = the sum of the rank's
  micro-batch times;
* **step time, one core per rank**: the slowest rank's busy time (what the demo's
  "tokens/busy-s" column uses), and the ratios static / balance and naive / balance;
* **step time on the machine**: the micro-batch phase's wall time. The demo's ranks share
  fewer cores than there are ranks, so the prediction is ``max(phase with one core per rank,
  total busy CPU seconds / cores)``: nobody runs faster than on a core of its own, and all
  ranks together never get more than the machine's cores;
* **per ring size**: measured over predicted CPU time of all micro-batches with that ring size,
  which says which term is off (local packs test ``T(s)``, rings add the communication and the
  calibrated ring step overhead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..planner.cost_model import CostModel
from ..planner.schedulers import make_plan
from .step import simulate_step

MODES = ("static", "naive", "balance")


@dataclass(frozen=True, kw_only=True)
class ModeValidation:
    """One mode on one dataset of a demo run: measured against predicted, per-step means."""

    dataset: str
    mode: str
    steps: int
    plans_matching: int
    """Steps whose replanned plan has the demo's plan hash."""
    measured_busy_by_rank: tuple[float, ...]
    predicted_busy_by_rank: tuple[float, ...]
    measured_max_busy_s: float
    predicted_max_busy_s: float
    measured_phase_wall_s: float
    predicted_phase_dedicated_s: float
    """The micro-batch phase with one core per rank (the simulator's step model)."""
    predicted_phase_shared_s: float
    """The same on ``cores`` cores: max(dedicated, total busy / cores)."""
    cores: int
    by_ring_size: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    """Ring size -> (measured CPU s, predicted CPU s, micro-batches), summed over ranks and steps."""

    @property
    def busy_error(self) -> float:
        """Mean absolute relative error of the per-rank busy times."""
        m, p = np.asarray(self.measured_busy_by_rank), np.asarray(self.predicted_busy_by_rank)
        return float(np.mean(np.abs(p - m) / np.maximum(m, 1e-12)))


def _sum(x: Sequence[float]) -> float:
    return float(np.sum(np.asarray(x, dtype=np.float64)))


def validate_mode(
    dataset: str,
    mode: str,
    steps: Sequence[Mapping[str, Any]],
    *,
    settings: Mapping[str, Any],
    cost_model: CostModel,
    cores: int,
) -> ModeValidation:
    """Replan, simulate and compare every step in ``steps`` (the demo's rows of one mode)."""
    ranks = len(steps[0]["busy_s"])
    measured_busy = np.zeros(ranks)
    predicted_busy = np.zeros(ranks)
    measured_max = predicted_max = measured_wall = dedicated = shared = 0.0
    matching = 0
    by_size: dict[int, list[float]] = {}
    for row in steps:
        if "lengths" not in row:
            raise ValueError("this results.json has no per-step lengths; rerun bytescale demo to record them")
        plan = make_plan(
            [int(n) for n in row["lengths"]], scheduler=mode, hdp_size=ranks,
            capacity=int(settings["capacity"]), cost_model=cost_model,
            offload=bool(settings.get("offload", False)), align=int(settings.get("align", 1)),
            context_length=int(settings["context_length"]),
        )  # fmt: skip
        matching += plan.content_hash() == row.get("plan_hash")
        result = simulate_step(plan, cost_model)
        busy = np.asarray(row["busy_s"], dtype=np.float64)
        measured_busy += busy
        predicted_busy += result.rank_busy_s
        measured_max += float(busy.max())
        predicted_max += float(result.rank_busy_s.max())
        measured_wall += float(row.get("phase_wall_s", row["wall_s"]))
        dedicated += result.micro_batch_phase_s
        shared += max(result.micro_batch_phase_s, float(result.rank_busy_s.sum()) / cores)
        seconds = _order_seconds(plan, cost_model)
        for records in row.get("micro_batch_records", []):
            for order, ring_size, _tokens, cpu_s, _wall_s in records:
                acc = by_size.setdefault(int(ring_size), [0.0, 0.0, 0])
                acc[0] += float(cpu_s)
                acc[1] += seconds[int(order)]
                acc[2] += 1
    n = len(steps)
    return ModeValidation(
        dataset=dataset, mode=mode, steps=n, plans_matching=matching,
        measured_busy_by_rank=tuple(measured_busy / n), predicted_busy_by_rank=tuple(predicted_busy / n),
        measured_max_busy_s=measured_max / n, predicted_max_busy_s=predicted_max / n,
        measured_phase_wall_s=measured_wall / n, predicted_phase_dedicated_s=dedicated / n,
        predicted_phase_shared_s=shared / n, cores=cores,
        by_ring_size={k: (v[0], v[1], int(v[2])) for k, v in sorted(by_size.items())},
    )  # fmt: skip


def _order_seconds(plan: Any, cost_model: CostModel) -> dict[int, float]:
    from ..planner.estimate import micro_batch_costs

    costs = micro_batch_costs(plan, cost_model)
    return dict(zip(costs.orders.tolist(), costs.seconds.tolist()))


def validate_demo(results: Mapping[str, Any], *, cores: int | None = None, skip_first: bool = True) -> list[ModeValidation]:
    """Every dataset x mode of a demo ``results.json`` (the first step of each mode is left out,
    as in the demo's own table: it pays one-time set-up costs)."""
    cost_model = CostModel.from_dict(results["calibration"]["cost_model"])
    settings = results["settings"]
    cores = int(cores or results.get("cpu_count") or 1)
    out = []
    for dataset, data in results["datasets"].items():
        for mode in MODES:
            if mode not in data["modes"]:
                continue
            steps = data["modes"][mode]["steps"]
            steps = steps[1:] if skip_first and len(steps) >= 3 else steps
            out.append(validate_mode(dataset, mode, steps, settings=settings, cost_model=cost_model, cores=cores))
    return out


@dataclass(frozen=True, kw_only=True)
class RatioCheck:
    """A step-time ratio between two modes, measured and predicted."""

    dataset: str
    ratio: str
    """E.g. ``"static / balance"``."""
    kind: str
    """``"busy"`` (slowest rank's CPU time) or ``"wall"`` (micro-batch phase on the machine)."""
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted / self.measured - 1.0 if self.measured > 0 else math.nan


def ratio_checks(validations: Sequence[ModeValidation]) -> list[RatioCheck]:
    """static / balance and naive / balance, busy and wall, per dataset."""
    by = {(v.dataset, v.mode): v for v in validations}
    out = []
    for dataset in dict.fromkeys(v.dataset for v in validations):
        base = by.get((dataset, "balance"))
        if base is None:
            continue
        for mode in ("static", "naive"):
            v = by.get((dataset, mode))
            if v is None:
                continue
            out.append(RatioCheck(dataset=dataset, ratio=f"{mode} / balance", kind="busy",
                                  measured=v.measured_max_busy_s / base.measured_max_busy_s,
                                  predicted=v.predicted_max_busy_s / base.predicted_max_busy_s))
            out.append(RatioCheck(dataset=dataset, ratio=f"{mode} / balance", kind="wall",
                                  measured=v.measured_phase_wall_s / base.measured_phase_wall_s,
                                  predicted=v.predicted_phase_shared_s / base.predicted_phase_shared_s))
    return out
