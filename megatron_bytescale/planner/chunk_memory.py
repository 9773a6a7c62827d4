"""What a ring micro-batch split along the pipeline keeps on each member, in the capacity's units.

The capacity ``C`` of a plan counts tokens of resident activations per micro-batch:
``StepPlan.validate`` checks ``resident_tokens(num_tokens, offload_ratio, l) <= C``, one token
standing for ``Act`` bytes per layer over the stage's ``l`` layers (``CostModel.alpha2`` per
token per layer, per TP rank). A split ring (docs/pipeline.md, "cached" costing) keeps more:
every member holds the K/V block of every member for each earlier chunk, per layer of its stage,
until the group's backward is done, and accumulates the float32 dK/dV it owes their owners, up
to twice those bytes again. So one member keeps ``3 * kv_bytes_per_token`` bytes per layer for
each token of the kept prefix, which is ``3 * kv_bytes_per_token / alpha2`` token-equivalents
(the ``l`` layers cancel).

The rule here charges that whole cache (K/V of chunks ``0 .. k-2`` of all members, which is the
most it ever holds) to every chunk of the group, on top of the chunk's own tokens. It is
conservative: the cache is counted in every in-flight chunk's slot, so whatever chunks of the
group are in flight, the memory they claim covers it. Shares are counted padded to the zigzag's
``2 * align`` parts, as the runtime stores them.
"""

from __future__ import annotations

from .cost_model import CostModel
from .plan import StepPlan
from .zigzag import causal_chunks

KEPT_BYTES_FACTOR = 3.0
"""K/V kept in the activations' dtype (1) plus the float32 dK/dV owed (2, for 16-bit K/V)."""


def _padded_share(length: int, ring_size: int, align: int) -> int:
    """Tokens one member stores of a ``length``-token span zigzagged over ``ring_size`` members."""
    if length <= 0:
        return 0
    if ring_size == 1:
        return length
    part = -(-length // (2 * ring_size))
    part = -(-part // align) * align
    return 2 * part


def split_resident_tokens(lengths: list[int], ring_size: int, num_chunks: int, *, align: int,
                          cost_model: CostModel) -> float:
    """Token-equivalents one member of a ``ring_size`` ring keeps at most while any chunk of
    sequences ``lengths``, split into ``num_chunks`` causal chunks, is in flight: the largest
    chunk's own share plus the kept prefix cache (module docstring)."""
    if num_chunks < 2:
        raise ValueError(f"num_chunks ({num_chunks}) must be >= 2 for a split micro-batch")
    spans = [causal_chunks(int(n), num_chunks) for n in lengths]
    shares = [sum(_padded_share(s[i][1] - s[i][0], ring_size, align) for s in spans) for i in range(num_chunks)]
    own = max(shares)
    cached_tokens = ring_size * sum(shares[:-1])  # every member's block of chunks 0 .. k-2
    alpha2 = float(cost_model.alpha2)
    if alpha2 <= 0.0:
        raise ValueError(f"cost model {cost_model.name!r}: alpha2 ({alpha2}) must be > 0 to count a split's "
                         "kept K/V against the capacity")
    return own + cached_tokens * KEPT_BYTES_FACTOR * float(cost_model.kv_bytes_per_token) / alpha2


def split_fits(plan: StepPlan, order: int, num_chunks: int, cost_model: CostModel) -> bool:
    """Whether ring micro-batch ``order`` of ``plan`` (unsplit) fits the capacity split in
    ``num_chunks`` chunks, its kept prefix counted."""
    found = next((mb for rp in plan.ranks for mb in rp.micro_batches if mb.order == order), None)
    if found is None:
        raise ValueError(f"the plan has no micro-batch of order {order}")
    lengths = plan.sequence_lengths()
    need = split_resident_tokens([lengths[s] for s in found.seqs], found.ring_size, num_chunks,
                                 align=plan.align, cost_model=cost_model)
    return need <= plan.capacity + 1e-9


def check_split_memory(plan: StepPlan, cost_model: CostModel) -> None:
    """Raise ValueError if any split group of ``plan`` keeps more than the capacity (module rule)."""
    lengths = plan.sequence_lengths()
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            if mb.chunk is None or mb.chunk[0] != 0 or rp.rank != mb.ring[0]:
                continue
            group = [m for m in rp.micro_batches if m.chunk is not None and m.order - m.chunk[0] == mb.order]
            seqs = sorted({s for m in group for s in m.seqs})
            need = split_resident_tokens([lengths[s] for s in seqs], mb.ring_size, mb.chunk[1],
                                         align=plan.align, cost_model=cost_model)
            if need > plan.capacity + 1e-9:
                raise ValueError(f"split micro-batch at order {mb.order} ({mb.chunk[1]} chunks over ring "
                                 f"{list(mb.ring)}) keeps {need:.1f} token-equivalents with its prefix K/V, "
                                 f"over capacity {plan.capacity}")
