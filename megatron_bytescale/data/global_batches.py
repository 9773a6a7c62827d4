"""Group a stream of documents into global batches of a fixed number of tokens.

The paper fixes the global batch in *tokens* (32M per step), not in sequences: the planner
then spreads those tokens over the HDP ranks. This module does the same at demo scale:
documents longer than the context length are cut into context-length sequences (as a
Megatron dataset splits long documents into samples), and sequences are added to the
current global batch until it holds ``tokens_per_batch`` tokens; the sequence that would
overflow is cut, and its remainder opens the next batch. Every batch therefore holds
``tokens_per_batch`` tokens, at most ``min_tokens - 1`` fewer when the room left is too small
for a fragment that can carry a label; fragments shorter than ``min_tokens`` are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .batch import GlobalBatch


def split_to_context(document: np.ndarray, context_length: int) -> list[np.ndarray]:
    """Cut a document into consecutive sequences of at most ``context_length`` tokens."""
    if context_length < 1:
        raise ValueError(f"context_length ({context_length}) must be >= 1")
    return [document[i : i + context_length] for i in range(0, len(document), context_length)]


def global_batches(
    documents: Iterable[Any],
    *,
    tokens_per_batch: int,
    context_length: int,
    min_tokens: int = 2,
    max_batches: int | None = None,
) -> Iterator[GlobalBatch]:
    """Yield global batches of ``tokens_per_batch`` tokens (see the module docstring).

    Args:
        documents: token arrays (numpy or anything ``np.asarray`` accepts).
        tokens_per_batch: tokens per global batch.
        context_length: longest sequence; longer documents are split.
        min_tokens: shorter fragments are dropped.
        max_batches: stop after this many batches (None: until the documents run out).
    """
    if tokens_per_batch < min_tokens:
        raise ValueError(
            f"tokens_per_batch ({tokens_per_batch}) must be >= min_tokens ({min_tokens})"
        )
    current: list[np.ndarray] = []
    filled = 0
    produced = 0

    def pending() -> Iterator[np.ndarray]:
        for document in documents:
            for sequence in split_to_context(np.asarray(document, dtype=np.int64), context_length):
                if len(sequence) >= min_tokens:
                    yield sequence

    for sequence in pending():
        while len(sequence):
            room = tokens_per_batch - filled
            head, sequence = sequence[:room], sequence[room:]
            if len(head) >= min_tokens:
                current.append(head)
                filled += len(head)
            if len(sequence) < min_tokens:
                sequence = sequence[:0]
            if tokens_per_batch - filled < min_tokens:
                yield GlobalBatch.from_sequences(current)
                produced += 1
                if max_batches is not None and produced >= max_batches:
                    return
                current, filled = [], 0
