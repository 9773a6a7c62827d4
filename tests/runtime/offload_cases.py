"""Pieces the offload tests share: a small layer whose saved tensors all have a token
dimension, and a host stream that logs the ordering the CUDA path would run."""

from __future__ import annotations

import torch

from megatron_bytescale.runtime.offload_streams import HostStream


class TokenLayer(torch.nn.Module):
    """Saves, per token row: LayerNorm's input, mean and rstd; the input of ``a`` (H), of gelu
    and of ``b`` (4H each): ``10 H + 2`` floats per row, every tensor with a token dimension."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.a = torch.nn.Linear(hidden, 4 * hidden)
        self.b = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(self.norm(x))))


class LoggedStream(HostStream):
    """A host stream that appends every cross-stream wait to ``log``."""

    def __init__(self, log: list, name: str) -> None:
        super().__init__(name)
        self.log = log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event.name))
