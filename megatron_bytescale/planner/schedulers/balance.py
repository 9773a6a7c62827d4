"""``balance``: the paper's Alg. 2 ("Balance Strategy for HDP"), DP-Balance and PP-Balance.

Sharding comes from §5 as in ``naive`` (packs of short sequences on one rank, each long sequence
on its own ring). Offload is selective (:mod:`.selective`): with offload on, every step below runs
on two unit sets, long sequences on Eq. 3's offloaded rings and on their offload-free rings (the
ones that only fit with offload keep Eq. 3's), and the faster plan by the estimate is kept
(``meta["offload_choice"]``; the offload-free one on a tie). Then, per set:

1. **Widening** (our addition; the paper is silent). Eq. 3's D(s) is the *fewest* ranks a
   sequence may use. A 2M-token sequence on D(s) ranks can take longer than the whole step's
   lower bound ``LB = total rank-seconds / d_hdp``, and no assignment can then balance. Every
   long unit (one holding a sequence of at least C tokens: packs of short sequences stay on
   one rank and never communicate, as in the paper) whose per-rank time exceeds LB (LB / pp_size with PP: a micro-batch crosses every stage)
   gets the smallest ring (up to d_hdp) that brings it under that, or within 2 % of the fastest
   any ring size gives when its communication floor is above it, with the smallest offload ratio
   that still fits (often none). A widening is kept only if it lowers max(LB, the unit's time);
   LB is recomputed and the pass repeated until stable (at most 4 passes).
2. **Sort and bucketize.** Units are sorted by estimated time, longest first, and cut into
   ``num_buckets`` contiguous buckets of ~equal work (rank-seconds).
3. **DP-Balance (pp_size == 1).** Alg. 2 takes units from the first (heaviest) non-empty bucket
   and gives them to *target ranks* (``max_time - t_i > delta * max_time``, all ranks if none).
   Giving each unit to the least-loaded targets (ties by rank id; a ring takes its D
   least-loaded ranks, topped up with the least-loaded others) makes this LPT list scheduling,
   which we run with a heap: buckets and delta therefore do not change DP-Balance plans (they
   shape PP-Balance). Units go heaviest *work* first (rank-seconds: a wide ring before a long
   single, so rings start while ranks are still level; a ring starts when its slowest member is
   free and that idle wait is charged). Topology (:mod:`.placement`): a ring that fits a node
   takes ranks of one node, a longer one the fewest nodes (whole nodes where it can), in
   node-contiguous order, always (offload on or off). Ranks that run light units get more of
   them, so micro-batch counts differ per rank.
4. **PP-Balance (pp_size > 1).** Ring micro-batches must sit at the same local index on all
   members (D5, checked by the validator). Rings are placed first, widest first, on the D
   least-loaded ranks of one *count group* (ranks that have run the same number of micro-batches),
   on its fewest nodes (:mod:`.pp_balance`);
   the widest remaining ring always fits the group the previous ring created. Single-rank units
   then follow Alg. 2's "sequentially from all buckets": each target pipeline (below
   ``max - delta * max``) takes a *run* of consecutive units from the sorted stream, staying inside
   the current bucket, until the next would pass the current max. So a pipeline gets a run of
   similar micro-batches (Insight 1: fewer transition bubbles) and lighter pipelines get more
   of them (Fig. 12). When no pipeline is a target, all are, and each takes at least one unit.
   A second candidate counts a pipeline's load as its stage work plus (PP - 1) x its longest
   micro-batch (the 1F1B fill and drain of that micro-batch, which the pipeline cannot fill
   beyond its few in-flight neighbours), so the pipelines of a long ring take less other work.
   A third counts it as stage work plus the 1F1B idle floor of its longest micro-batch with the
   next ``2 (PP - 1)`` longest in its window (:func:`..pipeline_floor.idle_floor` with ``k =
   1``): a pipeline of a long ring takes the few micro-batches that hide in that window almost
   for free and little beyond them.
   Each candidate is also tried with the next ``PP - 1`` levels before the first
   (:func:`.pp_balance.next_levels_first`): their backwards fill the 1F1B window of the longest
   ring, which otherwise idles; and with the ``PP - 1`` longest single-rank micro-batches after
   the last ring first instead (:func:`.pp_balance.singles_first`), the same window filled by
   work that needs no rendezvous. (A third reordering, each pipeline's shortest micro-batch
   first, :func:`.pp_balance.short_first`, and the runs on the unwidened units were dropped with
   PP: neither was ever the only fastest on the 44 Fig. 17 PP cells of both hardware presets,
   and each candidate costs planning time; docs/pipeline.md, "Rings of their own". At PP 1,
   with expert groups, short first is the only reordering and stays.) Where rings
   exist whose 1F1B floor ``PP x t`` is above the mean work of the other pipelines, one more
   candidate runs them on pipelines of their own (:mod:`.pp_isolate`). The first candidate is the *level-step* assignment (:mod:`.pp_steps`): rings in
   lockstep time steps with the single-rank units longest first beside them (one length level
   per step on every pipeline, so the transitions between levels fall at the same local index
   everywhere), and the units left after the last ring given longest first to the pipeline
   that finishes first in the 1F1B estimate of the ring phase. Balancing stage work alone loses
   to naive's fill on ring-heavy batches (ring waits chain across pipelines whose lists differ
   in shape; docs/pipeline.md, "Why naive's assignment won"); the level steps win there.
5. **Safety net.** The plan emitted is the fastest by the cost model among this assignment (all three
   loads with PP), the level steps on the unwidened units, and Alg. 1's fill of them (with PP
   each also next-levels-first and singles-first), over both unit sets; ``meta["assignment"]``
   says which won. At scale the first wins and the others are skipped when they cannot (their
   longest unit is already slower); on tiny batches a greedy can lose by chance (LPT's worst
   case is 4/3 of optimal), and a ring over all ranks can serialise indivisible packs.
   With PP only the winner is built into a plan: the other candidates are timed from their
   placements (:mod:`.candidate_time`, the same floats as their plans' estimates).

6. **Expert groups** (``ep_size`` E > 1). The plan is made as for PP (count groups keep every
   ring at one slot on its members, also at PP 1), with candidates compared by an estimate that
   charges the expert groups' lockstep (:mod:`..expert_lockstep`); each group's single-rank
   micro-batches are sorted, or pooled and dealt out again, so that similar ones share a slot,
   kept only where the estimate falls (:mod:`.ep_slots`, ``meta["expert_slots"]``). At PP 1
   every estimated candidate is evened before the comparison (a candidate whose groups wait
   may win once evened: 8x7B Byted 2M, EP 8, 2,048 ranks, 38.9 -> 36.7 s); with PP only the
   winner (each 1F1B estimate costs; evening every candidate quadrupled planning CPU there for
   no gain on the Mistral presets).

7. **Interleaved stages** (``virtual_pipeline_size`` v > 1). Candidates are ranked by plain 1F1B
   as above, with the floors letting through what is within :data:`.pp_vpp.INTERLEAVED_SLACK`
   of the best; all of those are then timed interleaved and the fastest is kept
   (:mod:`.pp_vpp`): the reorderings fill the 1F1B window, which v virtual stages shrink.

Defaults. ``delta = 0.05``: Megatron's hybrid-CP uses 5 % of the max time (paper.md §5.4); a
smaller delta makes runs shorter, a larger one tolerates more spread before a pipeline becomes a
target. ``num_buckets = 4``: the paper gives no value; Megatron uses one bucket per distinct CP
size. Four equal-work levels separate "longest / long / medium / packs" in long-tailed batches
while keeping runs long enough to matter; it only affects PP-Balance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..cost_model import CostModel
from ..estimate import estimate_plan
from ..pipeline_floor import assignment_floor
from ..plan import StepPlan
from ..sharding import ShardingContext, Unit
from ._common import Placement, PlanRequest, apply_hdp_overlong, emit_plan, unit_sort_key, unit_work_key
from .candidate_time import finish_times as candidate_finish_times, times_without_plan
from .dp_balance import dp_balance, makespan_below
from .ep_slots import even_expert_slots
from .naive import fill_step_iter, fill_steps_aligned
from .pp_balance import next_levels_first, pp_balance, short_first, singles_first, unit_times
from .pp_floors import alone_floors, order_free_floor, units_by_seqs
from .pp_isolate import dominant_rings, isolated_runs
from .pp_steps import level_steps
from .pp_vpp import INTERLEAVED_SLACK, fastest_interleaved
from .selective import unit_options
from .widen import widen_for_balance

__all__ = ["plan_balance", "dp_balance", "pp_balance", "widen_for_balance", "INTERLEAVED_SLACK"]

NAME = "balance"


def plan_balance(request: PlanRequest) -> StepPlan:
    """Alg. 2; see the module docstring.

    With two-level rings (``cost_model.two_level_ring``) long rings are sized in whole nodes and
    costed two-level; the plan sized as for flat rings is planned too, both are estimated with
    the two-level cost (each ring as it will run: two-level on whole nodes, else flat) and the
    faster is kept (``meta["ring_sizing"]``; on a tie the two-level sizing that was asked for),
    so turning two-level rings on never makes a plan slower by the estimate (list scheduling can
    lose on differently shaped units).
    """
    cm = request.cost_model
    if not cm.two_level_ring:
        return _plan_balance(request)
    best = None
    for sizing, model in (("two-level", cm), ("flat", cm.with_(two_level_ring=False))):
        plan = _plan_balance(replace(request, cost_model=model))
        plan = replace(plan, meta={**plan.meta, "ring_sizing": sizing},
                       estimate=estimate_plan(plan, cm, request.topology))
        if best is None or plan.estimate.step_time_s < best.estimate.step_time_s:
            best = plan
    return best


def _plan_balance(request: PlanRequest) -> StepPlan:
    request = apply_hdp_overlong(request)
    n = request.hdp_size
    meta = {"delta": request.delta, "num_buckets": request.num_buckets}
    options = []
    for index, (choice, ctx, base) in enumerate(unit_options(request)):
        units, widened = widen_for_balance(list(base), ctx, n, pp_size=request.pp_size)
        units.sort(key=unit_sort_key)
        # each list's own floor (with nothing widened the two hold the same units: one floor);
        # the set's is the smaller, and _best_pp_plan skips a list by its own
        floors = (_units_floor(units, units, request),) + ((_units_floor(base, base, request),) if widened else ())
        options.append((min(floors), index, choice, ctx, base, units, widened, floors))
    # the set with the lowest floor first; a later one whose floor is already slower than the
    # best plan cannot win (ties go to the earlier set of unit_options: no offload)
    options.sort(key=lambda o: (o[0], o[1]))
    if request.pp_size > 1 or request.ep_size > 1:  # rings aligned by count groups
        plan, cost_model = _best_pp_plan(request, options, meta)
        if request.ep_size > 1 and request.even_expert_slots and request.pp_size > 1:
            plan = even_expert_slots(plan, request, cost_model, NAME)  # the winner only: 1F1B estimates cost
        return plan
    best = None
    for floor, index, choice, ctx, base, units, widened, _ in options:
        if best is not None and floor > best[0] * (1 + 1e-9):
            continue
        placements, assignment, grown, step = _best_dp_assignment(units, base, widened, ctx, n)
        if best is None or (step, index) < best[:2]:
            best = (step, index, placements, dict(assignment=assignment, widened_units=grown, offload_choice=choice))
    meta.update(mode="DP-Balance", **best[3])
    return emit_plan(request, best[2], scheduler=NAME, meta=meta)


def _units_floor(units: Sequence[Unit], base: Sequence[Unit], request: PlanRequest) -> float:
    """A lower bound on any plan of ``units`` (widened) or of ``base`` (the same set unwidened,
    which some candidates run): per set, their stage work over the pipelines and the longest one
    crossing every stage forward and back (``pp_size`` times its stage time); with PP also
    :func:`..pipeline_floor.assignment_floor` (no pipeline can take a long ring without the
    1F1B fill and drain of it, and the rest must go somewhere), the smaller of the two sets.

    It rests on a unit's own time (costed intra-node when its ring fits a node) never exceeding
    its time once placed, which holds for flat rings on the regular node map when the network is
    no faster than the links inside a node; otherwise 0 (nothing is skipped)."""
    cm = request.cost_model
    if cm.two_level_ring or request.topology is not None or cm.p2p_bandwidth_inter > cm.p2p_bandwidth_intra:
        return 0.0
    pp = request.pp_size

    def floor(of: Sequence[Unit]) -> float:
        work = sum(u.work for u in of) / request.hdp_size
        bound = max(work, pp * max((u.time for u in of), default=0.0))
        if pp > 1 and of:
            bound = max(bound, assignment_floor([(u.time, u.ring_size) for u in of], request.hdp_size, pp,
                                                cm.forward_fraction))
        return bound

    return floor(units) if base is units else min(floor(units), floor(base))


def _best_dp_assignment(
    units: list[Unit], eq3_units: list[Unit], widened: int, ctx: ShardingContext, n: int
) -> tuple[list[Placement], str, int, float]:
    """The fastest (by the cost model) of: LPT on the widened units, LPT on the unwidened units,
    and Alg. 1's time-step fill of the unwidened units; returns it with its step time.

    LPT is a greedy heuristic (its worst case is 4/3 of optimal even without rings) and on tiny
    batches the fill can win by chance; on real batches LPT on the widened units wins by far.
    Keeping the best of three deterministic candidates costs two cheap extra passes.
    """
    candidates = [("lpt", *dp_balance(sorted(units, key=unit_work_key), ctx, n), widened)]
    # both alternatives run the unwidened units, so neither can beat their longest one: skip
    # them when the first candidate is already that fast (the common case at scale)
    floor = max((u.time for u in eq3_units), default=0.0)
    if candidates[0][2] <= floor:
        return candidates[0][1], "lpt", widened, candidates[0][2]
    if widened:
        candidates.append(("lpt-eq3", *dp_balance(sorted(eq3_units, key=unit_work_key), ctx, n), 0))
    # the fill is made step by step and dropped once a rank finishes no earlier than the best so
    # far (it can then no longer win: ties go to the earlier candidate)
    fill = makespan_below(fill_step_iter(n, [u for u in eq3_units if u.ring_size > 1],
                                         deque(u for u in eq3_units if u.ring_size == 1), ctx.nodes),
                          eq3_units, ctx, n, min(c[2] for c in candidates))
    if fill is not None:
        candidates.append(("fill", *fill, 0))
    name, placements, step, grown = min(candidates, key=lambda c: c[2])
    return placements, name, grown, step


def _best_pp_plan(request: PlanRequest, options: Sequence[tuple], meta: dict) -> tuple[StepPlan, CostModel]:
    """The fastest, by the full 1F1B estimate, of: per unit set (:func:`.selective.unit_options`),
    the level steps (:func:`.pp_steps.level_steps`) on the widened and the unwidened units,
    PP-Balance's runs on the widened units (three pipeline loads, and the rings of their own of
    :mod:`.pp_isolate` where there are such rings) and Alg. 1's aligned fill of the unwidened
    units (the safety net of :func:`_best_dp_assignment`; with PP, widening trades fewer bubbles
    for more communication and the estimate decides), each as built, with the next levels
    first and with singles first.

    Unit sets go in the order of :func:`_plan_balance`, a set's candidates in the order of their
    1F1B floor (:func:`.pp_floors.alone_floors`); whatever is already slower than the best step
    by a floor is skipped: a set (:func:`_units_floor`), the assignments of one of its two lists
    (the same floor of that list alone; they are then not built), an assignment with all its
    reorderings (:func:`.pp_floors.order_free_floor`), a candidate. The rings of their own come
    timed from their layer-cap walk, and that step is the first best to beat. Ties go to the
    earlier candidate (the earlier set of :func:`.selective.unit_options`, then the list order),
    so skipping never changes the winner (at PP 1 with expert groups, where every estimated
    candidate is evened first, a floor no longer bounds the evened plan and the skip is a
    heuristic). Returns the plan and
    the cost model it was timed with; a winner timed without its plan comes back without an
    estimate, which :func:`..make_plan` attaches (the same floats) when the caller keeps one."""
    n = request.hdp_size
    final = request  # the winner is emitted with the plan's own request (its virtual stages)
    vpp = request.virtual_pipeline_size
    if vpp > 1:  # ranked by plain 1F1B; the close ones are timed interleaved at the end (step 7)
        request = replace(request, virtual_pipeline_size=1)
    slack = INTERLEAVED_SLACK if vpp > 1 else 1e-9  # what a floor may pass the best by and stay in
    stop = 1.0 + INTERLEAVED_SLACK if vpp > 1 else 1.0  # a timing gives up past the best times this
    finalists: list[tuple[tuple, tuple, dict]] = []  # with VPP: (key, build, seconds) of each timed
    kw = dict(delta=request.delta, num_buckets=request.num_buckets)
    # (step, (unit set, (assignment, variant)), the plan if built, what builds it)
    best: tuple[float, tuple[int, tuple[int, int]], StepPlan | None, tuple] | None = None
    quick = times_without_plan(request)
    for units_floor, set_index, choice, ctx, base, units, widened, list_floors in options:
        if best is not None and units_floor > best[0] * (1 + slack):
            continue
        seconds: dict = {}  # placement stage times of this unit set's candidates (one cost model)

        def finish_times(placements: list, stop_above: float | None = None, ctx: ShardingContext = ctx,
                         seconds: dict = seconds) -> np.ndarray:
            finish = candidate_finish_times(request, placements, ctx.cost_model, seconds, stop_above) if quick else None
            if finish is not None:
                return finish
            plan = emit_plan(replace(request, pieces=False), placements, scheduler=NAME)
            return np.asarray(estimate_plan(plan, ctx.cost_model).rank_time_s)

        def build(name: str, placements: list, grown: int, ctx: ShardingContext = ctx, choice: str = choice) -> tuple:
            return (placements, {**meta, "mode": "PP-Balance", "widened_units": grown, "assignment": name,
                                 "offload_choice": choice}, ctx.cost_model)

        # the set's floor is the smaller of its two lists' (widened, unwidened): the candidates of
        # the other list are not even built when its own floor is already slower than the best
        use_units = use_base = True
        if best is not None and widened:
            limit = best[0] * (1 + slack)
            use_units, use_base = (f <= limit for f in list_floors)
        pool = []
        if use_units:
            pool.append(("pp-steps", level_steps(units, ctx, n, finish_times), widened, units))
        if widened and use_base:
            pool.append(("pp-steps-eq3", level_steps(base, ctx, n, finish_times), 0, base))
        timed: dict[int, float] = {}  # a candidate's step known from its construction, by id
        if use_units:
            pool += [("pp-runs", pp_balance(units, ctx, n, **kw), widened, units),
                     ("pp-runs-1f1b", pp_balance(units, ctx, n, fill_drain=request.pp_size - 1, **kw), widened, units)]
            if request.pp_size > 1:
                pool.append(("pp-runs-floor", pp_balance(units, ctx, n, window=request.pp_size - 1, **kw), widened,
                             units))
            isolated = dominant_rings(units, n, request.pp_size)
            if isolated:
                placements, step = isolated_runs(units, ctx, n, isolated, finish_times, **kw)
                pool.append(("pp-runs-isolated", placements, widened, units))
                if quick:  # the same timing the loop below would make
                    timed[id(placements)] = step
        if use_base:
            fill = fill_steps_aligned(n, [u for u in base if u.ring_size > 1],
                                      deque(u for u in base if u.ring_size == 1), ctx.nodes)[0]
            pool.append(("fill", fill, 0, base))
        # the assignment timed above sets the best to beat (ties go to the earlier candidate, and
        # its variants come after it)
        for position, (name, placements, grown, _) in enumerate(pool):
            if id(placements) in timed:
                key = (timed[id(placements)], (set_index, (position, 1)))
                if vpp > 1:
                    finalists.append((key, build(name, placements, grown), seconds))
                if best is None or key < best[:2]:
                    best = (*key, None, build(name, placements, grown))
        # no reordering of an assignment beats its order-free floor: drop those already slower
        # than the best (strictly slower, so ties cannot move) before their reorderings are made
        unit_of = {id(units): units_by_seqs(units), id(base): units_by_seqs(base)}  # built once per set
        if best is not None:
            pool = [(k, c) for k, c in enumerate(pool)
                    if order_free_floor(c[1], unit_of[id(c[3])], ctx, request.pp_size) <= best[0] * (1 + slack)]
        else:
            pool = list(enumerate(pool))
        # each as built and reordered to fill the longest ring's 1F1B window; (assignment, slot)
        # orders ties as the list does
        times = {id(units): unit_times(units), id(base): unit_times(base)}  # built once per set
        candidates = []
        for position, (name, placements, grown, units_of) in pool:
            time_of = times[id(units_of)]
            if request.pp_size == 1:  # expert groups: the one reordering there is
                moved = short_first(placements, time_of)
                if moved is not None:
                    candidates.append(((position, 0), name + "+short-first", moved, grown, units_of))
            if id(placements) not in timed:
                candidates.append(((position, 1), name, placements, grown, units_of))
            lifted = next_levels_first(placements, request.pp_size - 1)
            if lifted is not None:
                candidates.append(((position, 2), name + "+next-levels-first", lifted, grown, units_of))
            lifted = singles_first(placements, time_of, request.pp_size - 1)
            if lifted is not None:
                candidates.append(((position, 3), name + "+singles-first", lifted, grown, units_of))
        floors = alone_floors([(c[2], unit_of[id(c[4])]) for c in candidates], ctx, request.pp_size)
        for floor, (slot, name, placements, grown, _) in sorted(zip(floors, candidates), key=lambda c: (c[0], c[1][0])):
            # a candidate whose 1F1B floor is already slower than the best cannot win: skip its
            # plan and full estimate (the margin covers rounding between the two time sums)
            if best is not None and floor > best[0] * (1 + slack):
                continue
            index = (set_index, slot)
            # timed as its plan would be (only the winner is built), given up once it is slower
            # than the best: it then cannot win (ties go to the earlier candidate)
            finish = candidate_finish_times(request, placements, ctx.cost_model, seconds,
                                            None if best is None else best[0] * stop) if quick else None
            if finish is not None:
                key = (float(finish.max()), index)
                if vpp > 1:
                    finalists.append((key, build(name, placements, grown), seconds))
                if best is None or key < best[:2]:
                    best = (*key, None, build(name, placements, grown))
                continue
            plan = _estimated(request, *build(name, placements, grown))
            if request.ep_size > 1 and request.even_expert_slots and request.pp_size == 1:
                # cheap at PP 1, and a candidate whose groups wait may win once evened
                plan = even_expert_slots(plan, request, ctx.cost_model, NAME)
            key = (plan.estimate.step_time_s, index)
            if vpp > 1:
                finalists.append((key, build(name, placements, grown), seconds))
            if best is None or key < best[:2]:
                best = (*key, plan, build(name, placements, grown))
    if vpp > 1:
        return fastest_interleaved(final, finalists, best[0], scheduler=NAME)
    plan, (placements, meta, cost_model) = best[2], best[3]
    if plan is None:  # timed without a plan: build the winner; make_plan (or the two-level wrapper)
        plan = emit_plan(request, placements, scheduler=NAME, meta=meta)  # estimates it if kept
    return plan, cost_model


def _estimated(request: PlanRequest, placements: list, meta: dict, cost_model: CostModel) -> StepPlan:
    """The plan of a PP candidate with its estimate."""
    plan = emit_plan(request, placements, scheduler=NAME, meta=meta)
    return replace(plan, estimate=estimate_plan(plan, cost_model))
