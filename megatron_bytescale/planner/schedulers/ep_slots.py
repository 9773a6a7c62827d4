"""Even an expert group's slots: give its members micro-batches of similar length in one slot.

Why: with expert parallelism (``ep_size`` E > 1) the members of an expert group wait for each
other in every slot (:mod:`..expert_lockstep`), so a slot costs its longest member. PP-Balance's
count groups decide which member runs which micro-batch, but not which of them share a slot:
one member's 3 s micro-batch beside another's 1 s one wastes 2 s on the second, and the next
slot may waste it the other way round.

What: every member keeps its micro-batches and every ring keeps its slot (the EP rule), only
each member's single-rank micro-batches move among its own non-ring slots, sorted by time, so
the k-th longest of every member meet in the same slot (``longest-first``; or shortest first,
which lets later pipeline stages start sooner). Pairing sorted lists minimises the sum of the
slot maxima when no ring is in the way. The plan is re-emitted slot by slot (orders renumbered,
every rank's list still ascending), and a reordering is kept only where the estimate says it is
faster, so it never makes a plan slower by the estimate. Nothing is added or dropped: the same
micro-batches (rings, sequences, offload ratios) on the same ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ..cost_model import CostModel
from ..estimate import estimate_plan, micro_batch_costs
from ..plan import MicroBatch, StepPlan
from ._common import Placement, PlanRequest, emit_plan

ORDERINGS = ("longest-first", "shortest-first")
REGROUPINGS = ("regrouped, longest-first", "regrouped, shortest-first")


def sorted_slots(lists: Sequence[Sequence[MicroBatch]], seconds: Mapping[int, float], *,
                 longest_first: bool = True) -> list[list[MicroBatch]]:
    """Every rank's list with its single-rank micro-batches sorted by ``seconds`` (ties by order)
    into the local indices they already take; ring micro-batches stay where they are."""
    out = []
    sign = -1.0 if longest_first else 1.0
    for mbs in lists:
        free = [k for k, mb in enumerate(mbs) if len(mb.ring) == 1]
        singles = sorted((mbs[k] for k in free), key=lambda mb: (sign * seconds[mb.order], mb.order))
        new = list(mbs)
        for k, mb in zip(free, singles):
            new[k] = mb
        out.append(new)
    return out


def slot_placements(lists: Sequence[Sequence[MicroBatch]]) -> list[Placement]:
    """The placements that give every rank ``lists`` (each ring once, slot by slot; a single-rank
    micro-batch on the rank whose list holds it): a ring at local index k on all its members
    comes out at index k on each of them."""
    out: list[Placement] = []
    for k in range(max((len(x) for x in lists), default=0)):
        for r, mbs in enumerate(lists):
            if k >= len(mbs):
                continue
            mb = mbs[k]
            if len(mb.ring) == 1:  # a single-rank micro-batch runs where the list puts it
                out.append(Placement(ring=(r,), seqs=mb.seqs, offload_ratio=mb.offload_ratio))
            elif mb.ring[0] == r:
                out.append(Placement(ring=mb.ring, seqs=mb.seqs, offload_ratio=mb.offload_ratio))
    return out


def regroup_slots(lists: Sequence[Sequence[MicroBatch]], seconds: Mapping[int, float], ep: int, *,
                  longest_first: bool = True) -> list[list[MicroBatch]]:
    """Every expert group's single-rank micro-batches pooled and dealt out again to its members,
    slot by slot, so that each slot holds similar ones (module docstring).

    A member must keep as many micro-batches before each of its rings as it has (the ring's
    slot is fixed on every member, in other groups too), and only its tail may grow or shrink.
    So slot k gets the member cells that must be filled (before the member's last ring) and as
    many tail cells as the pool can spare, and the pool, longest first, fills the slots of the
    longest rings first (their members wait for the ring anyway), then the others in slot order
    (``longest_first``) or in reverse. Offloaded micro-batches move too: the planner sizes a
    micro-batch's offload ratio, and checks its host memory (``pp_size`` of it in flight), per
    micro-batch, the same on every rank."""
    out: list[list[MicroBatch]] = [list(x) for x in lists]
    for first in range(0, len(lists), ep):
        members = range(first, first + ep)
        singles = [mb for m in members for mb in lists[m] if len(mb.ring) == 1]
        if not singles:
            continue
        rings = {m: {k: mb for k, mb in enumerate(lists[m]) if len(mb.ring) > 1} for m in members}
        end = {m: max(rings[m]) + 1 if rings[m] else 0 for m in members}
        must = {m: [k for k in range(end[m]) if k not in rings[m]] for m in members}
        later = sum(len(v) for v in must.values())  # cells that must be filled from slot k on
        left, k, cells, closed = len(singles), 0, {}, set()
        while left > 0 or k < max(end.values()):
            need = [m for m in members if k < end[m] and k not in rings[m]]
            later -= len(need)
            spare = left - len(need) - later
            tail = [m for m in members if k >= end[m] and m not in closed]
            take = tail[:max(0, spare)]
            closed.update(tail[len(take):])
            cells[k] = need + take
            left -= len(cells[k])
            k += 1
        ring_time = {k: max((seconds[rings[m][k].order] for m in members if k in rings[m]), default=0.0)
                     for k in cells}
        slots = sorted((k for k in cells if cells[k]),
                       key=lambda k: (-ring_time[k], k if longest_first else -k))
        pool = iter(sorted(singles, key=lambda mb: (-seconds[mb.order], mb.order)))
        dealt: dict[tuple[int, int], MicroBatch] = {}
        for k in slots:
            for m in cells[k]:
                dealt[(m, k)] = next(pool)
        for m in members:
            new = []
            for k in range(len(cells)):
                mb = rings[m].get(k) or dealt.get((m, k))
                if mb is None:
                    break
                new.append(mb)
            out[m] = new
        if sum(len(out[m]) for m in members) != sum(len(lists[m]) for m in members):
            raise RuntimeError("regroup_slots lost a micro-batch")  # a bug here, never user input
    return out


def even_expert_slots(plan: StepPlan, request: PlanRequest, cost_model: CostModel,
                      scheduler: str) -> StepPlan:
    """``plan`` (estimated with ``cost_model``) or its fastest slot-sorted variant by the
    estimate (module docstring); ``meta["expert_slots"]`` names the ordering kept and
    ``meta["expert_slots_before_s"]`` the estimate before. Plans without expert groups are
    returned unchanged."""
    if plan.ep_size == 1:
        return plan
    if plan.estimate is None:
        plan = replace(plan, estimate=estimate_plan(plan, cost_model))
    before = plan.estimate.step_time_s
    costs = micro_batch_costs(plan, cost_model)
    seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
    lists = [rp.micro_batches for rp in plan.ranks]
    meta = {**plan.meta, "expert_slots_before_s": before}
    best = replace(plan, meta={**meta, "expert_slots": "as placed"})
    for name in ORDERINGS + REGROUPINGS:
        longest = name.endswith("longest-first")
        new = (regroup_slots(lists, seconds, plan.ep_size, longest_first=longest) if name in REGROUPINGS
               else sorted_slots(lists, seconds, longest_first=longest))
        if all(len(x) == len(y) and all(a is b for a, b in zip(x, y)) for x, y in zip(new, lists)):
            continue  # already in this order
        candidate = emit_plan(request, slot_placements(new), scheduler=scheduler,
                              meta={**meta, "expert_slots": name})
        candidate = replace(candidate, estimate=estimate_plan(candidate, cost_model))
        if candidate.estimate.step_time_s < best.estimate.step_time_s:
            best = candidate
    return best
