"""The time of a ring micro-batch: the one formula the planner, the estimate and the simulator use.

Ring micro-batch cost (:meth:`.CostModel.micro_batch_time`). A micro-batch carries sequences of
real lengths ``s_j`` over a ring of D ranks with per-document zigzag; each sequence is padded to
``P_j = 2 * D * zigzag_chunk(s_j, D, align)`` (``P_j = s_j`` when D = 1) and every member holds
``P_j / D`` of it. Per layer and per member:

    linear  = beta1 * sum(P_j) / D + gamma + per_document * n * D     (n documents)
    A       = alpha1 * sum(P_j**2) / D                    (causal attention, balanced by zigzag)
    c_f     = A * phi_attn / D,  c_b = A * (1 - phi_attn) / D     (compute of one ring step)
    m_f     = latency + kv * sum(P_j) / D / bandwidth             (one KV block)
    m_b     = latency + (kv + dkv) * sum(P_j) / D / bandwidth     (KV + dKV blocks)
    wait    = (ring_straggler + ring_straggler_link_ratio * (m_f + m_b)) * sqrt(2 ln D)
    ring    = c_f + (D - 1) * max(c_f, m_f) + c_b + (D - 1) * max(c_b, m_b)
              + (D - 1) * (ring_step_overhead + wait)
    moe     = moe_dispatch_per_token * sum(P_j) / D + moe_dispatch      (MoE layers only)
    time    = layers * (linear + ring + moe + exposed_offload)

i.e. D compute steps per direction, of which D - 1 overlap one P2P exchange each; communication
costs time only where it exceeds the compute it hides behind. ``ring_step_overhead`` is what a
ring step costs beyond its kernels and transfer whatever the overlap: launches and
synchronisation on GPUs (0 in the analytic presets, as in the paper), and on CPU the copies
and thread switches that gloo makes on the same cores that compute (calibrated by
``integration.calibration``; without it a CPU planner sees rings as nearly free). ``per_document``
is the cost of one attention-kernel call per document per ring step (backends without varlen
kernels, the CPU path; calibrated with micro-batches of many short documents).

``moe`` is a MoE layer's token dispatch (:mod:`.moe_cost`): the all-to-alls over the expert-
parallel group and the dispatcher's TP collectives, linear in the member's own tokens (its
share of the ring), exposed (megatron-core does not overlap them with compute) and counted
as communication; 0 for dense models.

``wait`` is the time a lockstep ring waits for its slowest member in every step: the expected
maximum of D delays of standard deviation ``sigma`` is ``sigma * sqrt(2 ln D)``. Two forms of
``sigma``: ``ring_straggler`` (``ring_straggler_s``) an absolute time, the same for every ring
whatever it sends, and ``ring_straggler_link_ratio`` a multiple of the step's own link time
``m_f + m_b``, i.e. a delay that grows with the bytes a member sends per step and with the
slowness of its link (a congested network, a NIC busy with other rings' traffic). The second is
what the paper's measurements need (docs/reproduction.md section 2): the first, fitted to the
case study at TP 1, swamps models whose TP 8 makes every ring step 8x smaller. Both are 0 on
datasheet presets. With D = 1 and one document the time is exactly
``layers * (T(s) + per_document + moe)`` summed over the pack (gamma once per micro-batch).
``bandwidth`` is the intra-node rate when all members share a node, else the inter-node rate
(a ring is as slow as its slowest hop); a ring inside a node therefore waits
``bandwidth_inter / bandwidth_intra`` times less with the link-time form.

Two-level rings (``two_level_ring``, docs/two_level_ring.md): a ring of D = k * G members on k
whole nodes runs k steps between nodes (same formula with D -> k for the step count and the
per-step compute ``attention / k``, the network rate) plus all-to-alls inside the node that
move ``2 (G - 1) / G * share * (2 q + kv)`` bytes per layer over NVLink, charged as exposed.

P2P bytes of a ring micro-batch (:meth:`.CostModel.ring_p2p_bytes`), summed over all members,
for ``layers`` layers of one TP rank:

    bytes = layers * (D - 1) * (2 * kv + dkv) * sum_j P_j

with ``kv = kv_bytes_per_token`` and ``dkv = dkv_bytes_per_token`` (forward: D - 1 KV rotations
of each member's block ``kv * sum(P_j) / D`` by D members; backward: D - 1 rotations of KV and
D - 1 hops of the travelling dK/dV accumulator, which ring attention keeps in fp32, so dkv is
twice kv for bf16 K/V). Per member it is that divided by D. A ring of size 1 sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .cost_model import CostModel


@dataclass(frozen=True)
class RingTimeTerms:
    """Per-member seconds of micro-batches by what they are spent on (numpy arrays or scalars).

    ``compute + exposed_comm + step_overhead + exposed_offload`` is the micro-batch's time
    (:meth:`.CostModel.ring_time_from_sums`); ``comm`` is the link time of its ring steps,
    hidden or not (the share of it that compute does not hide is ``exposed_comm``).
    """

    compute: Any
    """Linear layers and attention kernels: the time with free links."""
    exposed_comm: Any
    """P2P time a ring step's compute does not hide."""
    step_overhead: Any
    """``ring_step_overhead_s`` per ring step."""
    exposed_offload: Any
    """PCIe transfer time the layer's compute does not hide (0 for Eq. 3's ratios)."""
    comm: Any
    """All P2P time of the ring steps, overlapped or not."""

    @property
    def total(self) -> Any:
        return self.compute + self.exposed_comm + self.step_overhead + self.exposed_offload


def ring_time_terms(
    cm: "CostModel",
    sum_p: Any,
    sum_p2: Any,
    ring_size: Any,
    *,
    layers: int,
    offload_ratio: Any = 0.0,
    intra_node: Any = True,
    node_group: Any = 1,
    num_docs: Any = 1,
) -> RingTimeTerms:
    """Per-member seconds of micro-batches with ``sum(P_j)``, ``sum(P_j**2)`` on rings of
    ``ring_size`` (vectorised; the module docstring's formula), split by what they are spent on.

    ``node_group`` G > 1 (with ``cm.two_level_ring``) costs a two-level ring of D / G nodes of G
    members: an all-to-all inside each node before and after attention, moving ``(G - 1) / G``
    of every member's q, k, v, out forward and their gradients backward over NVLink, then a ring
    of D / G steps between nodes. ``num_docs``: documents per micro-batch. A two-level ring's
    all-to-alls and the straggler wait count as exposed communication (and in ``comm``: a
    profiler shows them as P2P time), the per-document cost as compute.
    """
    sp = np.asarray(sum_p, dtype=np.float64)
    sp2 = np.asarray(sum_p2, dtype=np.float64)
    d = np.asarray(ring_size, dtype=np.float64)
    r = np.asarray(offload_ratio, dtype=np.float64)
    g = np.asarray(node_group, dtype=np.float64) if cm.two_level_ring else np.ones_like(d)
    g = np.where(d > g, g, 1.0)  # a ring inside one node is flat
    two = g > 1
    bw = np.where(np.asarray(intra_node, dtype=bool) & ~two, cm.p2p_bandwidth_intra, cm.p2p_bandwidth_inter)
    share = sp / d
    linear = cm.beta1 * share + cm.gamma
    attn = cm.alpha1 * sp2 / d
    positions = d / g  # ring steps: D flat, D / G nodes two-level
    c_f = attn * cm.attention_forward_fraction / positions
    c_b = attn / positions - c_f
    m_f = cm.p2p_latency_s + cm.kv_bytes_per_token * share / bw
    m_b = cm.p2p_latency_s + (cm.kv_bytes_per_token + cm.dkv_bytes) * share / bw
    steps = positions - 1.0
    a2a_comm = np.where(two, 4 * cm.p2p_latency_s + 2 * (g - 1) / g * share * (
        2 * cm.q_bytes_per_token + cm.kv_bytes_per_token) / cm.p2p_bandwidth_intra, 0.0)
    exposed_comm = steps * (np.maximum(c_f, m_f) - c_f + np.maximum(c_b, m_b) - c_b) + a2a_comm
    if cm.ring_straggler_s or cm.ring_straggler_link_ratio:
        sigma = cm.ring_straggler_s + cm.ring_straggler_link_ratio * (m_f + m_b)
        wait = steps * sigma * np.sqrt(2.0 * np.log(np.maximum(positions, 1.0)))
        exposed_comm = exposed_comm + wait
        a2a_comm = a2a_comm + wait  # counted in ``comm`` below
    docs = cm.per_document_s * np.asarray(num_docs, dtype=np.float64) * d if cm.per_document_s else 0.0
    linear = linear + docs
    overhead = (steps + np.where(two, 2.0, 0.0)) * cm.ring_step_overhead_s
    if cm.moe_dispatch_s_per_token or cm.moe_dispatch_s:  # MoE token dispatch (.moe_cost): exposed
        moe = cm.moe_dispatch_s_per_token * share + cm.moe_dispatch_s
        exposed_comm = exposed_comm + moe
        a2a_comm = a2a_comm + moe  # counted in ``comm`` below
    layer = linear + attn + exposed_comm + overhead
    exposed_offload = np.maximum(0.0, r * (cm.alpha2 * share + cm.beta2) / cm.offload_bandwidth - layer)
    return RingTimeTerms(
        compute=layers * (linear + attn),
        exposed_comm=layers * exposed_comm,
        step_overhead=layers * overhead,
        exposed_offload=layers * exposed_offload,
        comm=layers * (steps * (m_f + m_b) + a2a_comm),
    )


def two_level_bytes(cm: "CostModel", sum_p: Any, ring_size: Any, node_group: Any, *, layers: int) -> tuple[Any, Any]:
    """``(intra-node, inter-node)`` bytes all members of two-level rings send over ``layers``
    layers: ``layers * sum(P) * 2 (G - 1) / G * (2 q + kv)`` in the all-to-alls and
    ``layers * (D / G - 1) * (2 kv + dkv) * sum(P)`` on the ring between nodes."""
    sp = np.asarray(sum_p, dtype=np.float64)
    d = np.asarray(ring_size, dtype=np.float64)
    g = np.asarray(node_group, dtype=np.float64)
    g = np.where(d > g, g, 1.0)
    intra = layers * sp * 2 * (g - 1) / g * (2 * cm.q_bytes_per_token + cm.kv_bytes_per_token)
    inter = layers * (d / g - 1) * cm.ring_bytes_per_token * sp
    return intra, inter
