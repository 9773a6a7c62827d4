"""The log-sum-exp merge of partial attention, against numbers computed by hand and in float64."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_bytescale.runtime.online_softmax import merge_partial_attention


def _attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) @ values and log-sum-exp, in float64 (the reference)."""
    s = scores.double()
    return torch.softmax(s, dim=-1) @ values.double(), torch.logsumexp(s, dim=-1)


def test_two_blocks_by_hand():
    # one row, head dim 1. Block a: scores (0, ln 3) over values (1, 5): weights 1/4, 3/4 ->
    # out 4, lse ln 4. Block b: score ln 4 over value 2: out 2, lse ln 4. Union: weights
    # (1, 3, 4) / 8 -> out (1 + 15 + 8) / 8 = 3, lse ln 8.
    out = torch.zeros(1, 1, 1)
    lse = torch.full((1, 1), -math.inf)
    merge_partial_attention(out, lse, torch.tensor([[[4.0]]]), torch.tensor([[math.log(4)]]))
    assert out.item() == pytest.approx(4.0) and lse.item() == pytest.approx(math.log(4))
    merge_partial_attention(out, lse, torch.tensor([[[2.0]]]), torch.tensor([[math.log(4)]]))
    assert out.item() == pytest.approx(3.0, rel=1e-6) and lse.item() == pytest.approx(math.log(8), rel=1e-6)


def test_blocks_in_any_order_equal_the_softmax_over_their_union():
    g = torch.Generator().manual_seed(3)
    rows, heads, dim, keys = 5, 3, 4, 24
    scores = torch.randn(rows, heads, keys, generator=g) * 4  # peaked: lse terms differ a lot
    values = torch.randn(keys, dim, generator=g)
    ref_out, ref_lse = _attention(scores, values)
    cuts = [0, 7, 8, 19, 24]  # uneven blocks, one of a single key
    blocks = [(a, b) for a, b in zip(cuts, cuts[1:])]
    for order in (blocks, blocks[::-1], [blocks[2], blocks[0], blocks[3], blocks[1]]):
        out = torch.zeros(rows, heads, dim)
        lse = torch.full((rows, heads), -math.inf)
        for a, b in order:
            o, l = _attention(scores[..., a:b], values[a:b])
            merge_partial_attention(out, lse, o.float(), l.float())
        assert out.dtype == lse.dtype == torch.float32
        assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-6)
        assert torch.allclose(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_a_bf16_block_is_merged_into_the_fp32_accumulator():
    out = torch.zeros(2, 1, 2)
    lse = torch.full((2, 1), -math.inf)
    block = torch.tensor([[[1.0, -2.0]], [[0.5, 3.0]]], dtype=torch.bfloat16)
    merge_partial_attention(out, lse, block, torch.zeros(2, 1, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and torch.equal(out, block.float())
    # a second, equally weighted block halves both: out is their mean, lse grows by ln 2
    merge_partial_attention(out, lse, -block, torch.zeros(2, 1))
    assert torch.equal(out, torch.zeros(2, 1, 2)) and torch.allclose(lse, torch.full((2, 1), math.log(2)))
