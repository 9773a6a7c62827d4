"""Where HDP ranks sit, and what a ring costs on the links between them.

Inside a node GPUs talk over NVLink (360 GB/s one way in the H100 preset); between nodes over
the network (40 GB/s), nine times slower. The planner therefore needs to know which node every
HDP rank is on:

* :class:`Topology` is that map: ``ranks_per_node`` consecutive HDP ranks per node (HDP rank r
  on node ``r // ranks_per_node``, the layout torchrun gives a TP = 1 job), or an explicit
  HDP rank -> node map (:meth:`Topology.from_node_map`) for anything else (TP > 1 strides the
  HDP group over nodes, heterogeneous nodes, a scheduler that shuffled hosts).
* :func:`ring_link_bytes` splits a ring micro-batch's P2P bytes into all bytes and the bytes
  that cross a node boundary. Ring attention moves the same block over every link of the
  ring cycle (``members[i] -> members[i + 1]``, wrapping around) at every step, K/V forward,
  K/V and the dK/dV accumulator backward (:mod:`.cost_model`), so a ring of D members whose
  cycle has ``h`` node-crossing links sends ``h / D`` of its bytes over the network. A ring
  of D ranks needs at least ``ceil(D / ranks_per_node)`` nodes and, ordered node-contiguously,
  crosses exactly one link per node it spans (none inside one node).
* :func:`ring_bandwidth` is the rate a ring step runs at: NVLink when all members share a
  node, else the network (a ring step is as slow as its slowest hop).

These are the one model of placement that the estimate, the balance scheduler and the
simulator share.
"""

from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np

from .cost_model import CostModel

MAX_NODE_ID = 2**31 - 1
"""Largest node id and ranks per node accepted (far beyond any cluster; keeps numpy int64 exact)."""


@dataclass(frozen=True)
class Topology:
    """The node of every HDP rank.

    ``ranks_per_node`` is the size of the largest node (a ring of at most that many ranks can
    sit on one node). Without ``node_of``, HDP rank r is on node ``r // ranks_per_node``; with
    it, on node ``node_of[r]`` (node ids are labels; only equality matters).
    """

    ranks_per_node: int
    node_of: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        g = self.ranks_per_node
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 1 <= int(g) <= MAX_NODE_ID:
            shown = f"{g!r}" if not isinstance(g, numbers.Integral) or abs(int(g)) < 10**12 else "an integer of over 12 digits"
            raise ValueError(f"ranks_per_node ({shown}) must be an integer >= 1 (at most "
                             f"{MAX_NODE_ID:,}; HDP ranks that share a node)")
        object.__setattr__(self, "ranks_per_node", int(g))
        if self.node_of is not None:
            nodes = tuple(self.node_of)
            for r, x in enumerate(nodes):
                if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= int(x) <= MAX_NODE_ID:
                    shown = f"{x!r}" if not isinstance(x, numbers.Integral) or abs(int(x)) < 10**12 else "an integer of over 12 digits"
                    raise ValueError(f"node map: HDP rank {r} is on node {shown}; node ids must be integers >= 0 "
                                     f"(at most {MAX_NODE_ID:,})")
            nodes = tuple(int(x) for x in nodes)
            if not nodes:
                raise ValueError("node map is empty; give the node of every HDP rank")
            largest = max(Counter(nodes).values())
            if largest != g:
                raise ValueError(
                    f"node map puts up to {largest} HDP ranks on one node but ranks_per_node is {g}; "
                    f"build it with Topology.from_node_map"
                )
            object.__setattr__(self, "node_of", nodes)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_node_map(cls, node_of: Sequence[int]) -> "Topology":
        """An explicit HDP rank -> node map (``ranks_per_node`` = the largest node's size);
        collapses to the regular form when the map is ``r // g``."""
        nodes = tuple(node_of)
        if not nodes:
            raise ValueError("node map is empty; give the node of every HDP rank")
        try:
            g = max(Counter(int(x) for x in nodes).values())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"node map must hold integer node ids, got {nodes[:8]!r}...: {exc}") from exc
        if all(not isinstance(x, bool) and isinstance(x, numbers.Integral) for x in nodes) and \
                all(int(x) == r // g for r, x in enumerate(nodes)):
            return cls(ranks_per_node=g)
        return cls(ranks_per_node=g, node_of=nodes)

    @classmethod
    def from_global_ranks(cls, global_ranks: Sequence[int], ranks_per_node: int) -> "Topology":
        """The topology of a process group whose HDP rank i is global rank ``global_ranks[i]``,
        on a job launched with ``ranks_per_node`` processes per node, numbered node by node
        (torchrun: global rank // LOCAL_WORLD_SIZE is the node). With TP > 1 the HDP group
        strides over the global ranks, so fewer HDP ranks share a node than processes do."""
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, numbers.Integral) or ranks_per_node < 1:
            raise ValueError(f"ranks per node ({ranks_per_node!r}) must be an integer >= 1")
        return cls.from_node_map([int(r) // int(ranks_per_node) for r in global_ranks])

    @classmethod
    def of(cls, cost_model: CostModel, topology: "Topology | None" = None) -> "Topology":
        """``topology`` if given, else the cost model's ``ranks_per_node`` consecutive ranks."""
        return topology if topology is not None else cls(ranks_per_node=cost_model.ranks_per_node)

    @classmethod
    def for_plan(cls, plan: Any, cost_model: CostModel, topology: "Topology | None" = None) -> "Topology":
        """The topology to cost ``plan`` under: ``topology``, else the one the plan was made for
        (``plan.meta["topology"]``), else the cost model's."""
        if topology is not None:
            return topology
        recorded = (getattr(plan, "meta", None) or {}).get("topology")
        if recorded:
            return cls.from_dict(recorded)
        return cls.of(cost_model)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks_per_node": self.ranks_per_node}
        if self.node_of is not None:
            out["node_of"] = list(self.node_of)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        if not isinstance(data, Mapping) or "ranks_per_node" not in data:
            raise ValueError(f"topology must be an object with ranks_per_node, got {data!r}")
        node_of = data.get("node_of")
        return cls(ranks_per_node=data["ranks_per_node"], node_of=None if node_of is None else tuple(node_of))

    # ------------------------------------------------------------------ queries
    def check_size(self, hdp_size: int) -> None:
        """Raise if an explicit node map does not cover exactly ``hdp_size`` ranks."""
        if self.node_of is not None and len(self.node_of) != hdp_size:
            raise ValueError(
                f"the node map covers {len(self.node_of)} HDP ranks but the plan has {hdp_size}; "
                f"give the node of every HDP rank"
            )

    def node(self, rank: int) -> int:
        """The node of HDP rank ``rank``."""
        return self.node_of[rank] if self.node_of is not None else rank // self.ranks_per_node

    def first(self, hdp_size: int) -> "Topology":
        """The topology of HDP ranks ``0 .. hdp_size - 1`` alone (the same nodes; with a node map,
        ``ranks_per_node`` is then the largest node among them), for a planner that places some
        units on those ranks only."""
        if self.node_of is None:
            return self
        if not 0 < hdp_size <= len(self.node_of):
            raise ValueError(f"{hdp_size} HDP ranks are not a prefix of the node map's {len(self.node_of)}")
        return Topology.from_node_map(self.node_of[:hdp_size])

    def nodes(self, hdp_size: int) -> np.ndarray:
        """Node of every HDP rank 0 .. hdp_size - 1 (int64)."""
        self.check_size(hdp_size)
        if self.node_of is not None:
            return np.asarray(self.node_of, dtype=np.int64)
        return np.arange(hdp_size, dtype=np.int64) // self.ranks_per_node

    def min_nodes(self, ring_size: int) -> int:
        """The fewest nodes a ring of ``ring_size`` ranks can sit on."""
        return max(1, -(-ring_size // self.ranks_per_node))  # integer ceil: exact, no float

    def ring_nodes(self, ring: Sequence[int]) -> int:
        """Distinct nodes ``ring`` spans."""
        if self.node_of is None:
            g = self.ranks_per_node
            return len({r // g for r in ring})
        return len({self.node(r) for r in ring})

    def ring_is_intra_node(self, ring: Sequence[int]) -> bool:
        """Whether every member of ``ring`` is on one node (its steps run at NVLink rate)."""
        if len(ring) <= 1:
            return True
        if self.node_of is None:  # nodes are rank // g: one node iff the extremes share it
            g = self.ranks_per_node
            if len(ring) > g:  # more members than a node has ranks (a ring's members differ)
                return False
            return min(ring) // g == max(ring) // g
        first = self.node(ring[0])
        return all(self.node(r) == first for r in ring)

    def inter_node_links(self, ring: Sequence[int]) -> int:
        """Links of the ring cycle (``ring[i] -> ring[i + 1]``, wrapping) that cross nodes."""
        d = len(ring)
        if d <= 1:
            return 0
        if self.node_of is None:
            g = self.ranks_per_node
            nodes = [r // g for r in ring]
        else:
            node_of = self.node_of
            nodes = [node_of[r] for r in ring]
        return sum(1 for a, b in zip(nodes, nodes[1:] + nodes[:1]) if a != b)

    def node_contiguous(self, members: Sequence[int]) -> tuple[int, ...]:
        """``members`` ordered node by node (nodes by id, ranks by id inside a node), so the
        ring crosses one network link per node boundary."""
        if self.node_of is None:  # node = rank // g grows with the rank
            return tuple(sorted(map(int, members)))
        return tuple(sorted((int(r) for r in members), key=lambda r: (self.node(r), r)))

    def two_level_group(self, ring: Sequence[int]) -> int:
        """G, the members per node of ``ring`` if it can run two-level, else 1.

        A two-level ring is k >= 2 runs of G >= 2 consecutive members, each run on one node
        and every run on a different node (what node-contiguous placement on whole nodes
        gives). Member ``m * G + j`` is then rank j of node m: an all-to-all inside each run,
        and G rings of k members (the j-th of every node) between nodes.
        """
        d = len(ring)
        nodes = [self.node(r) for r in ring]
        g = 1
        while g < d and nodes[g] == nodes[0]:
            g += 1
        if g < 2 or d % g or d // g < 2:
            return 1
        runs = [nodes[m * g:(m + 1) * g] for m in range(d // g)]
        if any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
            return 1
        return g

    @cached_property
    def is_regular(self) -> bool:
        """True when HDP rank r is on node r // ranks_per_node."""
        return self.node_of is None


# --------------------------------------------------------------------------- costs of a ring
def ring_link_bytes(
    cost_model: CostModel,
    topology: Topology,
    ring: Sequence[int],
    padded_tokens: float,
    *,
    layers: int,
) -> tuple[float, float]:
    """``(all bytes, inter-node bytes)`` a ring micro-batch sends over ``layers`` layers.

    ``padded_tokens`` is ``sum_j P_j`` of its sequences (zigzag-padded lengths, see
    :meth:`CostModel.padded_lengths`). A flat ring sends
    ``layers * (D - 1) * (2 kv + dkv) * sum_j P_j / D`` over every link of its cycle; the
    inter-node share is that times the node-crossing links (:meth:`Topology.inter_node_links`).
    A two-level ring (``cost_model.two_level_ring`` and :meth:`Topology.two_level_group` > 1)
    sends :meth:`CostModel.two_level_bytes`. 0 for D = 1.
    """
    d = len(ring)
    if d <= 1:
        return 0.0, 0.0
    if cost_model.two_level_ring:
        g = topology.two_level_group(ring)
        if g > 1:
            intra, inter = cost_model.two_level_bytes(float(padded_tokens), d, g, layers=layers)
            return float(intra + inter), float(inter)
    per_link = layers * (d - 1) * cost_model.ring_bytes_per_token * float(padded_tokens) / d
    return per_link * d, per_link * topology.inter_node_links(ring)


def ring_bandwidth(cost_model: CostModel, topology: Topology, ring: Sequence[int]) -> float:
    """Bytes/s of one ring step: NVLink if all members share a node, else the network."""
    return cost_model.p2p_bandwidth_intra if topology.ring_is_intra_node(ring) else cost_model.p2p_bandwidth_inter


def placement_summary(topology: Topology, rings: Sequence[Sequence[int]]) -> dict[str, int]:
    """How well ``rings`` (size > 1 each) sit on nodes; what the estimate reports.

    ``rings_fitting_one_node``: rings of at most ``ranks_per_node`` ranks;
    ``rings_within_one_node``: those of them on one node; ``rings_over_min_nodes``: rings on
    more nodes than their size needs; ``max_extra_nodes``: the most nodes beyond
    :meth:`Topology.min_nodes` of any ring.
    """
    fit = inside = over = extra = 0
    for ring in rings:
        if len(ring) <= 1:
            continue
        spans = topology.ring_nodes(ring)
        need = topology.min_nodes(len(ring))
        if len(ring) <= topology.ranks_per_node:
            fit += 1
            inside += spans == 1
        over += spans > need
        extra = max(extra, spans - need)
    return {"rings_fitting_one_node": fit, "rings_within_one_node": inside,
            "rings_over_min_nodes": over, "max_extra_nodes": extra}
