"""PP-Balance's pick for interleaved (virtual) pipeline stages (step 7 of :mod:`.balance`).

PP-Balance ranks its candidates by plain 1F1B: its floors, its quick timing and its reorderings
(the next levels first, singles first) are all about the 1F1B window a long ring opens. Under
Megatron's interleaved schedule that window is ``virtual_pipeline_size`` times shorter and the
warm-up holds more forwards, so the 1F1B winner is often not the fastest interleaved: on the
Fig. 17 cells it was even slower interleaved than in plain 1F1B in 18 of 64 cell x V rows (LLaMA-70B
GitHub 2M, ``paper-fit``: 51.5 s in 1F1B, 58.4 s with 4 virtual stages), while another
candidate a few percent slower in 1F1B ran in 50.1 s interleaved. The 1F1B order is a poor
guide there (the fastest interleaved was up to the 17th of the candidates in 1F1B order), so
every candidate within :data:`INTERLEAVED_SLACK` of the 1F1B winner is timed interleaved, from
its placements like any candidate (:func:`.candidate_time.finish_times` with ``vpp``), and the
fastest is kept. The 1F1B winner is among them, so the plan is never slower interleaved than
the 1F1B winner would be. A candidate's timing stops as soon as it cannot beat the fastest so
far (``stop_above``), which changes no pick and saves about a third of this timing on the
Fig. 17 cells.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..cost_model import CostModel
from ..estimate import estimate_plan
from ..plan import StepPlan
from ._common import PlanRequest, emit_plan
from .candidate_time import finish_times, times_without_plan

INTERLEAVED_SLACK = 0.25
"""How much slower than the 1F1B winner, in plain 1F1B, a candidate may be and still be timed
interleaved (the floors let through whatever is within it). On the Fig. 17 PP cells the
fastest interleaved candidate was up to 21 % slower than it in plain 1F1B."""


def fastest_interleaved(request: PlanRequest, finalists: Sequence[tuple[tuple, tuple, dict]], best_1f1b: float, *,
                        scheduler: str) -> tuple[StepPlan, CostModel]:
    """The fastest of ``finalists`` under ``request.virtual_pipeline_size`` virtual stages, and
    the cost model it was timed with.

    ``finalists``: ``((1F1B step, tie-break index), (placements, meta, cost model), seconds)``
    of every candidate PP-Balance timed (``seconds``: the stage-time cache of its unit set);
    ``best_1f1b`` the fastest of their 1F1B steps. Those within :data:`INTERLEAVED_SLACK` of it
    are timed, in the order of their keys; ties keep that order (the 1F1B winner first). Timed
    from placements where :func:`.candidate_time.times_without_plan` holds (the winner then
    comes back without an estimate, which :func:`..make_plan` attaches: the same floats), else
    from their plans' estimates."""
    close = sorted((f for f in finalists if f[0][0] <= best_1f1b * (1 + INTERLEAVED_SLACK)), key=lambda f: f[0])
    if not close:
        raise ValueError("fastest_interleaved needs at least the 1F1B winner among the finalists")
    vpp = request.virtual_pipeline_size
    quick = times_without_plan(request)  # finish_times is told vpp; it reads neither that nor pieces
    best = None  # (step, rank, placements, meta, cost model, estimate or None)
    for rank, (_, (placements, meta, cost_model), seconds) in enumerate(close):
        meta = {**meta, "interleaved_timed": len(close)}
        # a candidate that cannot beat the best so far stops early (inf): ties go to the earlier rank
        stop = None if best is None else best[0]
        finish = finish_times(request, placements, cost_model, seconds, stop_above=stop, vpp=vpp) if quick else None
        if finish is not None:
            step, estimate = float(finish.max()), None
        else:
            timing = replace(request, pieces=False)
            estimate = estimate_plan(emit_plan(timing, placements, scheduler=scheduler, meta=meta), cost_model)
            step = estimate.step_time_s
        if best is None or (step, rank) < best[:2]:
            best = (step, rank, placements, meta, cost_model, estimate)
    _, rank, placements, meta, cost_model, estimate = best
    # which one won, in their 1F1B order (0: the 1F1B winner)
    plan = emit_plan(request, placements, scheduler=scheduler, meta={**meta, "interleaved_rank": rank})
    return replace(plan, estimate=estimate), cost_model  # None when timed from placements
