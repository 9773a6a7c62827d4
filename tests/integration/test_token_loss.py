"""Token-level loss (DESIGN.md D6): the sum of masked per-token losses and their count, by hand."""

from __future__ import annotations

import torch

from megatron_bytescale.integration.schedule import token_level_loss


def test_sum_and_count_not_a_mean():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    loss_sum, num_tokens, report = token_level_loss(mask, losses)
    assert loss_sum.item() == 8.0  # 1 + 3 + 4: never divided (ranks train different counts)
    assert num_tokens.item() == 3 and not num_tokens.dtype.is_floating_point
    assert report["lm loss"].tolist() == [8.0, 3.0]
    loss_sum.backward()
    assert losses.grad.tolist() == [[1.0, 0.0, 1.0, 1.0]]  # d(sum)/d(loss) is the mask itself


def test_bf16_losses_are_summed_in_fp32():
    # 4097 has 13 significant bits, bf16 keeps 8: a sum left in bf16 would report 4096
    losses = torch.ones(1, 4097, dtype=torch.bfloat16)
    loss_sum, num_tokens, _ = token_level_loss(torch.ones(4097), losses)
    assert loss_sum.dtype == torch.float32 and loss_sum.item() == 4097.0
    assert num_tokens.item() == 4097


def test_an_all_masked_micro_batch_contributes_zero():
    loss_sum, num_tokens, report = token_level_loss(torch.zeros(3), torch.tensor([[5.0, 6.0, 7.0]]))
    assert loss_sum.item() == 0.0 and num_tokens.item() == 0 and report["lm loss"].tolist() == [0.0, 0.0]
