"""Topology-aware ring placement: which ranks a ring takes, given every rank's load.

Load-only list scheduling gives a ring of D ranks the D least-loaded ranks wherever they are.
On a real cluster that makes rings that would fit in one node straddle two, and spreads long
rings over more nodes than they need, so their bytes cross the network (nine times slower
than NVLink in the H100 preset) for nothing. The rule every scheduler follows (balance, its
fallbacks and naive, with offload on or off, DP and PP):

* a ring of at most ``ranks_per_node`` ranks sits on one node;
* a longer ring sits on the fewest nodes, ``ceil(D / ranks_per_node)``: whole nodes plus the
  remainder on one more node where the free ranks allow it.

Only where the ranks a scheduler may use cannot hold the ring on that few nodes (a node map
with small nodes, a PP count group spread over nodes) does it take the fewest nodes they allow.
Members always come back in node-contiguous order (one network link per node boundary of the
ring cycle).

:class:`RingPlacer` does this for the list schedulers (balance), where ranks have loads: the
*compact* choice (the D least-loaded ranks of the node where they are free first; for a longer
ring the whole nodes free first plus the least-loaded ranks of one more node), else the earliest
start on the fewest nodes (exact, bisection on the start time). :class:`FreeRanks` does it
for the time-step fill (naive, Alg. 1), where ranks are free or not.

Rings that fit a node used to fall back to the load-only choice when the compact one started
more than 1 % of the step's lower bound later. With offload off (small rings of 2-7 ranks for
every sequence of 8K-56K tokens, compute-bound, so a node-crossing ring cost the same in the
estimate) that escape fired for one ring in six. Holding the rule always costs at most 0.8 %
of the estimated step on the standard batches (docs/benchmarks.md, "topology").

Costs: one ``numpy`` sort of the ``nodes x ranks_per_node`` load matrix per ring that the
load-only choice would not already put on its fewest nodes (about 40 us at 16,384 ranks).
PP-Balance, which asks for several count groups per ring, gives each group as its ranks sorted
by load (:meth:`RingPlacer.fewest_nodes_ranked`): a walk from the least-loaded rank that stops
where the answer is known, the same choices without a masked view per ask.
Deterministic: ties go to the lower node id, then the lower rank.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from ..topology import Topology

class RingPlacer:
    """Rank loads viewed node by node, for choosing ring members.

    ``loads`` is the scheduler's load array: it sets loads through :meth:`set_loads` (or writes
    ``loads`` and calls :meth:`touch`) so the placer can keep every node's loads sorted and
    re-sort only the nodes that changed since the last ring.
    """

    def __init__(self, topology: Topology, hdp_size: int) -> None:
        self.topology = topology
        self.n = hdp_size
        nodes = topology.nodes(hdp_size)
        # one extra slot holds +inf: the padding of short nodes points at it
        self._ext = np.zeros(hdp_size + 1)
        self._ext[hdp_size] = np.inf
        self.loads = self._ext[:hdp_size]
        labels, row_of_rank, counts = np.unique(nodes, return_inverse=True, return_counts=True)
        self.width = int(counts.max()) if len(counts) else 1
        order = np.lexsort((np.arange(hdp_size), nodes))  # by node, then rank
        idx = np.full((len(labels), self.width), hdp_size, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        for k, (a, c) in enumerate(zip(starts.tolist(), counts.tolist())):
            idx[k, :c] = order[a:a + c]
        self._idx = idx
        #: each rank's node as a row index (0 .. nodes - 1), a list: callers that count the
        #: nodes a set of ranks spans read it directly (one lookup per rank, no sort)
        self.row_of: list[int] = row_of_rank.reshape(-1).tolist()
        self._sizes = counts.astype(np.int64)
        # per node: positions (into the node's row) by load then rank, and the sorted loads
        self._order = np.tile(np.arange(self.width), (len(labels), 1))
        self._sorted = self._ext[idx]
        self._dirty: set[int] = set()
        # rank r on node r // width, every node full: the loads reshape into the node matrix
        self._regular = topology.node_of is None and hdp_size % self.width == 0 and self.width == topology.ranks_per_node
        # for the choices from a sorted rank list (:meth:`fewest_nodes_ranked`): each node's
        # ranks, and whether node rows grow with the rank (then, among ranks of equal load, a
        # lower rank is on a lower or the same node)
        self._row_sizes = counts.tolist()
        self._row_ranks = [idx[k, :c].tolist() for k, c in enumerate(self._row_sizes)]
        self._monotone = bool(np.all(np.diff(nodes) >= 0))

    # ------------------------------------------------------------------ loads
    def set_loads(self, ranks: Sequence[int], value: float) -> None:
        """``loads[r] = value`` for every rank in ``ranks``."""
        self.loads[list(ranks)] = value
        self.touch(ranks)

    def set_load(self, rank: int, value: float) -> None:
        """``loads[rank] = value`` (one rank: the hot path of list scheduling)."""
        self.loads[rank] = value
        self._dirty.add(self.row_of[rank])

    def touch(self, ranks: Sequence[int]) -> None:
        """Note that the loads of ``ranks`` changed."""
        row_of = self.row_of
        for r in ranks:
            self._dirty.add(row_of[r])

    def _sorted_view(self) -> tuple[np.ndarray, np.ndarray]:
        if self._dirty:
            rows = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
            self._dirty.clear()
            m = self._ext[self._idx[rows]]
            order = np.argsort(m, axis=1, kind="stable")  # by load, then rank (rows hold ranks ascending)
            self._order[rows] = order
            self._sorted[rows] = m[np.arange(len(rows))[:, None], order]
        return self._sorted, self._order

    def _view(self, eligible: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Every node's loads sorted (ineligible ranks as +inf) and the positions that sort them."""
        if eligible is None:
            return self._sorted_view()
        return self._masked(eligible)[1:]

    def _masked(self, eligible: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ok = np.append(eligible, False)[self._idx]
        m = np.where(ok, self._ext[self._idx], np.inf)
        order = np.argsort(m, axis=1, kind="stable")
        return m, np.sort(m, axis=1), order  # the same values as m gathered by order, cheaper

    def spans_min_nodes(self, ring: Sequence[int]) -> bool:
        """Whether ``ring`` already sits on the fewest nodes its size allows."""
        return self.topology.ring_nodes(ring) <= self.topology.min_nodes(len(ring))

    # ------------------------------------------------------------------ choices
    def compact(self, d: int, eligible: np.ndarray | None = None) -> tuple[float, tuple[int, ...]] | None:
        """``(start, members)`` of a ring of ``d`` on the fewest nodes (see the module docstring);
        None if no such choice exists (not enough eligible ranks)."""
        if d <= self.width and eligible is None:
            return self._compact_in_node(d)
        return self._compact_sorted(d, eligible)

    def _compact_sorted(self, d: int, eligible: np.ndarray | None = None, *,
                        view: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, tuple[int, ...]] | None:
        """:meth:`compact` from the sorted view of every node's loads (the reference that
        :meth:`_compact_in_node` matches for rings that fit a node); ``view`` is
        :meth:`_view` of ``eligible`` when the caller has it already."""
        g = self.width
        srt, order = self._view(eligible) if view is None else view
        if d <= g:
            col = srt[:, d - 1]
            k = int(np.argmin(col))
            if not math.isfinite(col[k]):
                return None
            return self._result(self._idx[k, order[k, :d]])
        whole, rest = divmod(d, g)
        full = srt[np.arange(len(srt)), self._sizes - 1]
        full = np.where(self._sizes == g, full, np.inf)  # whole nodes of the full width only
        picks = np.argsort(full, kind="stable")[:whole]
        if len(picks) < whole or not math.isfinite(full[picks[-1]]):
            return None
        members = [self._idx[k, :g] for k in picks.tolist()]
        if rest:
            col = srt[:, rest - 1].copy()
            col[picks] = np.inf
            k = int(np.argmin(col))
            if not math.isfinite(col[k]):
                return None
            members.append(self._idx[k, order[k, :rest]])
        return self._result(np.concatenate(members))

    def _compact_in_node(self, d: int) -> tuple[float, tuple[int, ...]] | None:
        """:meth:`compact` for a ring that fits a node, all ranks eligible, without the sorted
        view: each node's d-th smallest load by ``np.partition`` (the value the sorted view holds
        in column d - 1), the first node where it is lowest, then that node's d least-loaded
        ranks (ties to the lower rank, as the stable sort orders them). DP-Balance places a ring
        per long unit; re-sorting every node that singles touched since the last ring cost more
        than the rest of its placement."""
        g = self.width
        m = self.loads.reshape(-1, g) if self._regular else self._ext[self._idx]
        col = m.min(axis=1) if d == 1 else np.partition(m, d - 1, axis=1)[:, d - 1]
        k = int(col.argmin())
        start = float(col[k])
        if not math.isfinite(start):
            return None
        picked = np.argsort(m[k], kind="stable")[:d]
        if self._regular:  # rank = node * g + position; the ring starts at the d-th smallest load
            return start, tuple(sorted((picked + k * g).tolist()))
        return self._result(self._idx[k, picked])

    def on_nodes(self, d: int, num_nodes: int, eligible: np.ndarray | None = None, *,
                 view: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, tuple[int, ...]] | None:
        """``(start, members)``: the earliest start of a ring of ``d`` on at most ``num_nodes``
        nodes (exact: the first candidate start time that fits), or None; ``view`` as in
        :meth:`_compact_sorted`."""
        srt, order = self._view(eligible) if view is None else view
        cand = np.unique(srt[:, : min(d, self.width)])
        cand = cand[np.isfinite(cand)]
        k_nodes = min(num_nodes, len(srt))
        if not len(cand):
            return None
        # A start s fits when the k_nodes nodes with the most ranks free by s hold d. Node rows
        # are sorted, so "at least v ranks free by s" is column v - 1 <= s, and the k fullest
        # nodes hold sum over v of min(k, nodes with at least v free): every candidate at once
        # (the same answer as a bisection with the per-node counts; the total grows with s).
        columns = np.sort(srt, axis=0)
        held = np.zeros(len(cand), dtype=np.int64)
        for v in range(srt.shape[1]):
            held += np.minimum(np.searchsorted(columns[:, v], cand, side="right"), k_nodes)
        fits = held >= d
        if not fits[-1]:
            return None
        lo = int(np.argmax(fits))
        counts = (srt <= float(cand[lo])).sum(axis=1)
        chosen, total = [], 0
        for k in np.argsort(-counts, kind="stable").tolist():  # fullest nodes first, then node id
            if total >= d:
                break
            take = min(int(counts[k]), d - total)
            chosen.append(self._idx[k, order[k, :take]])
            total += take
        return self._result(np.concatenate(chosen))

    def fewest_nodes(self, d: int, eligible: np.ndarray | None = None, *,
                     earliest: float = -math.inf) -> tuple[float, tuple[int, ...]] | None:
        """``(start, members)`` of a ring of ``d`` on the fewest nodes the (eligible) ranks allow:
        :meth:`compact`, or for a ring longer than a node the earliest start on that many nodes
        (:meth:`on_nodes`) when it is earlier; without a compact choice, the earliest start on
        the fewest nodes possible. None only if fewer than ``d`` ranks are eligible.

        ``earliest`` is a start no choice can beat (the load-only one: the d-th smallest eligible
        load); a compact choice that meets it skips the search."""
        # one sorted view for the compact choice and the search on nodes (a ring that fits a
        # node, all ranks eligible, needs none: :meth:`_compact_in_node`)
        view = None if d <= self.width and eligible is None else self._view(eligible)
        choice = self.compact(d, eligible) if view is None else self._compact_sorted(d, eligible, view=view)
        if choice is not None:
            if d > self.width and choice[0] > earliest:
                other = self.on_nodes(d, self.topology.min_nodes(d), eligible, view=view)
                if other is not None and other[0] < choice[0]:
                    return other
            return choice
        sizes = self._sizes if eligible is None else np.append(eligible, False)[self._idx].sum(axis=1)
        reach = np.cumsum(np.sort(sizes)[::-1])
        if not len(reach) or reach[-1] < d:
            return None
        return self.on_nodes(d, int(np.searchsorted(reach, d)) + 1, eligible, view=view)

    # ------------------------------------------------------------------ from a sorted rank list
    def fewest_nodes_ranked(self, d: int, ranked: Sequence[tuple[float, int]], *,
                            earliest: float = -math.inf) -> tuple[float, tuple[int, ...]] | None:
        """:meth:`fewest_nodes` with the eligible ranks given as ``(load, rank)`` pairs, sorted,
        each load the rank's current one: the same choice, without a masked view of every node.

        PP-Balance keeps each count group's ranks in such a list (it moves only ring members,
        one group up) and asks this for a group several times per ring. Rebuilding and sorting
        the masked ``nodes x ranks_per_node`` view per ask was most of its placement time; the
        choices here walk the list from its least-loaded rank and stop where the answer is
        known, which is near the front for the groups that can win."""
        choice = self._compact_ranked(d, ranked)
        if choice is not None:
            if d > self.width and choice[0] > earliest:
                other = self._on_nodes_ranked(d, self.topology.min_nodes(d), ranked)
                if other is not None and other[0] < choice[0]:
                    return other
            return choice
        per_node: dict[int, int] = {}
        row_of = self.row_of
        for _, r in ranked:
            k = row_of[r]
            per_node[k] = per_node.get(k, 0) + 1
        total = 0
        for num_nodes, held in enumerate(sorted(per_node.values(), reverse=True), start=1):
            total += held
            if total >= d:  # the fewest nodes (fullest first) that hold the ring
                return self._on_nodes_ranked(d, num_nodes, ranked)
        return None

    def _first_node_ranked(self, d: int, ranked: Sequence[tuple[float, int]],
                           skip: set[int] | frozenset[int] = frozenset()) -> tuple[float, int, list[int]] | None:
        """``(d-th smallest load, row, its d ranks)`` of the node (row) whose d-th smallest
        listed load is least, ties to the lower row, rows in ``skip`` left out; None if no node
        lists d ranks. Column ``d - 1`` of the masked sorted view, by walking ``ranked``."""
        row_of, monotone = self.row_of, self._monotone
        seen: dict[int, list[int]] = {}
        best: tuple[float, int, list[int]] | None = None
        for load, r in ranked:
            if best is not None and load > best[0]:
                break  # every later node reaches d at a larger load
            k = row_of[r]
            if k in skip:
                continue
            got = seen.get(k)
            if got is None:
                seen[k] = got = []
            got.append(r)
            if len(got) == d and (best is None or k < best[1]):
                best = (load, k, got[:])
                if monotone:
                    break  # among equal loads the list runs by rank, so by row: no lower row follows
        return best

    def _compact_ranked(self, d: int, ranked: Sequence[tuple[float, int]]) -> tuple[float, tuple[int, ...]] | None:
        """:meth:`_compact_sorted` of the listed ranks (see :meth:`fewest_nodes_ranked`)."""
        g = self.width
        if d <= g:
            first = self._first_node_ranked(d, ranked)
            return None if first is None else (first[0], self.topology.node_contiguous(first[2]))
        whole, rest = divmod(d, g)
        row_of, monotone = self.row_of, self._monotone
        seen: dict[int, int] = {}
        # (largest load, row) of the nodes whose every rank is listed, of full width: a node holds
        # at most g ranks, so only a node of g ranks, all listed, counts g
        done: list[tuple[float, int]] = []
        limit = math.inf
        for load, r in ranked:
            if load > limit:
                break  # every later node completes at a larger load
            k = row_of[r]
            c = seen.get(k, 0) + 1
            seen[k] = c
            if c == g:
                done.append((load, k))
                if len(done) == whole:
                    if monotone:
                        break  # equal loads complete in row order: the first ones are the least
                    limit = load  # others completing at this load may be lower rows
        if len(done) < whole:
            return None
        done.sort()  # (load, row): the order of the stable sort of the nodes' largest loads
        picks = done[:whole]
        members = [r for _, k in picks for r in self._row_ranks[k]]
        start = picks[-1][0]
        if rest:
            first = self._first_node_ranked(rest, ranked, {k for _, k in picks})
            if first is None:
                return None
            members += first[2]
            start = max(start, first[0])
        return start, self.topology.node_contiguous(members)

    def _on_nodes_ranked(self, d: int, num_nodes: int,
                         ranked: Sequence[tuple[float, int]]) -> tuple[float, tuple[int, ...]] | None:
        """:meth:`on_nodes` of the listed ranks (see :meth:`fewest_nodes_ranked`): add the ranks
        one load at a time until the ``num_nodes`` fullest nodes hold ``d``.

        ``held`` is what :meth:`on_nodes` sums, kept as ranks come: ``at_least[v]`` nodes have
        ``v`` or more ranks free by the current load, and the fullest ``k`` nodes hold the sum
        over v of ``min(at_least[v], k)``, so a node's v-th rank adds one while fewer than k
        nodes had v. :meth:`on_nodes` tries only loads in the first ``min(d, width)`` columns;
        trying every load finds the same first fit: a load further right is a node's (d+1)-th
        rank or later, and once a node holds d ranks the sum is already at least d."""
        k_nodes = min(num_nodes, len(self._row_sizes))
        row_of = self.row_of
        taken: dict[int, list[tuple[float, int]]] = {}  # row -> its listed ranks so far, in order
        at_least = [0] * (self.width + 1)
        held, i, n = 0, 0, len(ranked)
        while i < n:
            s = ranked[i][0]
            while i < n and ranked[i][0] == s:  # every rank free by s
                k = row_of[ranked[i][1]]
                got = taken.get(k)
                if got is None:
                    taken[k] = got = []
                got.append(ranked[i])
                v = len(got)
                if at_least[v] < k_nodes:
                    held += 1
                at_least[v] += 1
                i += 1
            if held >= d:
                break
        else:
            return None
        chosen: list[tuple[float, int]] = []
        for k in sorted(taken, key=lambda k: (-len(taken[k]), k)):  # fullest nodes first, then node id
            if len(chosen) >= d:
                break
            chosen += taken[k][:d - len(chosen)]
        return max(load for load, _ in chosen), self.topology.node_contiguous([r for _, r in chosen])

    def _result(self, members: np.ndarray) -> tuple[float, tuple[int, ...]]:
        """``(start, ring)``: the ring starts when its last member is free."""
        return float(self.loads[members].max()), self.topology.node_contiguous(members.tolist())


class FreeRanks:
    """Free ranks of one time step, grouped by node (ranks ascending in each), for the
    time-step fill: :meth:`take` removes and returns a ring's members.

    Nodes are also kept in buckets by their number of free ranks (node ids ascending in each),
    so a choice costs O(ranks_per_node) bucket looks instead of a scan of every node."""

    def __init__(self, free: Sequence[int], topology: Topology) -> None:
        self.topology = topology
        self.by_node: dict[int, list[int]] = {}
        by_node = self.by_node
        if topology.node_of is None:  # Topology.node without a call per rank
            g = topology.ranks_per_node
            for r in map(int, free):
                by_node.setdefault(r // g, []).append(r)
        else:
            node_of = topology.node_of
            for r in map(int, free):
                by_node.setdefault(node_of[r], []).append(r)
        self.count = len(free)
        self._g = topology.ranks_per_node
        self._buckets: list[list[int]] = [[] for _ in range(self._g + 1)]
        for k in sorted(self.by_node):
            self._buckets[len(self.by_node[k])].append(k)

    def take(self, d: int, *, fallback: bool) -> list[int] | None:
        """``d`` free ranks on the fewest nodes, node-contiguous, or None.

        A ring that fits a node takes the lowest free ranks of the node with the fewest free
        ranks that still hold it (best fit keeps whole nodes for longer rings; ties to the lower
        node id); a longer ring takes whole free nodes (lowest ids) and the remainder best fit on
        one more node. If the free ranks cannot hold the ring on ``ceil(d / ranks_per_node)``
        nodes: None, or with ``fallback`` the fewest nodes they allow (fullest nodes first, then
        lower ids). None if fewer than ``d`` ranks are free.
        """
        if d > self.count:
            return None
        by_node, buckets, g = self.by_node, self._buckets, self._g
        whole, rest = divmod(d, g) if d > g else (0, d)
        plan: list[tuple[int, int]] | None = None  # (node, ranks taken from it)
        if len(buckets[g]) >= whole:
            plan = [(k, g) for k in buckets[g][:whole]]
            if rest:
                fit = next((k for c in range(rest, g + 1)
                            for k in (buckets[c][whole:] if c == g else buckets[c])), None)
                plan = None if fit is None else plan + [(fit, rest)]
        if plan is None:
            plan, left = [], d
            for c in range(g, 0, -1):  # fullest nodes first
                for k in buckets[c]:
                    if left <= 0:
                        break
                    plan.append((k, min(c, left)))
                    left -= c
            if len(plan) > self.topology.min_nodes(d) and not fallback:
                return None
        chosen: list[int] = []
        for k, m in plan:
            ranks = by_node[k]
            chosen += ranks[:m]
            self._move(k, len(ranks), len(ranks) - m)
            if m == len(ranks):
                del by_node[k]
            else:
                by_node[k] = ranks[m:]
        self.count -= d
        return list(self.topology.node_contiguous(chosen))

    def _move(self, node: int, old: int, new: int) -> None:
        bucket = self._buckets[old]
        del bucket[bisect.bisect_left(bucket, node)]
        if new:
            bisect.insort(self._buckets[new], node)

    def remaining(self) -> list[int]:
        """The ranks still free, ascending."""
        return sorted(r for ranks in self.by_node.values() for r in ranks)
