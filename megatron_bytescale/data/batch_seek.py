"""Resume at global batch k of a document pool without walking the k batches before it.

:func:`~megatron_bytescale.integration.megatron_lm_data.budget_batches` fills each global batch
with a token budget from a stream of documents (one seeded permutation per epoch), each cut
into context-length sequences. Walking that stream document by document to find where batch
``k`` starts costs ~10 µs per document in Python: minutes for a long run (100K steps of a few
thousand documents each). :func:`seek_pool_batches` finds the same place with one binary
search per batch over the cumulative token counts of the sequences (numpy, a block of
documents at a time): still linear in the documents skipped, but at numpy's speed (100,000
steps of 4M tokens: ~25-30 s instead of ~45 min, docs/benchmarks.md "resume").

The batching rule it follows is the walk's (:func:`.megatron_lm_data.budget_batches`; the
tests compare the two): a sequence that would overflow the batch is cut at the budget and its
remainder opens the next batch unless it is shorter than ``min_tokens`` (then it is dropped),
and a batch closes as soon as less than ``min_tokens`` of its budget is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .document_order import epoch_order

#: Documents turned into sequence arrays at a time (bounds the memory of a seek).
BLOCK_DOCUMENTS = 1 << 20


@dataclass(frozen=True)
class PoolCursor:
    """Where a global batch starts: token ``token`` of the ``index``-th document of ``epoch``'s
    order (the tokens before it belong to earlier batches or were dropped)."""

    epoch: int
    index: int
    token: int


def _sequences(lengths: np.ndarray, seed: Sequence[int], shuffle: bool, context: int,
               min_tokens: int, block: int) -> Iterator[tuple[np.ndarray, ...]]:
    """Endless blocks of sequences ``(epoch, index, start, length)``, in the walk's order."""
    if not np.any(lengths >= min_tokens):
        raise ValueError(f"no document has at least {min_tokens} tokens: no batch can be filled")
    epoch = 0
    while True:
        order = epoch_order(len(lengths), seed=seed, epoch=epoch, shuffle=shuffle)
        for lo in range(0, len(order), block):
            doc_lengths = lengths[order[lo:lo + block]]
            per_doc = -(-doc_lengths // context)  # sequences of each document
            index = np.repeat(np.arange(lo, lo + len(doc_lengths)), per_doc)
            first = np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
            start = (np.arange(len(index)) - first) * context
            length = np.minimum(context, np.repeat(doc_lengths, per_doc) - start)
            keep = length >= min_tokens
            yield (np.full(int(keep.sum()), epoch), index[keep], start[keep], length[keep])
        epoch += 1


def seek_pool_batches(lengths: np.ndarray, *, seed: Sequence[int], shuffle: bool,
                      budget_of: Callable[[int], int], context: int, min_tokens: int,
                      steps: int, block: int = BLOCK_DOCUMENTS) -> PoolCursor:
    """Where global batch ``steps`` starts (see the module docstring).

    ``budget_of(i)`` is batch ``i``'s token budget (already checked by the caller's rule);
    the documents must hold at least one sequence of ``min_tokens`` (else no batch ends).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    blocks = _sequences(lengths, seed, shuffle, context, min_tokens, block)
    epoch, index, start, length = (np.zeros(0, dtype=np.int64) for _ in range(4))
    ends = np.zeros(1, dtype=np.int64)  # ends[j + 1]: tokens of sequences 0..j of the window
    position = 0  # tokens of the window already in earlier batches

    def extend() -> None:
        nonlocal epoch, index, start, length, ends, position
        keep = int(np.searchsorted(ends, position, side="right")) - 1  # current sequence
        position -= int(ends[keep])
        more = next(blocks)
        epoch, index, start, length = (np.concatenate([old[keep:], new]) for old, new in
                                       zip((epoch, index, start, length), more))
        ends = np.concatenate([[0], np.cumsum(length)])

    for step in range(steps):
        budget = int(budget_of(step))
        while ends[-1] < position + budget - (min_tokens - 1):
            extend()  # (rebases position)
        target = position + budget - (min_tokens - 1)  # the batch closes once it holds this
        last = int(np.searchsorted(ends, target, side="left")) - 1  # its last sequence
        overflow = int(ends[last + 1]) - position - budget
        position = position + budget if overflow >= min_tokens else int(ends[last + 1])
    while ends[-1] <= position:  # the next batch's first sequence must be in the window
        extend()
    j = int(np.searchsorted(ends, position, side="right")) - 1
    return PoolCursor(epoch=int(epoch[j]), index=int(index[j]),
                      token=int(start[j]) + position - int(ends[j]))
