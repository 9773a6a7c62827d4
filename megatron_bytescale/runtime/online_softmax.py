"""The one numerical helper of ring attention: merging partial softmax results.

Attention of a row over keys split into blocks B1, B2, ... can be computed block by block:
block j gives ``out_j = softmax(s_j) @ v_j`` and ``lse_j = log(sum(exp(s_j)))``. The attention
over the union is the lse-weighted average

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

which is exact (no approximation, only rounding) and associative, so the ring can merge the
blocks in whatever order they arrive. ``torch.logaddexp`` evaluates the first line stably;
the weights are then in [0, 1]. A running result starts at ``out = 0, lse = -inf``, which the
formula merges correctly (weight 0 for the empty part). Both sides being ``-inf`` (a row that
has seen no key yet merging a block where it sees none) would give NaN; callers never merge a
block whose rows see no key.
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
        out: running output ``[T, N, H]``, float32, updated in place.
        lse: running log-sum-exp ``[T, N]``, float32, updated in place.
        block_out: the block's output ``[T, N, H]`` (any float dtype).
        block_lse: the block's log-sum-exp ``[T, N]``.
    """
    new_lse = torch.logaddexp(lse, block_lse.float())
    old_weight = torch.exp(lse - new_lse).unsqueeze(-1)
    block_weight = torch.exp(block_lse - new_lse).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out.float() * block_weight)
    lse.copy_(new_lse)
