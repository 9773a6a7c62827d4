"""The one numerical helper of ring attention: merging partial softmax results.

Attention of a row over keys split into blocks B1, B2, ... can be computed block by block:
block j gives ``out_j = softmax(s_j) @ v_j`` and ``lse_j = log(sum(exp(s_j)))``. The attention
over the union is the lse-weighted average

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a + exp(lse_b - lse) * (out_b - out_a)        (since the two weights sum to 1)

which is exact (no approximation, only rounding) and associative, so the ring can merge the
blocks in whatever order they arrive. In place and in three passes over the running result:
``torch.logaddexp(..., out=lse)`` (stable), the block weight ``exp(lse_b - lse)``, and one
``lerp_`` of the output. A running result starts at ``out = 0, lse = -inf``, which the formula
merges correctly (weight 1 for the first block); the ring skips even that and copies its first
block. Both sides being ``-inf`` (a row that has seen no key yet merging a block where it sees
none) would give NaN; callers never merge a block whose rows see no key.
"""

from __future__ import annotations

import torch


def merge_partial_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """Merge one block's partial attention into the running result, in place.

    Args:
        out: running output ``[T, N, H]`` (float32 or float64), updated in place.
        lse: running log-sum-exp ``[T, N]``, same dtype as ``out``, updated in place.
        block_out: the block's output ``[T, N, H]`` (any float dtype).
        block_lse: the block's log-sum-exp ``[T, N]``.
    """
    block_lse = block_lse.to(lse.dtype)
    torch.logaddexp(lse, block_lse, out=lse)
    weight = torch.sub(block_lse, lse).exp_().unsqueeze(-1)
    out.lerp_(block_out.to(out.dtype), weight)
