"""The expert groups' lockstep: how a plan with expert parallelism (``StepPlan.ep_size`` E > 1) runs.

Why it matters: with E > 1 every MoE layer's all-to-all is a meeting point of the E ranks of an
expert group (HDP ranks ``g*E .. g*E+E-1``), forward and backward, in every slot (local
micro-batch index). A member whose slot-k micro-batch is short waits inside the all-to-all for
the group's longest one, and a member with nothing left to train runs an empty micro-batch that
waits for the whole slot (:func:`.plan.expert_slots`). Rings already make their members wait for
each other; a ring whose members sit in two groups ties both groups into one lockstep
*component* for that slot. Leaving this out lets a plan look balanced while its groups idle:
the plans balance chose without it run their micro-batch phase up to 2.3x longer than
estimated on Fig. 17's Mistral panels (docs/moe.md).

Model, for a plan that keeps every ring micro-batch at one slot on all its members (the EP rule
:meth:`.plan.StepPlan.validate` checks):

* **Slot k's components**: the expert groups with a slot k (every rank of such a group is in it,
  an empty slot too), joined when a ring at slot k has members in several of them. A component
  runs as one: it starts when its last rank is free and lasts as long as its longest
  micro-batch (an empty slot costs that too, not zero).
* **PP = 1**: slot by slot (:func:`slot_finish`).
* **PP > 1**: every component becomes one micro-batch shared by the pipelines of all its ranks
  (:func:`slot_lists`), and the estimate's own pipeline schedule times it
  (:func:`.pipeline_floor.simulate_schedule`: 1F1B, or interleaved 1F1B with virtual stages;
  shared micro-batches meet across pipelines at every stage). So each stage's expert group
  waits for its slowest member, op by op, with the pipeline fill and drain as before.

With ``couple_groups=False`` only rings couple ranks: :func:`slot_finish` is then the estimate's
PP = 1 timeline of the same plan without expert groups. Plans with E = 1 never come here, so
their estimates are the same floats as without this module.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .order import Simulation
from .pipeline_floor import simulate_schedule
from .plan import PlanError, StepPlan, check_virtual_pipeline


def _layout(plan: StepPlan, unit: int) -> tuple[np.ndarray, np.ndarray, list[list[list[int]]]]:
    """Per rank its micro-batch count; the order at every (rank, slot) (-1: none); per slot the
    rings that join several units (blocks of ``unit`` consecutive ranks), as unit lists.
    PlanError if a ring sits at different slots on its members."""
    n = plan.hdp_size
    lists = [rp.micro_batches for rp in plan.ranks]
    counts = np.fromiter((len(x) for x in lists), dtype=np.int64, count=n)
    slots = int(counts.max(initial=0))
    order_at = np.full((n, slots), -1, dtype=np.int64)
    links: list[list[list[int]]] = [[] for _ in range(slots)]
    slot_of: dict[int, int] = {}
    for r, mbs in enumerate(lists):
        for k, mb in enumerate(mbs):
            order_at[r, k] = mb.order
            ring = mb.ring
            if len(ring) > 1:
                first = slot_of.setdefault(mb.order, k)
                if first != k:
                    raise PlanError(
                        f"order {mb.order} sits at local index {first} on one member and {k} on rank {r}: "
                        f"with ep_size {plan.ep_size} every ring micro-batch must sit at one slot on all "
                        "its members (validate() checks it)")
                if r == ring[0]:
                    units = sorted({m // unit for m in ring})
                    if len(units) > 1:
                        links[k].append(units)
    return counts, order_at, links


def _components(links: list[list[int]]) -> list[list[int]]:
    """The connected unit sets of one slot's ring links (sets of two units or more)."""
    parent: dict[int, int] = {}

    def find(u: int) -> int:
        parent.setdefault(u, u)
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    for units in links:
        root = find(units[0])
        for u in units[1:]:
            other = find(u)
            if other != root:
                parent[other] = root
    out: dict[int, list[int]] = {}
    for u in parent:
        out.setdefault(find(u), []).append(u)
    return [sorted(v) for v in out.values()]


def _unit_slots(plan: StepPlan, seconds: Mapping[int, float], unit: int):
    """Units' slot counts, their per-slot duration (longest member, empty slots 0), ring links."""
    counts, order_at, links = _layout(plan, unit)
    n, slots = order_at.shape
    t = np.zeros((n, slots))
    held = order_at >= 0
    t[held] = np.fromiter((seconds[o] for o in order_at[held].tolist()), dtype=np.float64, count=int(held.sum()))
    g = n // unit
    return counts.reshape(g, unit).max(axis=1), t.reshape(g, unit, slots).max(axis=1), order_at, links


def slot_finish(plan: StepPlan, seconds: Mapping[int, float], *, couple_groups: bool = True,
                record: dict | None = None) -> np.ndarray:
    """Per HDP rank, when its last slot ends at PP = 1 (see the module docstring).

    ``seconds``: order -> time of the micro-batch on each member. With ``couple_groups`` every
    expert group of ``plan.ep_size`` ranks runs in lockstep (all its ranks end together, those
    with fewer micro-batches too: they run empty slots); without, only rings couple ranks.
    ``record``, if given, receives order -> (start, end) of the component that ran it."""
    unit = plan.ep_size if couple_groups else 1
    slots, dur, order_at, links = _unit_slots(plan, seconds, unit)
    ready = np.zeros(len(slots))
    for k in range(dur.shape[1]):
        start, length = ready.copy(), dur[:, k].copy()
        for comp in _components(links[k]):
            idx = np.asarray(comp)
            start[idx] = ready[idx].max()
            length[idx] = dur[idx, k].max()
        end = start + length
        if record is not None:
            for r in np.flatnonzero(order_at[:, k] >= 0).tolist():
                record[int(order_at[r, k])] = (float(start[r // unit]), float(end[r // unit]))
        ready = np.where(slots > k, end, ready)
    return np.repeat(ready, unit)


def slot_lists(plan: StepPlan, seconds: Mapping[int, float]) -> tuple[list[list[int]], dict[int, float],
                                                                       list[list[int]]]:
    """The plan with every slot-k component as one micro-batch of all its ranks: per rank the
    component ids in slot order (ascending), each component's duration (its longest
    micro-batch) and the orders each component runs."""
    e = plan.ep_size
    slots, dur, order_at, links = _unit_slots(plan, seconds, e)
    g = len(slots)
    lists: list[list[int]] = [[] for _ in range(plan.hdp_size)]
    durations: dict[int, float] = {}
    orders: list[list[int]] = []
    for k in range(dur.shape[1]):
        comp_of = {}
        for comp in _components(links[k]):
            for u in comp:
                comp_of[u] = comp
        for u in range(g):
            if slots[u] <= k or (u in comp_of and comp_of[u][0] != u):
                continue  # no slot k, or already emitted with its component's first unit
            comp = comp_of.get(u, [u])
            cid = len(orders)
            durations[cid] = float(dur[comp, k].max())
            ranks = [r for v in comp for r in range(v * e, v * e + e)]
            for r in ranks:
                lists[r].append(cid)
            orders.append(sorted({int(order_at[r, k]) for r in ranks if order_at[r, k] >= 0}))
    return lists, durations, orders


def lockstep_simulation(plan: StepPlan, seconds: Mapping[int, float], forward_fraction: float, *,
                        record: bool = False) -> Simulation:
    """The estimate's timeline of a plan with ``ep_size`` > 1 (module docstring): rank finish
    times, and with ``record`` the times of every order's nodes (those of its component: a
    member waiting in the all-to-all is inside its micro-batch until the component ends)."""
    if plan.meta.get("barrier_after_orders"):
        raise PlanError(f"a plan with barriers between micro-batches cannot be timed with ep_size {plan.ep_size}: "
                        "plan expert parallelism with the balance or static scheduler")
    if plan.pp_size == 1:
        times: dict | None = {} if record else None
        finish = slot_finish(plan, seconds, record=times)
        return Simulation(rank_finish_s=finish, node_times=times or {})
    check_virtual_pipeline(plan.virtual_pipeline_size, plan.pp_size, plan.layers_per_stage)
    lists, durations, orders = slot_lists(plan, seconds)
    vpp = plan.virtual_pipeline_size
    result = simulate_schedule(lists, durations, pp=plan.pp_size, vpp=vpp, forward_fraction=forward_fraction,
                               record=record)
    if result is None:  # every component sits at one slot on all its ranks, so this cannot happen
        raise PlanError("the expert groups' lockstep schedule of this plan deadlocks")
    node_times: dict = {}
    for (cid, phase, chunk, stage), span in result.node_times.items():
        for o in orders[cid]:
            node_times[(o, phase, stage) if vpp == 1 else (o, phase, chunk, stage)] = span
    return Simulation(rank_finish_s=np.asarray(result.rank_finish_s, dtype=np.float64), node_times=node_times)
