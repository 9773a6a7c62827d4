"""What a plan costs: event-driven timing of a :class:`StepPlan` under a :class:`CostModel`.

Model (documented here because every scheduler comparison rests on it):

* Each ring micro-batch takes :meth:`CostModel.micro_batch_time` on every member: its real
  sequences padded per-document zigzag to the ring, ``layers_per_stage`` layers, its offload
  ratio, the NVLink rate if all members share a node else the network rate. Nodes come from a
  :class:`~.topology.Topology`: the one passed in, else the one the plan was made for
  (``meta["topology"]``), else the cost model's ``ranks_per_node``.
* **PP = 1**: micro-batches run in global order; a ring starts when all members are free and
  keeps every member busy for its duration. Barriers in ``meta["barrier_after_orders"]`` make
  every rank wait for the slowest before the next order starts.
* **PP > 1**: every HDP rank is a pipeline running 1F1B over its own micro-batches, each stage
  taking the micro-batch's stage time (forward ``forward_fraction`` of it, backward the rest),
  with ring ops rendezvousing across pipelines (:func:`.order.simulate`). A rank's time is its
  pipeline's makespan, bubbles included. With ``plan.virtual_pipeline_size`` v > 1 the
  pipelines run interleaved 1F1B instead (v model chunks per stage, each op 1 / v of the
  stage time; :func:`.pipeline_floor.simulate_schedule`, whose docstring derives the bubble
  ``(p - 1) t / v``); v = 1 is the 1F1B above, unchanged.
* **Expert parallelism** (``plan.ep_size`` E > 1): the E ranks of an expert group meet in every
  MoE layer's all-to-all, slot by slot, so each slot's expert groups (joined by the rings of
  that slot) run in lockstep at their slowest member's pace, an empty slot costing the whole
  slot (:mod:`.expert_lockstep`; with PP per stage, inside the same pipeline schedules). E = 1
  plans never take this path.
* Not modelled: the gradient all-reduce at the end of the step (the same for every scheduler),
  data loading, activation sends between PP stages, stragglers.

``step_time_s`` is the largest rank time. The lower bound is the total busy rank-seconds over
``hdp_size`` (perfect balance, no idling, no bubbles); the balance ratio is step time over it.
P2P bytes are :meth:`CostModel.ring_p2p_bytes` summed over the plan for all layers of the model
(every PP stage) and one TP rank; the inter-node P2P bytes are the part of them that crosses a
node boundary (:func:`.topology.ring_link_bytes`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from .chunk_estimate import chunk_costs, has_chunks, simulate_chunked
from .cost_model import CostModel
from .expert_lockstep import lockstep_simulation
from .offload import max_zigzag_share_array
from .order import Simulation, simulate
from .pipeline_floor import simulate_schedule
from .plan import Estimate, PlanError, StepPlan, check_virtual_pipeline
from .topology import Topology, placement_summary


@dataclass(frozen=True, kw_only=True)
class MicroBatchCosts:
    """Per distinct micro-batch (one entry per order number), in ascending order."""

    orders: np.ndarray
    ring_sizes: np.ndarray
    seconds: np.ndarray
    """Per member, per stage (all layers of the stage)."""
    p2p_bytes: np.ndarray
    """All members, all layers of the model."""
    inter_node_bytes: np.ndarray
    """The part of ``p2p_bytes`` on links between nodes (:func:`.topology.ring_link_bytes`)."""
    rings: tuple[tuple[int, ...], ...]
    """The ring (members in ring order) of every micro-batch."""
    offload: np.ndarray
    seq_owner: np.ndarray
    """Index into ``orders`` of every (micro-batch, sequence) entry."""
    seq_lengths: np.ndarray
    holders: dict[int, list[int]]
    """order -> the ranks whose lists hold that micro-batch."""
    sum_p: np.ndarray | None = None
    """``sum(P_j)`` per micro-batch: with ``sum_p2`` and ``intra_node`` the inputs of
    :meth:`CostModel.ring_time_from_sums` (the simulator splits ``seconds`` into its terms)."""
    sum_p2: np.ndarray | None = None
    intra_node: np.ndarray | None = None
    node_group: np.ndarray | None = None
    """Members per node of two-level rings (the ``node_group`` of ``ring_time_from_sums``), 1 if flat."""
    num_docs: np.ndarray | None = None
    """Documents per micro-batch (the ``num_docs`` of ``ring_time_from_sums``)."""


def micro_batch_costs(plan: StepPlan, cost_model: CostModel, topology: Topology | None = None) -> MicroBatchCosts:
    """Time, ring size and P2P bytes (all and inter-node) of every distinct micro-batch of ``plan``
    (``topology``: see :meth:`.Topology.for_plan`)."""
    topo = Topology.for_plan(plan, cost_model, topology)
    topo.check_size(plan.hdp_size)
    seen: dict[int, tuple[tuple[int, ...], tuple[int, ...], float]] = {}
    holders: dict[int, list[int]] = {}  # the ranks that hold each micro-batch (its ring in a valid plan)
    get = holders.get
    for rp in plan.ranks:
        rank = rp.rank
        for mb in rp.micro_batches:
            order = mb.order
            held = get(order)
            if held is None:
                seen[order] = (mb.ring, mb.seqs, mb.offload_ratio)
                holders[order] = [rank]
            else:
                held.append(rank)
    return costs_of(seen, holders, plan.sequence_lengths(), cost_model, topo, align=plan.align,
                    layers_per_stage=plan.layers_per_stage, pp_size=plan.pp_size)


def costs_of(seen: Mapping[int, tuple[tuple[int, ...], tuple[int, ...], float]], holders: dict[int, list[int]],
             lengths: Mapping[int, int], cost_model: CostModel, topo: Topology, *, align: int,
             layers_per_stage: int, pp_size: int) -> MicroBatchCosts:
    """:func:`micro_batch_costs` from the micro-batches themselves: ``seen`` maps each order to
    its ``(ring, seqs, offload_ratio)``, ``holders`` to the ranks whose lists hold it. The
    schedulers time candidates they have not built into a plan with it (same floats)."""
    orders = np.array(sorted(seen), dtype=np.int64)
    n = len(orders)
    if n == 0:
        z = np.zeros(0)
        zi = z.astype(np.int64)
        return MicroBatchCosts(orders=orders, ring_sizes=zi, seconds=z, p2p_bytes=z, inter_node_bytes=z,
                               rings=(), offload=z, seq_owner=zi, seq_lengths=zi, holders={},
                               sum_p=z, sum_p2=z, intra_node=zi.astype(bool), node_group=z, num_docs=z)
    owner, seq_len, seq_ring = [], [], []
    ring_sizes = np.empty(n, dtype=np.int64)
    offload = np.empty(n)
    intra = np.ones(n, dtype=bool)
    links = np.zeros(n)
    groups = np.ones(n)
    rings = []
    two_level = cost_model.two_level_ring
    sizes, ratios = [], []
    length_of = lengths.__getitem__
    for k, o in enumerate(orders.tolist()):
        ring, seqs, r = seen[o]
        d = len(ring)
        sizes.append(d)
        ratios.append(r)
        rings.append(ring)
        if d > 1:  # a single rank is intra-node with no links (the defaults set above)
            intra[k] = topo.ring_is_intra_node(ring)
            links[k] = topo.inter_node_links(ring)
            if two_level:
                groups[k] = topo.two_level_group(ring)
        m = len(seqs)
        if m == 1:
            owner.append(k)
            seq_len.append(length_of(seqs[0]))
            seq_ring.append(d)
        else:
            owner.extend([k] * m)
            seq_len.extend(map(length_of, seqs))
            seq_ring.extend([d] * m)
    ring_sizes[:] = sizes
    offload[:] = ratios
    s = np.asarray(seq_len, dtype=np.int64)
    d = np.asarray(seq_ring, dtype=np.int64)
    parts = 2 * d
    chunk = -(-s // parts)
    chunk = -(-chunk // align) * align
    padded = np.where(d == 1, s, chunk * parts).astype(np.float64)
    owner_arr = np.asarray(owner, dtype=np.int64)
    sum_p = np.bincount(owner_arr, weights=padded, minlength=n)
    sum_p2 = np.bincount(owner_arr, weights=padded * padded, minlength=n)
    num_docs = np.bincount(owner_arr, minlength=n).astype(np.float64)
    seconds = np.atleast_1d(cost_model.ring_time_from_sums(
        sum_p, sum_p2, ring_sizes, layers=layers_per_stage, offload_ratio=offload, intra_node=intra,
        node_group=groups, num_docs=num_docs,
    ))
    all_layers = layers_per_stage * pp_size
    p2p = all_layers * (ring_sizes - 1) * cost_model.ring_bytes_per_token * sum_p
    inter = p2p * links / ring_sizes  # every link of the cycle carries 1/D of the bytes
    two = groups > 1  # two-level rings: all-to-all inside nodes, a ring of D / G between them
    if np.any(two):
        intra_b, inter_b = cost_model.two_level_bytes(sum_p[two], ring_sizes[two], groups[two], layers=all_layers)
        p2p[two] = intra_b + inter_b
        inter[two] = inter_b
    return MicroBatchCosts(orders=orders, ring_sizes=ring_sizes, seconds=seconds, p2p_bytes=p2p,
                           inter_node_bytes=inter, rings=tuple(rings), offload=offload,
                           seq_owner=owner_arr, seq_lengths=s, holders=holders,
                           sum_p=sum_p, sum_p2=sum_p2, intra_node=intra, node_group=groups, num_docs=num_docs)


def critical_path(plan: StepPlan, cost_model: CostModel, costs: MicroBatchCosts, *, top: int = 16,
                  topology: Topology | None = None) -> float:
    """A second lower bound on the step: the slowest micro-batch on its fastest possible ring.

    A micro-batch cannot finish faster than its time on the best ring size between its own and
    ``hdp_size`` (time falls with D until the ring's communication floor, then latency makes it
    rise); with PP it crosses every stage forward and backward, so ``pp_size`` times that. Only
    the ``top`` slowest micro-batches are examined (the bound is their maximum).
    """
    if len(costs.orders) == 0:
        return 0.0
    rpn = Topology.for_plan(plan, cost_model, topology).ranks_per_node
    n = plan.hdp_size
    best = 0.0
    for k in np.argsort(-costs.seconds, kind="stable")[:top].tolist():
        lengths = costs.seq_lengths[costs.seq_owner == k]
        d0 = int(costs.ring_sizes[k])
        grid = {d0, n}
        x = float(d0)
        while x < n:
            x = max(x * 1.1, x + 1)
            grid.add(min(n, int(x)))
        d = np.array(sorted(grid), dtype=np.int64)[None, :]
        sl = lengths[:, None]
        chunk = -(-sl // (2 * d))
        chunk = -(-chunk // plan.align) * plan.align
        p = np.where(d == 1, sl, chunk * 2 * d).astype(np.float64)
        t = np.atleast_1d(cost_model.ring_time_from_sums(
            p.sum(axis=0), (p * p).sum(axis=0), d[0], layers=plan.layers_per_stage,
            intra_node=d[0] <= rpn, node_group=np.where(d[0] > rpn, rpn, 1), num_docs=len(lengths),
        ))
        best = max(best, min(float(t.min()), float(costs.seconds[k])))
    return best * plan.pp_size


def simulate_plan(plan: StepPlan, cost_model: CostModel, *, record: bool = False,
                  topology: Topology | None = None) -> tuple[MicroBatchCosts, Simulation]:
    """Costs of every micro-batch and the timed simulation of the whole plan."""
    costs = micro_batch_costs(plan, cost_model, topology)
    if plan.ep_size > 1:  # expert groups meet slot by slot (module docstring)
        if has_chunks(plan):
            raise PlanError(f"a plan split into sequence chunks cannot be timed with ep_size {plan.ep_size}: "
                            "plan expert parallelism without the sequence split")
        durations = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
        return costs, lockstep_simulation(plan, durations, cost_model.forward_fraction, record=record)
    if has_chunks(plan):  # split micro-batches: chunk costs, each group's backwards reversed
        costs = chunk_costs(plan, cost_model, costs)
        return costs, Simulation(rank_finish_s=simulate_chunked(plan, costs, cost_model.forward_fraction))
    if plan.pp_size == 1 and not record:
        return costs, Simulation(rank_finish_s=_sequential_finish(plan, costs))
    durations = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
    if plan.virtual_pipeline_size > 1:
        return costs, _interleaved(plan, durations, cost_model.forward_fraction, record)
    sim = simulate(plan, durations, forward_fraction=cost_model.forward_fraction, record=record)
    return costs, sim


def _interleaved(plan: StepPlan, durations: dict[int, float], forward_fraction: float, record: bool) -> Simulation:
    """The interleaved schedule of every pipeline (barriers are a PP = 1 feature; PP plans
    carry none)."""
    check_virtual_pipeline(plan.virtual_pipeline_size, plan.pp_size, plan.layers_per_stage)
    if plan.meta.get("barrier_after_orders"):
        raise PlanError("virtual pipeline stages cannot be combined with barriers between micro-batches")
    lists = [[mb.order for mb in rp.micro_batches] for rp in plan.ranks]
    result = simulate_schedule(lists, durations, pp=plan.pp_size, vpp=plan.virtual_pipeline_size,
                               forward_fraction=forward_fraction, record=record)
    if result is None:
        raise PlanError("the interleaved schedule of this plan deadlocks: ring members must hold every "
                        "ring micro-batch at the same local index (validate() checks it)")
    return Simulation(rank_finish_s=result.rank_finish_s, node_times=dict(result.node_times))


def _sequential_finish(plan: StepPlan, costs: MicroBatchCosts) -> np.ndarray:
    """PP = 1 fast path: process micro-batches in ascending order (valid plans only: every
    rank's list ascends, so this is the same schedule :func:`.order.simulate` computes).

    A barrier holds back what comes after it until everything before it is done; a rank's time
    is the end of its own last micro-batch (0 without any), as in :func:`.order.simulate`.
    """
    members = costs.holders
    barriers = sorted(set(int(b) for b in plan.meta.get("barrier_after_orders", []) or []))
    free = [0.0] * plan.hdp_size  # Python floats: numpy's sums without a numpy call per micro-batch
    latest = released = 0.0  # the latest end so far; when the last barrier passed lets ranks go
    bi = 0
    for o, t in zip(costs.orders.tolist(), costs.seconds.tolist()):
        while bi < len(barriers) and barriers[bi] < o:
            released = latest
            bi += 1
        ranks = members[o]
        if len(ranks) == 1:
            r = ranks[0]
            end = max(free[r], released) + t
            free[r] = end
        else:
            end = max(max([free[r] for r in ranks]), released) + t
            for r in ranks:
                free[r] = end
        if end > latest:
            latest = end
    return np.array(free, dtype=np.float64)


def estimate_plan(plan: StepPlan, cost_model: CostModel, topology: Topology | None = None) -> Estimate:
    """The :class:`Estimate` of ``plan`` (see the module docstring for the model; ``topology``
    see :meth:`.Topology.for_plan`).

    ``extra`` holds: ``max_rank_time_s``, ``mean_rank_time_s``, ``min_rank_time_s``,
    ``lower_bound_s``, ``balance_ratio`` (step / lower bound), ``critical_path_s`` (see
    :func:`critical_path`), ``balance_ratio_vs_bound`` (step / max(lower bound, critical path)),
    ``idle_fraction``, ``num_micro_batches``,
    ``num_rings`` (ring size > 1), ``ring_size_histogram`` ({size: count} over distinct
    micro-batches, sizes as strings for JSON), ``max_ring_size``, ``offloaded_micro_batches``,
    ``micro_batch_counts`` (per rank), ``num_barriers``, ``model``, ``inter_node_p2p_bytes``
    (the part of ``p2p_bytes`` that crosses nodes), ``ranks_per_node``, the ring placement
    counts of :func:`.topology.placement_summary`, ``max_host_bytes_per_rank`` (offloaded
    activations a rank keeps in host memory at once, see :func:`host_bytes_per_rank`) and
    ``host_memory_bytes`` (the cost model's budget, None for unlimited).
    """
    topo = Topology.for_plan(plan, cost_model, topology)
    costs, sim = simulate_plan(plan, cost_model, topology=topo)
    rank_time = sim.rank_finish_s
    n = plan.hdp_size
    busy = float(np.sum(costs.seconds * costs.ring_sizes))
    lower = busy / n if n else 0.0
    step = float(rank_time.max()) if n else 0.0
    hist = Counter(costs.ring_sizes.tolist())
    critical = critical_path(plan, cost_model, costs, topology=topo)
    bound = max(lower, critical)
    extra: dict[str, Any] = {
        "max_rank_time_s": step,
        "mean_rank_time_s": float(rank_time.mean()) if n else 0.0,
        "min_rank_time_s": float(rank_time.min()) if n else 0.0,
        "lower_bound_s": lower,
        "balance_ratio": step / lower if lower > 0 else 1.0,
        "critical_path_s": critical,
        "balance_ratio_vs_bound": step / bound if bound > 0 else 1.0,
        "idle_fraction": 1.0 - busy / (step * n) if step > 0 else 0.0,
        "num_micro_batches": int(len(costs.orders)),
        "num_rings": int(np.sum(costs.ring_sizes > 1)),
        "ring_size_histogram": {str(k): int(v) for k, v in sorted(hist.items())},
        "max_ring_size": int(costs.ring_sizes.max()) if len(costs.ring_sizes) else 0,
        "offloaded_micro_batches": int(np.sum(costs.offload > 0)),
        "micro_batch_counts": plan.micro_batch_counts(),
        "num_barriers": len(plan.meta.get("barrier_after_orders", []) or []),
        "model": ("sequential rendezvous" if plan.pp_size == 1 else (
            f"1F1B x {plan.pp_size} stages, coupled rings" if plan.virtual_pipeline_size == 1 else
            f"interleaved 1F1B x {plan.pp_size} stages x {plan.virtual_pipeline_size} virtual, coupled rings"))
        + (f", expert groups of {plan.ep_size} in lockstep" if plan.ep_size > 1 else ""),
        "inter_node_p2p_bytes": int(round(float(np.sum(costs.inter_node_bytes)))),
        "ranks_per_node": topo.ranks_per_node,
        **placement_summary(topo, [r for r in costs.rings if len(r) > 1]),
        "max_host_bytes_per_rank": float(host_bytes_per_rank(plan, cost_model, costs).max(initial=0.0)),
        "host_memory_bytes": cost_model.host_memory_bytes,
    }
    if plan.virtual_pipeline_size > 1:
        extra["virtual_pipeline_size"] = plan.virtual_pipeline_size
    return Estimate(
        step_time_s=step,
        rank_time_s=tuple(float(x) for x in rank_time),
        p2p_bytes=int(round(float(np.sum(costs.p2p_bytes)))),
        extra=extra,
    )


def with_virtual_pipeline(plan: StepPlan, vpp: int, cost_model: CostModel,
                          topology: Topology | None = None) -> StepPlan:
    """``plan`` with ``vpp`` virtual pipeline stages per stage and the estimate of that schedule
    (the rings and orders stay; ValueError if ``vpp`` cannot split the plan's stages)."""
    check_virtual_pipeline(vpp, plan.pp_size, plan.layers_per_stage)
    out = replace(plan, virtual_pipeline_size=vpp)
    return replace(out, estimate=estimate_plan(out, cost_model, topology) if plan.estimate is not None else None)


def host_bytes_per_rank(plan: StepPlan, cost_model: CostModel, costs: MicroBatchCosts | None = None) -> np.ndarray:
    """Host bytes of offloaded activations each rank holds at its fullest.

    A micro-batch with ratio r fills ``r * (l - 2) * Act(share)`` on each member (share: the
    fullest member's real tokens, as in :func:`.offload.host_bytes_per_member`). Without PP a
    rank holds one micro-batch's at a time (its largest counts); with PP the first stage keeps
    up to ``pp_size`` forwards in flight (the sum of its ``pp_size`` largest).
    """
    if costs is None:
        costs = micro_batch_costs(plan, cost_model)
    out = np.zeros(plan.hdp_size)
    layers = plan.layers_per_stage
    if len(costs.orders) == 0 or layers <= 2 or not np.any(costs.offload > 0):
        return out
    rings = costs.ring_sizes[costs.seq_owner]
    shares = max_zigzag_share_array(costs.seq_lengths, rings, plan.align).astype(np.float64)
    share = np.bincount(costs.seq_owner, weights=shares, minlength=len(costs.orders))
    host = costs.offload * (layers - 2) * cost_model.activation_bytes(share)
    for rank_plan in plan.ranks:
        orders = [mb.order for mb in rank_plan.micro_batches if mb.offload_ratio > 0]
        if orders:
            values = np.sort(host[np.searchsorted(costs.orders, orders)])[::-1]
            out[rank_plan.rank] = float(values[: plan.pp_size].sum())
    return out
