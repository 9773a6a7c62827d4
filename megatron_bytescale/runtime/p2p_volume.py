"""How many bytes ring attention moves: the formula the runtime's counters must match.

Per ``ring_attention`` call (one layer) on a ring of N > 1 members whose local buffer has T rows
(padding included: every member's buffer has the same T), every member sends - and receives -

    forward:   (N - 1) * [K + V]               = (N - 1) * 2 * T * N_kv * H * e
    backward:  (N - 1) * [K + V] + (N - 1) * [dK + dV]
                                               = (N - 1) * 2 * T * N_kv * H * (e + e_grad)

with ``e`` the element size of k/v and ``e_grad`` that of the travelling dK/dV accumulator
(float32, 4 bytes: gradients are accumulated across the ring in fp32). The backward re-rotates
K/V (N - 1 hops) and sends every partial dK/dV accumulator N - 1 hops: it starts at the
member after the owner and ends at the owner, which keeps its own contribution locally. A ring
of size 1 moves nothing. The total over the ring is N times the per-member number.
"""

from __future__ import annotations

from ..planner.plan import StepPlan
from ..planner.zigzag import padded_part_size, zigzag_chunk

GRAD_ACCUMULATOR_BYTES = 4  # dK/dV travel as float32


def ring_attention_p2p_bytes(
    *,
    num_tokens: int,
    ring_size: int,
    num_kv_heads: int,
    head_dim: int,
    element_size: int,
    grad_element_size: int = GRAD_ACCUMULATOR_BYTES,
    backward: bool = True,
) -> int:
    """Bytes ONE ring member sends (= receives) in one ring_attention call, fwd (+ bwd).

    Args:
        num_tokens: rows of the local buffer, padding included (``AttentionLayout.num_tokens``).
        ring_size: N.
        num_kv_heads, head_dim: k/v shape ``[T, N_kv, H]``.
        element_size: bytes per k/v element (2 for bf16, 4 for fp32).
        grad_element_size: bytes per element of the dK/dV accumulator.
        backward: include the backward pass.
    """
    if ring_size < 1 or num_tokens < 0:
        raise ValueError(f"ring_size ({ring_size}) must be >= 1 and num_tokens ({num_tokens}) >= 0")
    if ring_size == 1:
        return 0
    kv_elements = 2 * num_tokens * num_kv_heads * head_dim
    forward = (ring_size - 1) * kv_elements * element_size
    if not backward:
        return forward
    return forward + (ring_size - 1) * kv_elements * (element_size + grad_element_size)


def ring_local_tokens(lengths: list[int] | tuple[int, ...], ring_size: int, align: int = 1) -> int:
    """Rows of every member's local buffer for ``lengths`` on a ring of ``ring_size``."""
    if ring_size == 1:
        return sum(lengths)
    return sum(2 * zigzag_chunk(n, ring_size, align) for n in lengths)


def plan_p2p_bytes(
    plan: StepPlan,
    *,
    num_kv_heads: int,
    head_dim: int,
    element_size: int,
    num_layers: int = 1,
    grad_element_size: int = GRAD_ACCUMULATOR_BYTES,
    backward: bool = True,
) -> int:
    """Total bytes sent by all HDP ranks over one step of ``plan`` (``num_layers`` attention calls
    per micro-batch), to compare with the planner's estimate and with measured counters."""
    lengths = plan.sequence_lengths()
    splits = plan.zigzag_splits()
    total = 0
    for rank_plan in plan.ranks:
        for mb in rank_plan.micro_batches:
            if len(mb.ring) == 1:
                tokens = sum(lengths[s] for s in mb.seqs)
            else:  # every part padded to the plan's largest part of the sequence
                tokens = sum(2 * padded_part_size(splits[s], plan.align) for s in mb.seqs)
            total += ring_attention_p2p_bytes(
                num_tokens=tokens,
                ring_size=len(mb.ring),
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                element_size=element_size,
                grad_element_size=grad_element_size,
                backward=backward,
            )
    return total * num_layers


def two_level_p2p_bytes(
    *,
    num_tokens: int,
    ring_size: int,
    group: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    element_size: int,
    grad_element_size: int = GRAD_ACCUMULATOR_BYTES,
) -> tuple[int, int]:
    """``(intra-node, inter-node)`` bytes ONE member of a two-level ring sends in one call, fwd + bwd.

    Inside the node (:mod:`.two_level_ring`): ``(G - 1) / G`` of the member's T rows of q, k, v
    and out forward and of dout, dq, dk, dv backward, ``2 (G - 1) T (2 Nq + 2 Nkv) H e / G``.
    Between nodes: the flat formula on the column ring of ``ring_size / G`` members whose buffer
    holds ``G * T`` rows of ``Nkv / G`` heads.
    """
    if group < 2 or ring_size % group or num_kv_heads % group:
        raise ValueError(f"a two-level ring needs group ({group}) >= 2 dividing ring_size ({ring_size}) "
                         f"and num_kv_heads ({num_kv_heads})")
    intra = 2 * (group - 1) * num_tokens * (2 * num_q_heads + 2 * num_kv_heads) * head_dim * element_size // group
    inter = ring_attention_p2p_bytes(
        num_tokens=group * num_tokens, ring_size=ring_size // group, num_kv_heads=num_kv_heads // group,
        head_dim=head_dim, element_size=element_size, grad_element_size=grad_element_size,
    )
    return intra, inter
