"""Per-step HDP metrics: what the plan did to the step, and what it cost each rank.

Megatron's log shows a loss and a time per iteration; under HDP a user also wants to see the
plan at work. Per step, the same numbers on every rank:

* from the plan (no communication): rings by size, micro-batches per rank (min / mean / max),
  the cost model's estimated balance (step time over the perfect-balance lower bound, 1.0 is
  perfect; 0 for a plan without an estimate) and the micro-batches planned with activation
  offload;
* measured, gathered over the HDP group in ONE ``all_gather`` of three numbers per rank: the
  slowest and fastest rank's busy time in its micro-batches and the idle fraction
  (``1 - mean / max`` busy: the share of rank time spent waiting for the slowest at the
  gradient reduction), the P2P bytes the rings sent, and the longest wait for a plan;
* with activation offload on (an offloader's step totals passed in), two more numbers in the
  same ``all_gather``: the bytes all ranks offloaded to host memory and the largest resident
  saved bytes of any rank (measured by the offload hooks; without an offloader nothing
  measures them, so they are left out rather than shown as 0).

:func:`gather_step_metrics` returns them as 1-element tensors on the group's collective device
(no host synchronisation: Megatron's path hands them on as loss reports and reads them only
when it logs); :meth:`HDPStepMetrics.from_tensors` turns them into numbers for a step record
or a log line.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_bytescale.data.hdp_iterator import HDPStep
    from megatron_bytescale.planner.plan import StepPlan
    from megatron_bytescale.runtime.offload import OffloadStats

__all__ = ["METRIC_NAMES", "OFFLOAD_METRIC_NAMES", "HDPStepMetrics", "gather_step_metrics",
           "rings_by_size"]

#: Names of the scalar metrics, as they appear in Megatron's log line, TensorBoard and W&B.
METRIC_NAMES: dict[str, str] = {
    "rings": "hdp rings>1",
    "largest_ring": "hdp largest ring",
    "micro_batches_min": "hdp mb/rank min",
    "micro_batches_mean": "hdp mb/rank mean",
    "micro_batches_max": "hdp mb/rank max",
    "estimated_balance": "hdp est. balance",
    "busy_max_s": "hdp busy max s",
    "busy_min_s": "hdp busy min s",
    "idle_fraction": "hdp idle frac",
    "p2p_mb": "hdp p2p MB",
    "plan_wait_ms": "hdp plan wait ms",
    "offloaded_micro_batches": "hdp offloaded mb",
}

#: With activation offload on: what the offload hooks measured (all ranks' bytes moved to host
#: memory; the largest resident saved bytes of one rank).
OFFLOAD_METRIC_NAMES: dict[str, str] = {
    "offloaded_mb": "hdp offload MB",
    "peak_saved_mb": "hdp peak saved MB",
}


def rings_by_size(plan: "StepPlan") -> tuple[tuple[int, int], ...]:
    """``(ring size, number of ring micro-batches of that size)``, by size (1: local packs)."""
    return tuple(sorted(Counter(plan.ring_sizes()).items()))


def _plan_values(plan: "StepPlan") -> dict[str, float]:
    counts = plan.micro_batch_counts()
    sizes = plan.ring_sizes()
    offloaded = {mb.order for r in plan.ranks for mb in r.micro_batches if mb.offload_ratio > 0}
    balance = 0.0  # no estimate (a hand-made plan): 0, which Megatron's log line leaves out
    if plan.estimate is not None:
        balance = float(plan.estimate.extra.get("balance_ratio", 0.0))
    return {
        "rings": float(sum(1 for s in sizes if s > 1)),
        "largest_ring": float(max(sizes, default=0)),
        "micro_batches_min": float(min(counts, default=0)),
        "micro_batches_mean": float(sum(counts) / max(len(counts), 1)),
        "micro_batches_max": float(max(counts, default=0)),
        "estimated_balance": balance,
        "offloaded_micro_batches": float(len(offloaded)),
    }


def gather_step_metrics(step: "HDPStep", *, busy_s: float, p2p_bytes: int, group: Any,
                        offload: Optional["OffloadStats"] = None) -> dict[str, torch.Tensor]:
    """The step's metrics (keys of :data:`METRIC_NAMES`, and of :data:`OFFLOAD_METRIC_NAMES`
    when ``offload`` is given) as 1-element float tensors.

    Every rank of the HDP ``group`` must call it for the same step (one ``all_gather``), all
    with or all without ``offload``; ``busy_s``, ``p2p_bytes`` and ``offload`` (the offloader's
    step totals) are this rank's.
    """
    from megatron_bytescale.runtime.hdp_group import collective_device

    device = collective_device(group) if group is not None else torch.device("cpu")
    row = [float(busy_s), float(p2p_bytes), float(step.plan_wait_s)]
    if offload is not None:
        row += [float(offload.offloaded_bytes), float(offload.peak_resident_bytes)]
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    size = dist.get_world_size(group) if group is not None else 1
    if size > 1:
        parts = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine, group=group)
        table = torch.stack(parts)
    else:
        table = mine.view(1, len(row))
    busy, sent, wait = table[:, 0], table[:, 1], table[:, 2]
    busy_max = busy.max()
    measured = {
        "busy_max_s": busy_max,
        "busy_min_s": busy.min(),
        "idle_fraction": torch.where(busy_max > 0, 1.0 - busy.mean() / busy_max,
                                     torch.zeros_like(busy_max)),
        "p2p_mb": sent.sum() / 1e6,
        "plan_wait_ms": wait.max() * 1e3,
    }
    names = list(METRIC_NAMES)
    if offload is not None:
        measured["offloaded_mb"] = table[:, 3].sum() / 1e6
        measured["peak_saved_mb"] = table[:, 4].max() / 1e6
        names += list(OFFLOAD_METRIC_NAMES)
    out = {k: torch.tensor([v], dtype=torch.float32, device=device)
           for k, v in _plan_values(step.plan).items()}
    out.update({k: v.float().view(1) for k, v in measured.items()})
    return {k: out[k] for k in names}


@dataclass(frozen=True, kw_only=True)
class HDPStepMetrics:
    """One step's HDP metrics as numbers (see the module docstring for their meaning)."""

    step: int
    rings_by_size: tuple[tuple[int, int], ...]
    rings: int
    largest_ring: int
    micro_batches_min: int
    micro_batches_mean: float
    micro_batches_max: int
    estimated_balance: float
    busy_max_s: float
    busy_min_s: float
    idle_fraction: float
    p2p_mb: float
    plan_wait_ms: float
    offloaded_micro_batches: int
    offloaded_mb: Optional[float] = None
    """MB all ranks offloaded to host memory (None: the step ran without an offloader)."""
    peak_saved_mb: Optional[float] = None
    """Largest resident saved activations of one rank, MB (None: without an offloader)."""

    @classmethod
    def from_tensors(cls, step: "HDPStep", values: Mapping[str, torch.Tensor]
                     ) -> "HDPStepMetrics":
        """From :func:`gather_step_metrics`' tensors (reads them back to the host)."""
        keys = [k for k in (*METRIC_NAMES, *OFFLOAD_METRIC_NAMES) if k in values]
        numbers = torch.cat([values[k].detach().float().cpu().view(-1) for k in keys]).tolist()
        got = dict(zip(keys, numbers))
        ints = ("rings", "largest_ring", "micro_batches_min", "micro_batches_max",
                "offloaded_micro_batches")
        return cls(step=step.index, rings_by_size=rings_by_size(step.plan),
                   **{k: int(round(v)) if k in ints else float(v) for k, v in got.items()})

    def scalars(self) -> dict[str, float]:
        """``{name in METRIC_NAMES: value}`` (plus ``hdp rings of size N``), for a writer."""
        out = {name: float(getattr(self, key)) for key, name in METRIC_NAMES.items()}
        out.update({name: float(getattr(self, key)) for key, name in OFFLOAD_METRIC_NAMES.items()
                    if getattr(self, key) is not None})
        out.update({f"hdp rings of size {size}": float(n) for size, n in self.rings_by_size})
        return out

    def summary(self) -> str:
        """One line: ``rings 1x8 2x1 | micro-batches/rank 3/3.5/4 | ...``."""
        rings = " ".join(f"{size}x{n}" for size, n in self.rings_by_size) or "none"
        offload = ""
        if self.offloaded_mb is not None and self.peak_saved_mb is not None:
            offload = (f" | offload {self.offloaded_mb:.3f} MB, peak saved "
                       f"{self.peak_saved_mb:.3f} MB")
        return (
            f"rings {rings} | micro-batches/rank min/mean/max {self.micro_batches_min}/"
            f"{self.micro_batches_mean:.2f}/{self.micro_batches_max} | estimated balance "
            f"{self.estimated_balance:.3f} | busy max {self.busy_max_s:.3f} s min "
            f"{self.busy_min_s:.3f} s, idle {100 * self.idle_fraction:.1f}% | P2P "
            f"{self.p2p_mb:.3f} MB | plan wait {self.plan_wait_ms:.1f} ms | offloaded "
            f"micro-batches {self.offloaded_micro_batches}{offload}"
        )
