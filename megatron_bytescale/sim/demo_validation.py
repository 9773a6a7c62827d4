"""The simulator against measured runs: predict ``bytescale demo``'s steps and compare.

``bytescale demo`` trains the same global batches three ways (static DP x CP, HDP naive, HDP
balance) on CPU ranks, calibrates the cost model it plans with on that machine, and records
per step the batch's lengths, the plan's hash, every rank's busy CPU time and every
micro-batch's CPU time (``results.json``). Here every step is planned again with the demo's own
calibrated cost model (the plan hash must match: same plan, so any difference is the model of
time, not the plan), simulated with :func:`.step.simulate_step`, and compared:

* **busy time per rank**: CPU seconds in micro-batches (the rank's compute thread, see
  :mod:`megatron_bytescale.integration.busy_clock`); predicted = the sum of the rank's
  micro-batch times;
* **step time, one core per rank**: the slowest rank's busy time (the demo's "tokens/busy-s"
  column), and the ratios static / balance and naive / balance;
* **step time on the machine**: the micro-batch phase's wall time. The demo's ranks share
  fewer cores than there are ranks, so the prediction is ``max(phase with one core per rank,
  total busy CPU seconds / cores)``: nobody runs faster than on a core of its own, and all
  ranks together never get more than the machine's cores (other work on the machine takes
  cores too, which this cannot know);
* **per micro-batch**: measured against predicted CPU time by ring size and by the number of
  documents a micro-batch carries, which shows which term of the model is off.
  :func:`fit_residual_terms` fits ``measured = scale * predicted + per_doc_step * documents *
  ring size`` (rings only) to those records: ``scale`` is a slowdown of everything (cores
  shared with the other ranks and other work, which the single-process calibration does not
  see), ``per_doc_step`` a cost per document per ring step beyond the cost model's own
  ``per_document_s`` (0 when the calibration measured that term right).

``timing_model`` (:func:`validate_demo`) times the demo's plans with another cost model than the
one that made them, e.g. :func:`without_document_term`: what the validation would say without
the per-document term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..planner.cost_model import CostModel
from ..planner.estimate import micro_batch_costs
from ..planner.schedulers import make_plan
from .step import simulate_step

MODES = ("static", "naive", "balance")


@dataclass(frozen=True, kw_only=True)
class MicroBatchSample:
    """One rank's measured micro-batch next to its prediction."""

    dataset: str
    mode: str
    step: int
    rank: int
    ring_size: int
    documents: int
    predicted_s: float
    measured_s: float


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
    samples: tuple[MicroBatchSample, ...] = ()

    @property
    def busy_error(self) -> float:
        """Mean absolute relative error of the per-rank busy times."""
        m, p = np.asarray(self.measured_busy_by_rank), np.asarray(self.predicted_busy_by_rank)
        return float(np.mean(np.abs(p - m) / np.maximum(m, 1e-12)))


def validate_mode(
    dataset: str,
    mode: str,
    steps: Sequence[Mapping[str, Any]],
    *,
    settings: Mapping[str, Any],
    cost_model: CostModel,
    cores: int,
    timing_model: CostModel | None = None,
) -> ModeValidation:
    """Replan, simulate and compare every step in ``steps`` (the demo's rows of one mode);
    ``timing_model`` (default ``cost_model``) times the plans ``cost_model`` made."""
    timer = cost_model if timing_model is None else timing_model
    ranks = len(steps[0]["busy_s"])
    measured_busy, predicted_busy = np.zeros(ranks), np.zeros(ranks)
    measured_max = predicted_max = measured_wall = dedicated = shared = 0.0
    matching = 0
    samples: list[MicroBatchSample] = []
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
        result = simulate_step(plan, timer)
        busy = np.asarray(row["busy_s"], dtype=np.float64)
        measured_busy += busy
        predicted_busy += result.rank_busy_s
        measured_max += float(busy.max())
        predicted_max += float(result.rank_busy_s.max())
        measured_wall += float(row.get("phase_wall_s", row["wall_s"]))
        dedicated += result.micro_batch_phase_s
        shared += max(result.micro_batch_phase_s, float(result.rank_busy_s.sum()) / cores)
        costs = micro_batch_costs(plan, timer)
        seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
        documents = {mb.order: len(mb.seqs) for rp in plan.ranks for mb in rp.micro_batches}
        for rank, records in enumerate(row.get("micro_batch_records", [])):
            for order, ring_size, _tokens, cpu_s, _wall_s in records:
                samples.append(MicroBatchSample(
                    dataset=dataset, mode=mode, step=int(row["step"]), rank=rank, ring_size=int(ring_size),
                    documents=documents[int(order)], predicted_s=seconds[int(order)], measured_s=float(cpu_s),
                ))  # fmt: skip
    n = len(steps)
    return ModeValidation(
        dataset=dataset, mode=mode, steps=n, plans_matching=matching,
        measured_busy_by_rank=tuple(float(x) for x in measured_busy / n),
        predicted_busy_by_rank=tuple(float(x) for x in predicted_busy / n),
        measured_max_busy_s=measured_max / n, predicted_max_busy_s=predicted_max / n,
        measured_phase_wall_s=measured_wall / n, predicted_phase_dedicated_s=dedicated / n,
        predicted_phase_shared_s=shared / n, cores=cores, samples=tuple(samples),
    )  # fmt: skip


def without_document_term(cost_model: CostModel) -> CostModel:
    """``cost_model`` as it was before the per-document term: ``gamma`` takes back the one
    document a single-sequence calibration timing held (:meth:`.planner.profile.RingTermsFit.apply`)."""
    return cost_model.with_(per_document_s=0.0, gamma=cost_model.gamma + cost_model.per_document_s)


def validate_demo(results: Mapping[str, Any], *, cores: int | None = None, skip_first: bool = True,
                  timing_model: CostModel | None = None) -> list[ModeValidation]:
    """Every dataset x mode of a demo ``results.json`` (the first step of each mode is left out,
    as in the demo's own table: it pays one-time set-up costs); ``timing_model``: see
    :func:`validate_mode`."""
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
            out.append(validate_mode(dataset, mode, steps, settings=settings, cost_model=cost_model, cores=cores,
                                     timing_model=timing_model))
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


RATIOS = (("static", "balance"), ("naive", "balance"), ("static", "naive"))


def ratio_checks(validations: Sequence[ModeValidation]) -> list[RatioCheck]:
    """static / balance, naive / balance and static / naive, busy and wall, per dataset."""
    by = {(v.dataset, v.mode): v for v in validations}
    out = []
    for dataset in dict.fromkeys(v.dataset for v in validations):
        for mode, other in RATIOS:
            v, base = by.get((dataset, mode)), by.get((dataset, other))
            if v is None or base is None:
                continue
            out.append(RatioCheck(dataset=dataset, ratio=f"{mode} / {other}", kind="busy",
                                  measured=v.measured_max_busy_s / base.measured_max_busy_s,
                                  predicted=v.predicted_max_busy_s / base.predicted_max_busy_s))
            out.append(RatioCheck(dataset=dataset, ratio=f"{mode} / {other}", kind="wall",
                                  measured=v.measured_phase_wall_s / base.measured_phase_wall_s,
                                  predicted=v.predicted_phase_shared_s / base.predicted_phase_shared_s))
    return out


@dataclass(frozen=True, kw_only=True)
class ResidualTerms:
    """``measured = scale * predicted + per_doc_step * documents * ring size`` (rings only)."""

    scale: float
    per_doc_step_s: float
    """Seconds per document per ring step, all layers, forward and backward together."""
    samples: int

    def corrected(self, s: MicroBatchSample) -> float:
        extra = self.per_doc_step_s * s.documents * s.ring_size if s.ring_size > 1 else 0.0
        return self.scale * s.predicted_s + extra


def fit_residual_terms(samples: Sequence[MicroBatchSample]) -> ResidualTerms:
    """Least squares of the two terms over ``samples`` (see the module docstring)."""
    if len(samples) < 2:
        raise ValueError("need at least 2 micro-batch samples to fit the residual terms")
    pred = np.array([s.predicted_s for s in samples])
    docs = np.array([s.documents * s.ring_size if s.ring_size > 1 else 0 for s in samples], dtype=np.float64)
    meas = np.array([s.measured_s for s in samples])
    coef, *_ = np.linalg.lstsq(np.stack([pred, docs], axis=1), meas, rcond=None)
    return ResidualTerms(scale=float(coef[0]), per_doc_step_s=float(coef[1]), samples=len(samples))


def held_out_ratio_checks(validations: Sequence[ModeValidation]) -> list[RatioCheck]:
    """The busy-time ratios again with the residual terms fitted on the *other* datasets'
    micro-batches (leave one dataset out), applied to this one's: whether the two terms
    explain the miss rather than absorb it."""
    datasets = list(dict.fromkeys(v.dataset for v in validations))
    out: list[RatioCheck] = []
    for dataset in datasets:
        train = [s for v in validations if v.dataset != dataset for s in v.samples]
        if len(datasets) < 2 or not train:
            continue
        terms = fit_residual_terms(train)
        busy: dict[str, float] = {}
        measured: dict[str, float] = {}
        for v in validations:
            if v.dataset != dataset:
                continue
            per_step_rank: dict[tuple[int, int], float] = {}
            for s in v.samples:
                per_step_rank[(s.step, s.rank)] = per_step_rank.get((s.step, s.rank), 0.0) + terms.corrected(s)
            steps = sorted({k[0] for k in per_step_rank})
            busy[v.mode] = float(np.mean([max(per_step_rank.get((st, r), 0.0) for r in range(len(v.measured_busy_by_rank)))
                                          for st in steps]))
            measured[v.mode] = v.measured_max_busy_s
        for mode in ("static", "naive"):
            if mode in busy and "balance" in busy:
                out.append(RatioCheck(dataset=dataset, ratio=f"{mode} / balance", kind="busy, held-out terms",
                                      measured=measured[mode] / measured["balance"],
                                      predicted=busy[mode] / busy["balance"]))
    return out


def ratio_by_documents(samples: Sequence[MicroBatchSample], bins: Sequence[int] = (1, 2, 5, 20)) -> list[tuple[str, str, int, float]]:
    """(kind, documents range, micro-batches, mean measured / predicted) for local packs and rings."""
    edges = list(bins) + [1 << 30]
    out = []
    for kind, keep in (("local pack", lambda s: s.ring_size == 1), ("ring", lambda s: s.ring_size > 1)):
        for lo, hi in zip(edges, edges[1:]):
            sel = [s for s in samples if keep(s) and lo <= s.documents < hi]
            if sel:
                label = f"{lo}" if hi == lo + 1 else (f"{lo}-{hi - 1}" if hi < 1 << 30 else f">= {lo}")
                ratio = sum(s.measured_s for s in sel) / sum(s.predicted_s for s in sel)
                out.append((kind, label, len(sel), ratio))
    return out
