"""Seekable synthetic global batches: the paper's length mixes, tokens made on demand.

For benchmarks and tests of the loaders at scale: a 32M-token batch of 16,384 ranks costs
nothing to hold, because a sequence's tokens are generated (seeded by step and sequence) only
when somebody reads them, and step ``k`` is computed directly (no replay of steps before it).
``synthetic_global_batches`` has the ``start_step -> batches`` signature of a seekable
:class:`~.hdp_iterator.HDPDataIterator` source, and pickles (for the Ray loader's readers) as a
``functools.partial``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Optional

import numpy as np

from .batch import GlobalBatch
from .synthetic import synthetic_lengths


class SyntheticTokens(Mapping):
    """Tokens of sequence ``seq`` of step ``step``: uniform in the vocabulary, seeded by
    ``(seed, step, seq)``, generated when read."""

    def __init__(self, lengths: np.ndarray, *, seed: int, step: int, vocab_size: int) -> None:
        self._lengths, self._key = lengths, (int(seed), int(step))
        self._vocab = int(vocab_size)

    def __getitem__(self, seq: int) -> np.ndarray:
        if not 0 <= int(seq) < len(self._lengths):
            raise KeyError(seq)
        rng = np.random.default_rng([*self._key, int(seq)])
        return rng.integers(0, self._vocab, int(self._lengths[seq]), dtype=np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._lengths)))

    def __len__(self) -> int:
        return len(self._lengths)


def synthetic_global_batches(
    start_step: int = 0,
    *,
    dataset: str,
    tokens_per_batch: int,
    max_length: int,
    steps: Optional[int] = None,
    seed: int = 0,
    vocab_size: int = 32000,
) -> Iterator[GlobalBatch]:
    """Global batches ``start_step, start_step + 1, ...`` (``steps`` in all, None: endless).

    Step ``k`` has the lengths of :func:`~.synthetic.synthetic_lengths` (``dataset`` is
    ``github``, ``byted``, ``lognormal`` or ``uniform``) for ``tokens_per_batch`` tokens,
    seeded by ``seed * 1_000_003 + k``, at most ``max_length`` each.
    """
    step = int(start_step)
    while steps is None or step < steps:
        lengths = synthetic_lengths(dataset, tokens_per_batch, seed=seed * 1_000_003 + step,
                                    max_length=max_length)
        yield GlobalBatch(
            lengths=tuple(int(n) for n in lengths),
            tokens_by_seq=SyntheticTokens(lengths, seed=seed, step=step, vocab_size=vocab_size),
            meta={"source": f"synthetic-{dataset}", "batch": step},
        )
        step += 1
