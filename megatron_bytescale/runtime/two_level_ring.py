"""Two-level ring attention: a head-split all-to-all inside each node, a ring between nodes.

A flat ring of D members on k nodes crosses the network at k links, and at every one of its
D - 1 steps the member at a node boundary sends a whole block over its one NIC: the ring moves
the sequence's entire K/V (and dK/dV) through single NICs, a floor of
``(2 kv + dkv) * s / B_network`` per layer whatever D is (docs/two_level_ring.md). The
two-level ring uses every NIC of every node instead:

1. **All-to-all inside the node** (NVLink). The G members of node m hold zigzag parts
   ``mG + j`` and ``2D - 1 - mG - j`` of every sequence (j = 0..G-1). Member j sends head
   group j' of its q, k, v to member j' and receives head group j of everybody's rows. Member j
   then holds, for its H / G heads, the node's rows in *node zigzag* order: node part m (the G
   front parts, ascending) and node part 2k - 1 - m (the G back parts, ascending), which is
   exactly the zigzag layout of a ring of k positions with chunk ``G * chunk``.
2. **Ring between nodes**. Member j of every node forms a ring of k members (the *column*
   ring: ``members[j], members[G + j], ...``) and runs the ordinary ring attention
   (:mod:`.ring_attention`) on its heads over the node layout: k - 1 steps, every link between
   nodes, every member's own NIC busy, one block of ``kv * T`` bytes per step (T = the member's
   buffer rows), as in the flat ring, but k - 1 steps instead of D - 1.
3. **All-to-all back** of the output (and, backward, of dout in / dq, dk, dv out).

Per member and layer: intra-node ``2 (G - 1) / G * T * (2 q + kv)`` bytes (q, k, v, out forward;
dout, dq, dk, dv backward), inter-node ``(k - 1) * T * (2 kv + dkv)``; memory as the flat ring
(the member holds T rows of H / G heads of G members = T rows of all heads). Needs the ring in
the planner's node-contiguous, whole-node form (:meth:`~..planner.topology.Topology.two_level_group`)
and the k/v heads divisible by G; otherwise it runs the flat ring. Results equal the flat ring's
(the same softmax over the same keys, merged in another order): tests compare both with a
single-process reference.
"""

from __future__ import annotations

import math

import torch

from ..planner.topology import Topology
from .counters import CommCounters, MicroBatchCommStats, timed
from .backends.base import host_to_device
from .hdp_group import HDPGroup, Ring
from .layout import AttentionLayout, SequenceSlot
from .ring_attention import ring_attention, ring_attention_backward, ring_attention_forward
from .ring_comm import RingComm

_TAG_A2A = 4  # the node all-to-all (ring traffic uses tags 1-3)


def two_level_plan(layout: AttentionLayout, topology: Topology, num_kv_heads: int) -> int:
    """G (members per node) if ``layout``'s ring runs two-level, else 1 (flat)."""
    if layout.ring.size <= 1:
        return 1
    g = topology.two_level_group(layout.ring.members)
    return g if g > 1 and num_kv_heads % g == 0 else 1


def node_layout(layout: AttentionLayout, group: int) -> tuple[AttentionLayout, torch.Tensor]:
    """The column ring's layout for this member, and where its rows come from.

    Returns ``(node_layout, rows)``: row i of the node buffer is row ``rows[i]`` of the
    gathered buffer ``[G * T]`` (node member j' first: its T rows at ``j' * T``). Built once
    per micro-batch (every layer reuses it).
    """
    return layout.memo(("two-level", group), lambda: _build_node_layout(layout, group))


def node_indices(layout: AttentionLayout, group: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of :func:`node_layout` and its inverse permutation, on ``device``.

    Built on the host once per micro-batch and copied from pinned memory without blocking
    (one copy per micro-batch, not six per layer): the host never waits for the GPU (D12).
    """
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        _, rows = node_layout(layout, group)
        back = torch.empty_like(rows)
        back[rows] = torch.arange(len(rows))
        both = host_to_device(torch.stack([rows, back]), device)
        return both[0], both[1]

    return layout.memo(("two-level-indices", group, str(torch.device(device))), build)


def _build_node_layout(layout: AttentionLayout, group: int) -> tuple[AttentionLayout, torch.Tensor]:
    ring, g = layout.ring, group
    d, k = ring.size, ring.size // group
    node, j = divmod(ring.position, g)
    column = Ring(tuple(ring.members[m * g + j] for m in range(k)), node)
    t = layout.num_tokens
    slots, rows, offset = [], [], 0
    for slot in layout.slots:
        o, first, real = slot.offset, slot.first_by_position, slot.real_by_position
        # the sequence's 2D parts (sizes from what every position holds), then the node's 2k:
        # node part P is parts P*G .. P*G + G - 1
        sizes = list(first) + [real[p] - first[p] for p in reversed(range(d))]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        node_parts = [(bounds[q * g], bounds[(q + 1) * g]) for q in range(2 * k)]
        node_first = tuple(node_parts[m][1] - node_parts[m][0] for m in range(k))
        node_real = tuple(node_first[m] + node_parts[2 * k - 1 - m][1] - node_parts[2 * k - 1 - m][0]
                          for m in range(k))
        slots.append(SequenceSlot(
            seq=slot.seq, length=slot.length, chunk=g * slot.chunk, offset=offset, num_local=g * slot.num_local,
            parts=(node_parts[node], node_parts[2 * k - 1 - node]), num_real=node_real[node],
            real_by_position=node_real, first_by_position=node_first,
        ))
        # a member's slot holds its first part's real rows, its second part's, then padding;
        # the node's: the G first parts (members in order), the G second parts (reversed), padding
        members = [(src, node * g + src) for src in range(g)]
        front = [torch.arange(src * t + o, src * t + o + first[p]) for src, p in members]
        back = [torch.arange(src * t + o + first[p], src * t + o + real[p]) for src, p in reversed(members)]
        pad = [torch.arange(src * t + o + real[p], src * t + o + slot.num_local) for src, p in members]
        rows += front + back + pad
        offset += g * slot.num_local
    return AttentionLayout(ring=column, slots=tuple(slots), num_tokens=offset), torch.cat(rows)


# ---------------------------------------------------------------------- the node all-to-all
def _node_exchange(chunks: list[list[torch.Tensor]], node: tuple[int, ...], me: int, hdp: HDPGroup,
                   ring: Ring, record: MicroBatchCommStats | None) -> list[list[torch.Tensor]]:
    """Send ``chunks[j]`` (a list of tensors) to node member j, return what each j sent back.

    One batched P2P call: every peer's tensors travel flattened in one message."""
    out: list[list[torch.Tensor]] = [[] for _ in node]
    comm = RingComm(hdp, ring, counters=record, tag=_TAG_A2A)
    incoming = {}
    for j, peer in enumerate(node):
        if peer == me:
            out[j] = chunks[j]
            continue
        flat = torch.cat([x.reshape(-1) for x in chunks[j]])
        incoming[j] = comm.recv(torch.empty_like(flat), peer)
        comm.send(flat, peer)
    if incoming:
        comm.commit()
        with timed(record, "wait_s"):
            comm.wait()
    for j, buf in incoming.items():
        parts, pos = [], 0
        for x in chunks[j]:  # same shapes both ways: a member sends what it gets back
            parts.append(buf[pos:pos + x.numel()].view(x.shape))
            pos += x.numel()
        out[j] = parts
    return out


def _heads_to_rows(tensors, g, node, me, hdp, ring, record):
    """``[T, h, H]`` each -> ``[G * T, h / G, H]``: my head group of every node member's rows."""
    chunks = [[x.unflatten(1, (g, -1))[:, j].contiguous() for x in tensors] for j in range(g)]
    got = _node_exchange(chunks, node, me, hdp, ring, record)
    return [torch.cat([got[j][i] for j in range(g)], dim=0) for i in range(len(tensors))]


def _rows_to_heads(tensors, g, node, me, hdp, ring, record):
    """``[G * T, h / G, H]`` each -> ``[T, h, H]``: inverse of :func:`_heads_to_rows`."""
    chunks = [[x.unflatten(0, (g, -1))[j].contiguous() for x in tensors] for j in range(g)]
    got = _node_exchange(chunks, node, me, hdp, ring, record)
    return [torch.stack([got[j][i] for j in range(g)], dim=1).flatten(1, 2) for i in range(len(tensors))]


# ---------------------------------------------------------------------- autograd
def _charge(record: MicroBatchCommStats | None, part: MicroBatchCommStats, *, inter: bool) -> None:
    if record is None:
        return
    record.add(part)
    if inter:
        record.inter_node_bytes_sent += part.bytes_sent
    else:
        record.intra_node_bytes_sent += part.bytes_sent


class _TwoLevelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, group, hdp, scale, backend, record, dkv_wire):  # noqa: D401
        ring = layout.ring
        g = group
        node_index = ring.position // g
        node = ring.members[node_index * g:(node_index + 1) * g]
        n_layout, _ = node_layout(layout, g)
        rows, back = node_indices(layout, g, q.device)
        intra, inter = MicroBatchCommStats(), MicroBatchCommStats()
        qn, kn, vn = (x.index_select(0, rows) for x in
                      _heads_to_rows([q, k, v], g, node, ring.rank, hdp, ring, intra))
        out_n, lse = ring_attention_forward(qn, kn, vn, n_layout, hdp, softmax_scale=scale, backend=backend,
                                            counters=inter)
        (out,) = _rows_to_heads([out_n.index_select(0, back)], g, node, ring.rank, hdp, ring, intra)
        _charge(record, intra, inter=False)
        _charge(record, inter, inter=True)
        ctx.save_for_backward(qn, kn, vn, out_n, lse, rows, back)
        ctx.args = (n_layout, g, node, hdp, scale, backend, record, ring, dkv_wire)
        return out

    @staticmethod
    def backward(ctx, dout):
        qn, kn, vn, out_n, lse, rows, back = ctx.saved_tensors
        n_layout, g, node, hdp, scale, backend, record, ring, dkv_wire = ctx.args
        intra, inter = MicroBatchCommStats(), MicroBatchCommStats()
        (dout_n,) = _heads_to_rows([dout.contiguous()], g, node, ring.rank, hdp, ring, intra)
        dout_n = dout_n.index_select(0, rows)
        dq, dk, dv = ring_attention_backward(dout_n, qn, kn, vn, out_n, lse, n_layout, hdp, softmax_scale=scale,
                                             backend=backend, counters=inter, dkv_wire=dkv_wire)
        dq, dk, dv = _rows_to_heads([x.index_select(0, back) for x in (dq, dk, dv)], g, node, ring.rank, hdp,
                                    ring, intra)
        _charge(record, intra, inter=False)
        _charge(record, inter, inter=True)
        return dq, dk, dv, None, None, None, None, None, None, None


def two_level_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    hdp: HDPGroup,
    *,
    topology: Topology,
    softmax_scale: float | None = None,
    backend: str | None = None,
    counters: CommCounters | MicroBatchCommStats | None = None,
    dkv_wire: str = "accumulator",
) -> torch.Tensor:
    """:func:`.ring_attention` for rings over several whole nodes, two-level (module docstring).

    Same arguments and result as :func:`.ring_attention` plus ``topology`` (the node of every
    HDP rank, as the planner saw it); ``dkv_wire`` applies to the ring between nodes. Rings that are not two-level (inside one node, not whole
    nodes, k/v heads not divisible by the members per node) run the flat ring. Counters get
    the bytes sent inside the node and between nodes (``intra_node_bytes_sent``,
    ``inter_node_bytes_sent``) besides the totals.
    """
    g = two_level_plan(layout, topology, k.shape[1])
    if g == 1:
        return ring_attention(q, k, v, layout, hdp, softmax_scale=softmax_scale, backend=backend,
                              counters=counters, dkv_wire=dkv_wire)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[0] != layout.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but the layout's local buffer has {layout.num_tokens}")
    hdp.check_ring(layout.ring)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    record = counters.current() if isinstance(counters, CommCounters) else counters
    return _TwoLevelAttention.apply(q, k, v, layout, g, hdp, scale, backend, record, dkv_wire)
