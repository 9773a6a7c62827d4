"""What every scheduler shares: input checks, overlong handling, plan emission.

Schedulers receive a checked :class:`PlanRequest` and return :class:`Placement` s in the global
order the ranks must follow; :func:`emit_plan` turns them into a :class:`StepPlan` through
:class:`FastPlanBuilder` (a :class:`PlanBuilder` whose ``add`` computes each member's zigzag share
in O(1) instead of listing all 2N parts per member).
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..cost_model import CostModel
from ..plan import (MAX_SEQUENCE_LENGTH, MicroBatch, Piece, PlanBuilder, Sequence as PlanSequence, StepPlan,
                    check_virtual_pipeline)
from ..sharding import ShardingContext, Unit
from ..slots import slot_constructor
from ..topology import Topology
from ..zigzag import zigzag_chunk

logger = logging.getLogger(__name__)

OVERLONG_MODES = ("error", "drop", "truncate")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Checked inputs of :func:`make_plan`."""

    ids: tuple[int, ...]
    lengths: tuple[int, ...]
    hdp_size: int
    capacity: int
    cost_model: CostModel
    pp_size: int = 1
    layers: int
    ep_size: int = 1
    """Expert-parallel size: ring micro-batches then sit at the same local index on every
    member (the MoE all-to-all of an expert group meets slot by slot; ``StepPlan.ep_size``)."""
    offload: bool = True
    overlong: str = "error"
    align: int = 1
    context_length: int | None = None
    delta: float = 0.05
    num_buckets: int = 4
    topology: Topology | None = None
    """Where the HDP ranks sit (None: the cost model's ``ranks_per_node``)."""
    pieces: bool = True
    """False: a timing-only plan (no token pieces; see :func:`make_plan`)."""
    even_expert_slots: bool = True
    """With ``ep_size`` > 1, let balance sort each member's single-rank micro-batches so those of
    similar length share a slot where the estimate says it pays (:mod:`.ep_slots`)."""
    seq_split: bool = False
    """Split PP-Balance's longest rings along the pipeline where the estimate says it pays and
    the kept prefix fits (:func:`..chunk_estimate.split_where_faster`)."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline stage of the interleaved schedule the plan will run
    (``StepPlan.virtual_pipeline_size``): every plan is emitted with it, so its estimate times
    that schedule, and ``balance`` picks its winner by it."""
    meta: dict[str, Any] = field(default_factory=dict)

    def sharding_context(self, *, offload: bool | None = None) -> ShardingContext:
        return ShardingContext(
            capacity=self.capacity, layers=self.layers, cost_model=self.cost_model,
            hdp_size=self.hdp_size, align=self.align,
            offload=self.offload if offload is None else offload,
            topology=Topology.of(self.cost_model, self.topology),
            in_flight=self.pp_size,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """One ring micro-batch: its members (ring order) and what it carries."""

    ring: tuple[int, ...]
    seqs: tuple[int, ...]
    offload_ratio: float = 0.0


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{name} ({value!r}) must be an integer >= {minimum}")
    return int(value)


def check_lengths(lengths: Any) -> np.ndarray:
    """Sequence lengths as int64; every one must be an integer >= 1."""
    if isinstance(lengths, np.ndarray):
        arr = lengths.reshape(-1)
        if arr.dtype.kind not in "iu":
            bad = next((i for i, x in enumerate(arr.tolist()) if not float(x).is_integer()), None)
            where = f" (index {bad}: {arr[bad].item()!r})" if bad is not None else ""
            raise ValueError(f"sequence lengths must be integers, got dtype {arr.dtype}{where}")
        arr = arr.astype(np.int64)
    else:
        values = list(lengths)
        for i, x in enumerate(values):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise ValueError(f"sequence length at index {i} ({x!r}) is not an integer; lengths are token counts")
            if x > MAX_SEQUENCE_LENGTH:  # before int64 could overflow
                raise ValueError(_too_long(i, int(x)))
        arr = np.asarray(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)
    big = np.flatnonzero(arr > MAX_SEQUENCE_LENGTH)
    if len(big):
        raise ValueError(_too_long(int(big[0]), int(arr[big[0]])))
    bad = np.flatnonzero(arr <= 0)
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"sequence length at index {i} is {int(arr[i])}; every length must be >= 1 "
            f"({len(bad)} bad value(s); drop empty documents before planning)"
        )
    return arr


def _too_long(index: int, length: int) -> str:
    return (f"sequence length at index {index} is {length}; the planner accepts at most "
            f"{MAX_SEQUENCE_LENGTH} (2**40) tokens per sequence")


def build_request(
    lengths: Any,
    *,
    hdp_size: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    offload: bool,
    overlong: str,
    align: int,
    context_length: int | None,
    delta: float,
    num_buckets: int,
    topology: Topology | None = None,
    pieces: bool = True,
    ep_size: int = 1,
    seq_split: bool = False,
    scheduler: str = "balance",
    even_expert_slots: bool = True,
    virtual_pipeline_size: int = 1,
) -> PlanRequest:
    """Check every argument of :func:`make_plan`; raise ValueError naming the bad one.

    A ``topology`` overrides the cost model's ``ranks_per_node`` everywhere (sharding, widening
    and the estimate see the same nodes)."""
    arr = check_lengths(lengths)
    hdp_size = _check_int("hdp_size", hdp_size)
    capacity = _check_int("capacity", capacity)
    pp_size = _check_int("pp_size", pp_size)
    ep_size = _check_int("ep_size", ep_size)
    if hdp_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide hdp_size ({hdp_size}): expert groups are "
                         "carved out of the HDP ranks")
    align = _check_int("align", align)
    num_buckets = _check_int("num_buckets", num_buckets)
    if context_length is not None:
        context_length = _check_int("context_length", context_length)
    if align > capacity:
        raise ValueError(
            f"align ({align}) must be <= capacity ({capacity}): every zigzag part is padded to a "
            "multiple of align tokens, so a sequence longer than the capacity could never be "
            "split into parts that fit a rank"
        )
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong ({overlong!r}) must be one of {list(OVERLONG_MODES)}")
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 <= float(delta) < 1:
        raise ValueError(f"delta ({delta!r}) must be a fraction of the max rank time in [0, 1)")
    layers = cost_model.layers_per_stage(pp_size)
    if not isinstance(even_expert_slots, bool):
        raise ValueError(f"even_expert_slots ({even_expert_slots!r}) must be True or False")
    if not isinstance(seq_split, bool):
        raise ValueError(f"seq_split ({seq_split!r}) must be True or False")
    check_virtual_pipeline(virtual_pipeline_size, pp_size, layers)
    if seq_split:
        check_seq_split(scheduler=scheduler, pp_size=pp_size, ep_size=ep_size,
                        virtual_pipeline_size=virtual_pipeline_size)
    if topology is not None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
        topology.check_size(hdp_size)
        if topology.ranks_per_node != cost_model.ranks_per_node:
            cost_model = cost_model.with_(ranks_per_node=topology.ranks_per_node)
    return PlanRequest(
        ids=tuple(range(len(arr))), lengths=tuple(arr.tolist()),  # int64 -> Python ints
        hdp_size=hdp_size, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
        layers=layers, offload=bool(offload), overlong=overlong, align=align,
        context_length=context_length, delta=float(delta), num_buckets=num_buckets,
        topology=topology, pieces=bool(pieces), ep_size=ep_size, seq_split=seq_split,
        even_expert_slots=even_expert_slots, virtual_pipeline_size=int(virtual_pipeline_size),
    )


def seq_split_conflicts(*, scheduler: str, pp_size: int, ep_size: int = 1,
                        virtual_pipeline_size: int = 1, offload: bool = False) -> list[str]:
    """What keeps rings from being split along the pipeline, as keys (``scheduler``, ``pp``,
    ``vpp``, ``ep``, ``offload``): one rule for the planner and the training flags, each of which
    words them its own way. The split needs the ``balance`` scheduler, PP > 1, plain 1F1B (no
    virtual stages), no expert parallelism (a split's shifted orders break the one-slot rule)
    and, where the caller asks (training), no activation offload (split chunks do not offload)."""
    return [key for key, bad in (("scheduler", scheduler != "balance"), ("pp", pp_size < 2),
                                 ("vpp", virtual_pipeline_size != 1), ("ep", ep_size != 1),
                                 ("offload", offload)) if bad]


def check_seq_split(*, scheduler: str, pp_size: int, ep_size: int = 1, virtual_pipeline_size: int = 1,
                    offload: bool = False, flag: str = "seq_split") -> None:
    """Raise ValueError in one line unless splitting rings along the pipeline applies
    (:func:`seq_split_conflicts`)."""
    words = {
        "scheduler": f"scheduler {scheduler!r} (use balance)",
        "pp": f"pipeline size {pp_size} (needs >= 2: there is no fill and drain to shorten)",
        "vpp": f"{virtual_pipeline_size} virtual stages (split chunks run plain 1F1B; drop the VPP flags)",
        "ep": f"expert groups of {ep_size} HDP ranks in lockstep (ep_size {ep_size}; needs 1)",
        "offload": "activation offload (split chunks do not offload; turn offload off)",
    }
    why = seq_split_conflicts(scheduler=scheduler, pp_size=pp_size, ep_size=ep_size,
                              virtual_pipeline_size=virtual_pipeline_size, offload=offload)
    if why:
        raise ValueError(f"{flag} cannot apply with " + ", ".join(words[k] for k in why))


def apply_overlong(
    request: PlanRequest,
    max_length: int,
    *,
    why: str,
    hint: str,
) -> PlanRequest:
    """Handle sequences longer than ``max_length`` per ``request.overlong``.

    ``error`` raises naming the first one; ``drop`` removes them (``meta["dropped"]``);
    ``truncate`` cuts them to ``max_length`` (``meta["truncated"]``: id, from, to).
    """
    if request.context_length is not None:
        if request.context_length < max_length:
            max_length, why = request.context_length, f"the context length is {request.context_length}"
    over = [(i, n) for i, n in zip(request.ids, request.lengths) if n > max_length]
    if not over:
        return request
    if max_length < 1 and request.overlong == "truncate":
        raise ValueError(f"no sequence can fit ({why}); truncation is impossible. {hint}")
    if request.overlong == "error":
        sid, n = over[0]
        raise ValueError(
            f"sequence {sid} has {n} tokens but at most {max_length} fit: {why}. "
            f"{len(over)} sequence(s) are too long. {hint}, or pass overlong='drop' or 'truncate' "
            f"(--overlong drop|truncate)"
        )
    meta = dict(request.meta)
    if request.overlong == "drop":
        dropped = {i for i, _ in over}
        keep = [(i, n) for i, n in zip(request.ids, request.lengths) if i not in dropped]
        meta["dropped"] = sorted(dropped)
        meta["dropped_tokens"] = int(sum(n for _, n in over))
        logger.info("dropped %d overlong sequence(s) (%d tokens)", len(dropped), meta["dropped_tokens"])
    else:
        keep = [(i, min(n, max_length)) for i, n in zip(request.ids, request.lengths)]
        meta["truncated"] = [{"id": i, "from": n, "to": max_length} for i, n in over]
        meta["truncated_tokens"] = int(sum(n - max_length for _, n in over))
        logger.info("truncated %d overlong sequence(s) to %d tokens", len(over), max_length)
    meta["overlong_limit"] = int(max_length)
    return replace(request, ids=tuple(i for i, _ in keep), lengths=tuple(n for _, n in keep), meta=meta)


_piece = slot_constructor(Piece, ("seq", "start", "end"))
_sequence = slot_constructor(PlanSequence, ("id", "length"))
_micro_batch = slot_constructor(MicroBatch, ("order", "ring", "offload_ratio", "seqs", "pieces"))
placement = slot_constructor(Placement, ("ring", "seqs", "offload_ratio"))
"""``placement(ring, seqs, offload_ratio)``: a :class:`Placement` without the dataclass ``__init__``
(the list schedulers make one per unit)."""


class FastPlanBuilder(PlanBuilder):
    """:class:`PlanBuilder` with an O(1)-per-member ``add`` (same micro-batches, same orders).

    :func:`~megatron_bytescale.planner.plan.build_ring_micro_batches` calls ``zigzag_share``
    per member, which lists all 2N parts: O(N^2) per ring, minutes for rings of thousands of
    ranks. Here each member's two parts come from the chunk size directly.

    With ``pieces=False`` every member gets the same micro-batch with no pieces: a timing-only
    plan for the simulator (rings, sequences and orders are all its estimate reads), which
    skips the zigzag split of every document over its ring.
    """

    def __init__(self, *, pieces: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pieces = pieces

    def add_placements(self, placements: Iterable[Placement]) -> None:
        """:meth:`add` of every placement in turn (the same micro-batches and orders); the
        single-rank ones, most of a step's, inline: a plan has ten thousand of them."""
        if not self.pieces:
            for p in placements:
                self.add(p.ring, p.seqs, p.offload_ratio)
            return
        lengths, per_rank, add, piece, micro_batch = self.lengths, self.per_rank, self.add, _piece, _micro_batch
        for p in placements:
            ring = p.ring
            if len(ring) != 1:
                add(ring, p.seqs, p.offload_ratio)
                continue
            order = self._next_order
            self._next_order = order + 1
            rank = int(ring[0])
            seqs = tuple(map(int, p.seqs))
            per_rank[rank].append(micro_batch(order, (rank,), p.offload_ratio, seqs,
                                              tuple(map(piece, seqs, repeat(0), map(lengths.__getitem__, seqs)))))

    def add(self, ring: Iterable[int], seqs: Iterable[int], offload_ratio: float = 0.0) -> int:
        order = self._next_order
        self._next_order += 1
        ring_t = tuple(map(int, ring))
        seqs_t = tuple(map(int, seqs))
        n = len(ring_t)
        if not self.pieces:
            shared = _micro_batch(order, ring_t, offload_ratio, seqs_t, ())
            for rank in ring_t:
                self.per_rank[rank].append(shared)
            return order
        if n == 1:
            lengths = self.lengths
            pieces = tuple([_piece(s, 0, lengths[s]) for s in seqs_t])
            self.per_rank[ring_t[0]].append(_micro_batch(order, ring_t, offload_ratio, seqs_t, pieces))
            return order
        last = 2 * n - 1
        if len(seqs_t) == 1:  # a long sequence on its own ring (the common case): no per-member lists
            s = seqs_t[0]
            length = self.lengths[s]
            chunk = zigzag_chunk(length, n, self.align)
            used = min(2 * n, -(-length // chunk))  # parts 0 .. used - 1 hold real tokens
            per_rank = self.per_rank
            for pos, rank in enumerate(ring_t):
                if pos < used:  # parts pos and last - pos (> pos: unused if pos is)
                    a = pos * chunk
                    lower = _piece(s, a, min(a + chunk, length))
                    k = last - pos
                    if k < used:
                        pieces = (lower, _piece(s, k * chunk, min(k * chunk + chunk, length)))
                    else:
                        pieces = (lower,)
                else:
                    pieces = ()
                per_rank[rank].append(_micro_batch(order, ring_t, offload_ratio, seqs_t, pieces))
            return order
        pieces_of: list[list[Piece]] = [[] for _ in range(n)]
        for s in seqs_t:
            length = self.lengths[s]
            chunk = zigzag_chunk(length, n, self.align)
            # only the first ceil(length / chunk) parts hold real tokens; part k belongs to
            # position k (k < n) or 2n-1-k, and a position's lower part comes first
            for k in range(min(2 * n, -(-length // chunk))):
                a = k * chunk
                pieces_of[k if k < n else last - k].append(_piece(s, a, min(a + chunk, length)))
        for pos, rank in enumerate(ring_t):
            self.per_rank[rank].append(_micro_batch(order, ring_t, offload_ratio, seqs_t, tuple(pieces_of[pos])))
        return order


def emit_plan(
    request: PlanRequest,
    placements: Sequence[Placement],
    *,
    scheduler: str,
    meta: Mapping[str, Any] | None = None,
    offload_allowed: bool = True,
) -> StepPlan:
    """Assemble the plan: orders follow ``placements``; meta gets the common fields.

    ``offload_allowed`` is False for the baselines, which never offload whatever was requested.
    """
    lengths = dict(zip(request.ids, request.lengths))
    builder = FastPlanBuilder(hdp_size=request.hdp_size, capacity=request.capacity,
                              lengths=lengths, align=request.align, pieces=request.pieces)
    builder.add_placements(placements)
    ring_sizes = [len(p.ring) for p in placements]
    full_meta: dict[str, Any] = {
        "context_length": int(request.context_length or max(request.lengths, default=0)),
        "cost_model": request.cost_model.name,
        "num_micro_batches": len(placements),
        "num_rings": sum(1 for d in ring_sizes if d > 1),
        "max_ring_size": max(ring_sizes, default=0),
        "offload": request.offload and offload_allowed,
        "offloaded_micro_batches": sum(1 for p in placements if p.offload_ratio > 0),
        "overlong": request.overlong,
        "topology": Topology.of(request.cost_model, request.topology).to_dict(),
        **({} if request.pieces else {"pieces": False}),
        **request.meta,
        **(meta or {}),
    }
    sequences = tuple(map(_sequence, request.ids, request.lengths))
    plan = builder.build(scheduler=scheduler, pp_size=request.pp_size, ep_size=request.ep_size,
                         layers_per_stage=request.layers,
                         sequences=sequences, meta=full_meta)
    if request.virtual_pipeline_size != 1:
        plan = replace(plan, virtual_pipeline_size=request.virtual_pipeline_size)
    return plan


def split_equal_work(units: Sequence[Unit], num_buckets: int) -> list[list[Unit]]:
    """Cut a sorted list into at most ``num_buckets`` contiguous buckets of ~equal total work."""
    if not units:
        return []
    work = np.cumsum([u.work for u in units])
    total = float(work[-1])
    if total <= 0 or num_buckets <= 1:
        return [list(units)]
    bounds = np.searchsorted(work, total * np.arange(1, num_buckets) / num_buckets, side="left") + 1
    out, start = [], 0
    for b in list(bounds) + [len(units)]:
        b = int(min(max(b, start), len(units)))
        if b > start:
            out.append(list(units[start:b]))
            start = b
    if start < len(units):
        out.append(list(units[start:]))
    return out


def unit_sort_key(u: Unit) -> tuple:
    """Heaviest first: time, then ring size, then first sequence id (deterministic)."""
    return (-u.time, -u.ring_size, u.seqs[0])


def unit_work_key(u: Unit) -> tuple:
    """Most rank-seconds first (a wide ring before a long single), then as :func:`unit_sort_key`."""
    return (-u.work, -u.time, -u.ring_size, u.seqs[0])


SchedulerFn = Callable[[PlanRequest], StepPlan]


def apply_hdp_overlong(request: PlanRequest) -> PlanRequest:
    """Overlong handling for the HDP schedulers: a sequence must fit on all ranks (with full
    offload when offload is on)."""
    from ..offload import max_fitting_length

    fit = dict(capacity=request.capacity, layers=request.layers, max_ring_size=request.hdp_size,
               offload=request.offload, align=request.align, in_flight=request.pp_size)
    limit = max_fitting_length(cost_model=request.cost_model, **fit)
    how = "with full offload " if request.offload and request.layers > 2 else ""
    why = (f"even all {request.hdp_size} HDP ranks {how}hold at most {limit} tokens of one "
           f"sequence at capacity {request.capacity}")
    hint = "Use more HDP ranks or a larger capacity" + ("" if request.offload else ", enable offload")
    budget = request.cost_model.host_memory_bytes
    if request.offload and budget is not None and max(request.lengths, default=0) > limit:
        unlimited = max_fitting_length(cost_model=request.cost_model.with_(host_memory_bytes=None), **fit)
        if unlimited > limit:
            longest = min(unlimited, max(request.lengths))
            need = host_memory_needed(request, longest)
            why += (f" within the host memory budget of {budget / 1e9:.3g} GB per rank ({longest} "
                    f"tokens on all ranks need {need / 1e9:.3g} GB of it)")
            hint = "Raise --bytescale-host-memory-gb (CostModel.host_memory_bytes), use more HDP ranks"
    return apply_overlong(request, limit, why=why, hint=hint)


def host_memory_needed(request: PlanRequest, length: int) -> float:
    """Host bytes per rank a sequence of ``length`` needs on all HDP ranks with the least offload."""
    from ..offload import host_bytes_per_member, minimal_ratio_for_ring

    unlimited = request.cost_model.with_(host_memory_bytes=None)
    r = minimal_ratio_for_ring(length, request.hdp_size, capacity=request.capacity, cost_model=unlimited,
                               layers=request.layers, align=request.align) or 0.0
    return request.pp_size * host_bytes_per_member(length, request.hdp_size, r, layers=request.layers,
                                                   cost_model=unlimited, align=request.align)
