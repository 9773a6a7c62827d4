"""Megatron's own hybrid (dynamic) context parallelism as a baseline: its scheduler, run as is.

megatron-core 0.19 schedules ``--hybrid-context-parallel`` with
``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler``: Megatron's
``HybridCPDataLoaderWrapper`` gathers the global batch's sub-sample lengths, builds the
scheduler with ``max_seq_len_per_rank = --max-seqlen-per-dp-cp-rank`` over the DP x CP group and
calls ``get_groups_and_subsamples``, which returns, per group, the sample ids every DP x CP rank
runs (a sample on k ranks runs as a CP ring of k); the ranks meet at a barrier after each group.
:func:`plan_megatron_hybrid_cp` makes exactly those two calls on the batch it is given (nothing
of the scheduler is re-implemented here) and hands the result to the planner's
:func:`~megatron_bytescale.planner.schedulers.external.plan_from_rank_schedules`, which costs it
with the same cost model and estimator as ByteScale's own rows.

The only stand-in is the process group: the scheduler reads nothing of it but ``size()``, so a
plain object with that method replaces a real DP x CP group (no ``torch.distributed`` needed).
Megatron-core 0.16.1 has no such scheduler: :func:`megatron_hybrid_cp_unavailable` says why.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

from ..planner.cost_model import CostModel
from ..planner.plan import StepPlan
from ..planner.schedulers.external import plan_from_rank_schedules
from ..planner.topology import Topology

#: The scheduler name of the row in ``bytescale plan --compare`` and the benchmarks.
NAME = "megatron-hybrid-cp"
#: What the row is called in tables.
LABEL = "Megatron hybrid CP"


class _GroupOfSize:
    """What ``BalancedCPScheduler`` reads of its DP x CP process group: its size."""

    def __init__(self, size: int) -> None:
        self._size = int(size)

    def size(self) -> int:
        return self._size


def megatron_hybrid_cp_unavailable() -> Optional[str]:
    """None if megatron-core's hybrid CP scheduler can run here, else why not (one line)."""
    from .compat import (
        UnsupportedMegatronVersion,
        has_megatron_hybrid_cp_scheduler,
        megatron_core_version,
    )

    try:
        has_scheduler = has_megatron_hybrid_cp_scheduler()
    except UnsupportedMegatronVersion as exc:  # not installed, or a version we do not support
        return str(exc)
    if not has_scheduler:
        found = ".".join(map(str, megatron_core_version()))
        return (f"needs megatron-core 0.19 (Python 3.12+); megatron-core {found} has no "
                "hybrid context-parallel scheduler")
    return None


def plan_megatron_hybrid_cp(lengths: Any, *, hdp_size: int, capacity: int, cost_model: CostModel,
                            align: int = 1, topology: Optional[Topology] = None,
                            context_length: Optional[int] = None) -> StepPlan:
    """The plan Megatron's hybrid CP scheduler makes for ``lengths`` on ``hdp_size`` ranks.

    ``capacity`` is Megatron's ``--max-seqlen-per-dp-cp-rank``. Raises ValueError when Megatron
    cannot run the batch (a sequence needs a power-of-two ring larger than ``hdp_size``: its
    scheduler would never place it) or is not available here.
    """
    why = megatron_hybrid_cp_unavailable()
    if why is not None:
        raise ValueError(f"{LABEL} is unavailable: {why}")
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    hdp_size, capacity = int(hdp_size), int(capacity)
    if hdp_size < 1 or capacity < 1:
        raise ValueError(f"hdp_size ({hdp_size}) and capacity ({capacity}) must be >= 1")
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=capacity,
                                    dp_cp_group=_GroupOfSize(hdp_size))
    if arr.size:
        longest = int(arr.max())
        need = scheduler.gpus_needed(longest)
        if need > hdp_size:
            raise ValueError(
                f"Megatron hybrid CP gives a sequence of {longest:,} tokens a ring of {need} ranks "
                f"(the next power of two of length / --max-seqlen-per-dp-cp-rank {capacity:,}), "
                f"more than the {hdp_size} DP x CP ranks; its scheduler would never place it"
            )
    config = SimpleNamespace(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=capacity)
    sample_id_seqlens = [(i, int(n)) for i, n in enumerate(arr.tolist())]
    try:
        _, sample_id_groups = scheduler.get_groups_and_subsamples(sample_id_seqlens, config)
    except (AssertionError, TypeError, IndexError) as exc:  # Megatron's own checks
        raise ValueError(f"Megatron's hybrid CP scheduler failed on this batch: "
                         f"{type(exc).__name__}: {exc}") from None
    return plan_from_rank_schedules(
        arr, sample_id_groups, scheduler=NAME, hdp_size=hdp_size, capacity=capacity,
        cost_model=cost_model, align=align, topology=topology, context_length=context_length,
        meta={"source": "megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler",
              "megatron_core": _version_string()},
    )


def _version_string() -> str:
    from .compat import megatron_core_version

    return ".".join(map(str, megatron_core_version()))
