"""Sequence-parallel row padding at TP 2, 4 and 8, at unit level (no spawn).

With sequence parallelism a micro-batch's packed row is padded to a multiple of the TP size
and each TP rank holds ``rows / tp`` of it in the layernorm / dropout regions. The spawned TP
tests run TP = 2 only, where "pad to even" and "pad to a multiple of tp" agree; these checks
run the helpers at TP 1, 2, 4 and 8 against an independent definition (the smallest multiple
of tp that is >= the token count, found by counting up), and check that the offloader sees
the per-rank region as token rows at the same padded count the model is fed.
"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from megatron_bytescale.integration.schedule import micro_batch_rows
from megatron_bytescale.runtime import ActivationOffloader, offload_micro_batch

H = 8


def padded(tokens: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that is at least ``tokens`` (counting up)."""
    rows = tokens
    while rows % tp:
        rows += 1
    return rows


def config(tp: int, sequence_parallel: bool = True) -> SimpleNamespace:
    return SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_row_is_padded_to_a_multiple_of_the_tp_size(tp):
    for tokens in range(1, 70):
        rows = micro_batch_rows(tokens, config(tp))
        assert rows == padded(tokens, tp), (tokens, tp, rows)
        assert micro_batch_rows(tokens, config(tp, sequence_parallel=False)) == tokens


class MicroBatch(SimpleNamespace):
    """What ``offload_micro_batch`` reads of a micro-batch: its tokens and plan ratio."""


class RegionLayer(torch.nn.Module):
    """Saves this TP rank's sequence-parallel region ``[rows / tp, 1, H]`` (a layernorm's input)
    and a full ``[rows, 1, H]`` tensor (attention's, after the all-gather)."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = x[: x.shape[0] // self.tp] * 1.0  # its own storage
        full = x * 1.0
        return torch.sin(full) + torch.cos(region).sum() * 0 + torch.sin(region).mean()


def ceil_rows(ratio: float, rows: int) -> int:
    exact = Fraction(ratio).limit_denominator(10**6) * rows
    return -(-exact.numerator // exact.denominator)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("ratio", [0.37, 1.0])
def test_the_offloader_sees_each_ranks_region_as_token_rows(tp, ratio):
    """The model is fed ``micro_batch_rows`` rows; ``offload_micro_batch`` must give the
    offloader the same count, so the region of ``rows / tp`` rows is offloaded by rows (not
    as a whole tensor by the running fraction)."""
    layers = torch.nn.ModuleList([RegionLayer(tp) for _ in range(3)])  # layer 0 offloadable
    for tokens in (tp * 5 + 1, tp * 7 - 1, tp * 6):
        rows = micro_batch_rows(tokens, config(tp))
        offloader = ActivationOffloader(layers, min_tensor_bytes=0, sequence_parallel_size=tp)
        batch = MicroBatch(tokens=torch.zeros(tokens, dtype=torch.long), offload_ratio=ratio)
        x = torch.randn(rows, 1, H).requires_grad_()
        with offload_micro_batch(offloader, batch):
            h = x * 1.0
            for layer in layers:
                h = layer(h)
            loss = h.sum()
        loss.backward()
        # layer 0 saves: the region (by cos and sin) and full (by sin), each a storage
        region, full = rows // tp, rows
        want = (ceil_rows(ratio, region) + ceil_rows(ratio, full)) * H * 4
        assert offloader.end_step().offloaded_bytes == want, (tokens, rows, tp)
