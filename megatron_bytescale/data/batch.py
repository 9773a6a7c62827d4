"""``GlobalBatch``: the unit every loader hands to the planner (numpy-free, torch-free).

Kept apart from :mod:`.hdp_iterator` so that a process that only reads or builds batches (a
Ray reader actor, a length tool) does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TokenSequence = Any
"""One sequence's token ids: a list, a numpy array or a torch tensor (1-D, integers)."""


@dataclass(frozen=True, kw_only=True)
class GlobalBatch:
    """One global batch: sequence ``i`` has ``lengths[i]`` tokens, ``tokens_by_seq[i]``."""

    lengths: tuple[int, ...]
    tokens_by_seq: Mapping[int, TokenSequence] | Sequence[TokenSequence]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_sequences(cls, sequences: Sequence[TokenSequence], **meta: Any) -> "GlobalBatch":
        """A global batch of in-memory token sequences."""
        seqs = list(sequences)
        return cls(lengths=tuple(len(s) for s in seqs), tokens_by_seq=seqs, meta=meta)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)
