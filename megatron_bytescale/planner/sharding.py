"""Data-aware sharding (paper §5.1, Alg. 1 lines 1-9): which sequences travel together, on how many ranks.

* A sequence shorter than the capacity C never communicates: short sequences are packed onto
  single ranks, best-fit decreasing, at most C tokens per pack.
* A sequence of C or more tokens gets its own ring of D(s) ranks from Eq. 3 (:mod:`.offload`),
  with the offload ratio that makes D(s) possible, cut per-document zigzag with ``align``.

The result is a list of :class:`Unit` (one future micro-batch each) that the schedulers place
on ranks. Everything is deterministic: sorts use the sequence id as the final tie-breaker.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np

from .cost_model import CostModel
from .offload import minimal_ratio_for_ring, ring_sizes_without_offload, solve_offload
from .slots import slot_constructor
from .topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """Sequences that form one ring micro-batch, and the ring size they need."""

    seqs: tuple[int, ...]
    """Sequence ids in local buffer order."""
    lengths: tuple[int, ...]
    ring_size: int
    offload_ratio: float = 0.0
    min_ring_size: int = 1
    """Eq. 3's D(s): the fewest ranks this unit may use (schedulers may widen up to the HDP size)."""
    time: float = 0.0
    """Seconds per member on ``ring_size`` ranks (assuming intra-node when the ring fits a node)."""

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def work(self) -> float:
        """Rank-seconds: time times ring size."""
        return self.time * self.ring_size


@dataclass(frozen=True, kw_only=True)
class ShardingContext:
    """What the sharding and the schedulers need to know about the cluster and the model."""

    capacity: int
    layers: int
    """Layers per PP stage (l of Eq. 3; also the layers a rank runs per micro-batch)."""
    cost_model: CostModel
    hdp_size: int
    align: int = 1
    offload: bool = True
    topology: Topology | None = None
    """Where the HDP ranks sit (None: ``cost_model.ranks_per_node`` consecutive ranks per node)."""
    in_flight: int = 1
    """Micro-batches whose offloaded activations share a rank's host memory at once (pp_size)."""

    @cached_property
    def nodes(self) -> Topology:
        """The topology, never None (made once: the schedulers ask for it per ring placed)."""
        return Topology.of(self.cost_model, self.topology)

    def node_group(self, ring_size: Any) -> Any:
        """Members per node a ring of ``ring_size`` is costed with before it is placed: the
        ranks per node for a two-level ring over several nodes, else 1 (flat)."""
        g = self.cost_model.ranks_per_node
        if not self.cost_model.two_level_ring:
            return np.ones_like(np.asarray(ring_size)) if np.ndim(ring_size) else 1
        return np.where(np.asarray(ring_size) > g, g, 1) if np.ndim(ring_size) else (g if ring_size > g else 1)

    def round_ring(self, ring_size: int) -> int:
        """``ring_size`` rounded up to whole nodes when rings over several nodes run two-level
        (the runtime needs the same members on every node), if the HDP group has that many."""
        g = self.cost_model.ranks_per_node
        if not self.cost_model.two_level_ring or ring_size <= g:
            return ring_size
        up = -(-ring_size // g) * g
        return up if up <= self.hdp_size else ring_size

    def unit_time(self, lengths: Sequence[int], ring_size: int, offload_ratio: float,
                  intra_node: bool | None = None, node_group: int | None = None) -> float:
        if intra_node is None:
            intra_node = ring_size <= self.cost_model.ranks_per_node
        return self.cost_model.micro_batch_time(
            lengths, ring_size, layers=self.layers, offload_ratio=offload_ratio,
            align=self.align, intra_node=intra_node,
            node_group=self.node_group(ring_size) if node_group is None else node_group,
        )

    def ring_time(self, lengths: Sequence[int], ring: Sequence[int], offload_ratio: float) -> float:
        """Seconds per member of a unit placed on ``ring`` (its nodes decide NVLink, network or
        two-level)."""
        topo = self.nodes
        group = topo.two_level_group(ring) if self.cost_model.two_level_ring else 1
        return self.unit_time(lengths, len(ring), offload_ratio, intra_node=topo.ring_is_intra_node(ring),
                              node_group=group)

    def placed_time(self, unit: Unit, ring: Sequence[int]) -> float:
        """:meth:`ring_time` of ``unit`` on ``ring``, reusing ``unit.time`` when the ring's nodes
        give the rate and node group that time was costed with (a ring that fits a node inside
        one, a longer one across nodes, flat or two-level as :meth:`node_group` assumed): the
        same inputs to the cost model, so the same float. The schedulers place thousands of
        rings per step, and a scalar cost-model call costs ~20 us."""
        d = len(ring)
        if d != unit.ring_size:
            return self.ring_time(unit.lengths, ring, unit.offload_ratio)
        cm = self.cost_model
        topo = self.nodes
        if topo.ring_is_intra_node(ring) != (d <= cm.ranks_per_node):
            return self.ring_time(unit.lengths, ring, unit.offload_ratio)
        if cm.two_level_ring and d > 1:
            actual, assumed = topo.two_level_group(ring), self.node_group(d)
            if (actual if d > actual else 1) != (assumed if d > assumed else 1):
                return self.ring_time(unit.lengths, ring, unit.offload_ratio)
        return unit.time

    def time_on_rings(self, lengths: Sequence[int], ring_sizes: np.ndarray) -> np.ndarray:
        """Seconds per member of one unit on each ring size in ``ring_sizes`` (no offload; a
        ratio chosen by Eq. 3 never exposes transfer time), vectorised."""
        d = np.asarray(ring_sizes, dtype=np.int64)[None, :]
        p = self._padded(np.asarray(lengths, dtype=np.int64)[:, None], d)
        return np.asarray(self.cost_model.ring_time_from_sums(
            p.sum(axis=0), (p * p).sum(axis=0), d[0], layers=self.layers,
            intra_node=d[0] <= self.cost_model.ranks_per_node, node_group=self.node_group(d[0]),
            num_docs=len(lengths),
        ), dtype=np.float64).reshape(-1)

    def time_on_rings_each(self, lengths: Sequence[int], ring_sizes: Sequence[np.ndarray]) -> list[np.ndarray]:
        """:meth:`time_on_rings` of many one-sequence units at once: ``lengths[i]`` on each size
        in ``ring_sizes[i]``. The same floats as one call per unit (a single sequence's sums
        are its own padded length and its square, and the cost model is elementwise), one
        vectorised call for all."""
        counts = [len(g) for g in ring_sizes]
        if not counts:
            return []
        d = np.concatenate([np.asarray(g, dtype=np.int64) for g in ring_sizes])
        p = self._padded(np.repeat(np.asarray(lengths, dtype=np.int64), counts), d)
        t = np.asarray(self.cost_model.ring_time_from_sums(
            p, p * p, d, layers=self.layers, intra_node=d <= self.cost_model.ranks_per_node,
            node_group=self.node_group(d), num_docs=1,
        ), dtype=np.float64).reshape(-1)
        return np.split(t, np.cumsum(counts)[:-1])

    def _padded(self, s: np.ndarray, d: np.ndarray) -> np.ndarray:
        """``P_j`` as floats: each length ``s`` zigzag-padded on rings of ``d`` (broadcast)."""
        parts = 2 * d
        chunk = -(-s // parts)
        chunk = -(-chunk // self.align) * self.align
        return np.where(d == 1, s, chunk * parts).astype(np.float64)

    def resize(self, unit: Unit, ring_size: int) -> Unit:
        """``unit`` on ``ring_size`` ranks (>= its minimum; rounded by :meth:`round_ring`) with the
        smallest offload ratio that fits."""
        ring_size = self.round_ring(ring_size)
        if ring_size == unit.ring_size:
            return unit
        if len(unit.seqs) == 1 and self.offload:
            r = minimal_ratio_for_ring(unit.lengths[0], ring_size, capacity=self.capacity,
                                       cost_model=self.cost_model, layers=self.layers, align=self.align,
                                       in_flight=self.in_flight)
            r = unit.offload_ratio if r is None else r
        else:
            r = 0.0 if ring_size > unit.ring_size else unit.offload_ratio
        return replace(unit, ring_size=ring_size, offload_ratio=r,
                       time=self.unit_time(unit.lengths, ring_size, r))


_unit = slot_constructor(Unit, ("seqs", "lengths", "ring_size", "offload_ratio", "min_ring_size", "time"))


def best_fit_decreasing(ids: Sequence[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity`` by best-fit decreasing; returns bins of ids.

    Items are taken longest first (ties by id); each goes to the open bin with the least room
    that still fits it, else a new bin. Bins are returned in creation order, items in insertion
    order.
    """
    return best_fit_packs(ids, lengths, capacity)[0]


def best_fit_packs(ids: Sequence[int], lengths: Sequence[int], capacity: int) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`best_fit_decreasing`'s bins of ids and, bin for bin, the lengths they hold."""
    if not len(ids):
        return [], []
    ids_a = np.asarray(ids, dtype=np.int64)
    len_a = np.asarray(lengths, dtype=np.int64)
    # longest first, ties by id (a numpy sort: the same order as sorted() with that key)
    order = np.lexsort((ids_a, -len_a))
    bins: list[list[int]] = []
    packs: list[list[int]] = []
    shift = max(1, len(ids)).bit_length()
    room: list[int] = []  # sorted keys remaining << shift | bin index (one int compares fast)
    mask = (1 << shift) - 1
    left, insort = bisect.bisect_left, bisect.insort
    for sid, need in zip(ids_a[order].tolist(), len_a[order].tolist()):
        key = need << shift
        pos = left(room, key)
        if pos < len(room):
            old = room.pop(pos)
            b = old & mask
            bins[b].append(sid)
            packs[b].append(need)
            insort(room, old - key)  # the room left, the same bin index in the low bits
        else:
            insort(room, (capacity - need) << shift | len(bins))
            bins.append([sid])
            packs.append([need])
    return bins, packs


def shard_batch(ids: Sequence[int], lengths: Sequence[int], ctx: ShardingContext) -> list[Unit]:
    """Units of a batch: BFD packs of the short sequences, then one ring unit per long sequence.

    Long units come first in id order, packs after in packing order; schedulers sort as they
    need.
    """
    ids_a = np.asarray(ids, dtype=np.int64).reshape(-1)
    len_a = np.asarray(lengths, dtype=np.int64).reshape(-1)
    is_long = len_a >= ctx.capacity
    long_ids = ids_a[is_long]
    by_id = np.argsort(long_ids, kind="stable")  # ids are unique: the order of sorted((id, n))
    long_ = list(zip(long_ids[by_id].tolist(), len_a[is_long][by_id].tolist()))
    short_ids, short_lengths = ids_a[~is_long], len_a[~is_long]
    units: list[Unit] = []
    long_lengths = [n for _, n in long_]
    free = ring_sizes_without_offload(long_lengths, capacity=ctx.capacity, cost_model=ctx.cost_model,
                                      layers=ctx.layers, align=ctx.align)
    # Eq. 3 per sequence, from its offload-free ring (solve_offload returns that one at once
    # without offload)
    decisions = [solve_offload(n, capacity=ctx.capacity, layers=ctx.layers, cost_model=ctx.cost_model,
                               align=ctx.align, offload=ctx.offload, max_ring_size=ctx.hdp_size,
                               in_flight=ctx.in_flight, without_offload=d0)
                 for n, d0 in zip(long_lengths, free)]
    times = long_times(long_lengths, [d.ring_size for d in decisions], [d.offload_ratio for d in decisions], ctx)
    make = _unit
    for (sid, n), dec, t in zip(long_, decisions, times):
        d = dec.ring_size  # whole nodes for a two-level ring: resize
        units.append(ctx.resize(make((sid,), (n,), d, dec.offload_ratio, d, t), d))
    if len(short_ids):
        bins, packs = best_fit_packs(short_ids, short_lengths, ctx.capacity)
        units += [make(tuple(b), tuple(p), 1, 0.0, 1, t) for b, p, t in zip(bins, packs, pack_times(packs, ctx))]
    return units


def long_times(lengths: Sequence[int], ring_sizes: Sequence[int], ratios: Sequence[float],
               ctx: ShardingContext) -> list[float]:
    """Seconds of single-sequence units on their rings, vectorised (same as :meth:`unit_time`)."""
    if not lengths:
        return []
    d = np.asarray(ring_sizes, dtype=np.int64)
    p = ctx.cost_model.padded_lengths(np.asarray(lengths, dtype=np.int64), 1, 1)
    parts = 2 * d
    chunk = -(-p // parts)
    chunk = -(-chunk // ctx.align) * ctx.align
    p = np.where(d == 1, p, chunk * parts).astype(np.float64)
    out = ctx.cost_model.ring_time_from_sums(p, p * p, d, layers=ctx.layers, offload_ratio=np.asarray(ratios),
                                             intra_node=d <= ctx.cost_model.ranks_per_node,
                                             node_group=ctx.node_group(d))
    return [float(x) for x in np.atleast_1d(out)]


def pack_times(packs: Iterable[Sequence[int]], ctx: ShardingContext) -> list[float]:
    """Seconds of single-rank packs, vectorised (D = 1, no padding).

    The sums are taken in integers (exact whatever the order) and converted once; each pack's
    document count feeds the cost model's per-document term."""
    packs = list(packs)
    if not packs:
        return []
    sizes = np.fromiter((len(p) for p in packs), dtype=np.int64, count=len(packs))
    flat = np.fromiter((n for p in packs for n in p), dtype=np.int64, count=int(sizes.sum()))
    sums, sq = np.zeros(len(packs)), np.zeros(len(packs))
    full = sizes > 0
    if full.any():
        starts = (np.cumsum(sizes) - sizes)[full]
        sums[full] = np.add.reduceat(flat, starts)
        sq[full] = np.add.reduceat(flat * flat, starts)
    out = ctx.cost_model.ring_time_from_sums(sums, sq, np.ones(len(packs)), layers=ctx.layers,
                                             num_docs=sizes.astype(np.float64))
    return [float(x) for x in np.atleast_1d(out)]
