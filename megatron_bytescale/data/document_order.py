"""The order in which training visits documents: shuffled per epoch, blended by weight.

HDP plans whole documents, so the data order is an order of *documents* (Megatron's
``GPTDataset`` orders fixed-length samples cut from concatenated documents). Two rules, both
deterministic in the seed, so every rank builds the same order without communicating:

* **Shuffling** (:func:`epoch_order`): each epoch is its own seeded permutation of a dataset's
  documents, so every document is visited exactly once per epoch and the epochs come in
  different orders. ``GPTDataset`` shuffles its multi-epoch document index as a whole, which
  can visit a document twice before another once; one permutation per epoch keeps "every token
  once per epoch" and lets a reader start at any epoch without replaying the earlier ones.
* **Blending** (:func:`document_visits` with ``weights``): Megatron's ``BlendedDataset`` gives
  sample ``i`` to the dataset whose share of the samples so far lags its weight the most
  (``argmax_k w_k * i - n_k``, ties to the lower index). A Megatron GPT sample is always
  ``--seq-length`` tokens, so its weights are shares of *tokens*; HDP's documents have any
  length, so the same greedy rule counts tokens: the next document comes from the dataset
  whose share of the tokens visited so far lags its weight the most. Counting documents
  instead would over-weight datasets of short documents. Each dataset goes through its own
  epochs (a small, heavily weighted dataset repeats, as it does in Megatron).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["DocumentVisit", "document_visits", "epoch_order", "normalized_weights"]


@dataclass(frozen=True, kw_only=True)
class DocumentVisit:
    """Document ``doc`` (an index into the concatenated documents) in ``epoch`` of ``dataset``."""

    doc: int
    dataset: int
    epoch: int


def epoch_order(num_documents: int, *, seed: Sequence[int], epoch: int,
                shuffle: bool = True) -> np.ndarray:
    """Document indices ``0..num_documents-1`` in the order of ``epoch``.

    A permutation seeded by ``(*seed, epoch)`` (numpy's PCG64 through ``default_rng``, stable
    across platforms and numpy releases), or the plain order with ``shuffle=False``.
    """
    if not shuffle:
        return np.arange(num_documents)
    return np.random.default_rng([*seed, epoch]).permutation(num_documents)


def normalized_weights(weights: Sequence[float],
                       names: Optional[Sequence[str]] = None) -> np.ndarray:
    """Blend weights as shares that sum to 1 (Megatron normalises them too).

    Raises:
        ValueError: a weight is negative or not finite, or all are zero (naming the dataset).
    """
    values = np.asarray([float(w) for w in weights], dtype=np.float64)
    names = list(names) if names is not None else [f"dataset {k}" for k in range(len(values))]
    for name, value in zip(names, values):
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"blend weight {value} of {name} must be a finite number >= 0")
    if values.sum() <= 0:
        raise ValueError("the blend weights are all 0; give at least one dataset a positive "
                         "weight")
    return values / values.sum()


def document_visits(
    lengths: np.ndarray,
    *,
    seed: Sequence[int],
    datasets: Optional[Sequence[int]] = None,
    weights: Optional[Sequence[float]] = None,
    shuffle: bool = True,
    min_tokens: int = 1,
    start: tuple[int, int] = (0, 0),
) -> Iterator[DocumentVisit]:
    """Endless document visits over ``lengths`` (see the module docstring).

    Args:
        lengths: tokens of every document, the datasets' documents one after the other.
        seed: the seed (a sequence of ints: e.g. ``(--seed, split)``).
        datasets: where each dataset's documents start in ``lengths``, plus the end
            (``[0, n_0, n_0 + n_1, ..., len(lengths)]``); default: one dataset.
        weights: one weight per dataset (normalised here). ``None``: the datasets' documents
            are one pool, shuffled together (every document once per epoch; each dataset then
            contributes in proportion to its size, as an unweighted Megatron blend does).
        min_tokens: a dataset without any document of at least this many tokens is left out
            of a weighted blend (it could never add tokens to its share).
        start: ``(epoch, index)``: begin at the ``index``-th document of ``epoch``'s order
            (resuming; :mod:`.batch_seek` finds it). Unweighted only: a blend's choice
            depends on every visit before it.

    Raises:
        ValueError: no document (of a weighted dataset) has ``min_tokens`` tokens, or the
            bounds or weights are malformed.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    bounds = [0, len(lengths)] if datasets is None else [int(b) for b in datasets]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != len(lengths) or np.any(
            np.diff(bounds) < 0):
        raise ValueError(f"dataset bounds {bounds} do not partition {len(lengths)} documents")
    if not np.any(lengths >= min_tokens):
        raise ValueError(f"no document has at least {min_tokens} tokens")
    if weights is None:
        yield from _pool_visits(lengths, bounds, seed, shuffle, *start)
        return
    if tuple(start) != (0, 0):
        raise ValueError(f"start {tuple(start)}: a weighted blend starts at (0, 0)")
    if len(weights) != len(bounds) - 1:
        raise ValueError(f"{len(weights)} blend weight(s) for {len(bounds) - 1} dataset(s)")
    shares = normalized_weights(weights)
    active = [k for k in range(len(shares)) if shares[k] > 0
              and np.any(lengths[bounds[k]:bounds[k + 1]] >= min_tokens)]
    if not active:
        raise ValueError(f"no weighted dataset has a document of at least {min_tokens} tokens")
    streams = {k: _dataset_visits(lengths, bounds, k, seed, shuffle) for k in active}
    taken = np.zeros(len(shares), dtype=np.float64)
    lagging = np.full(len(shares), -np.inf)
    while True:
        total = max(float(taken.sum()), 1.0)
        lagging[active] = shares[active] * total - taken[active]
        k = int(np.argmax(lagging))  # the first of equals: the lower index, as Megatron
        visit = next(streams[k])
        taken[k] += lengths[visit.doc]
        yield visit


def _pool_visits(lengths: np.ndarray, bounds: list[int], seed: Sequence[int],
                 shuffle: bool, epoch: int = 0, index: int = 0) -> Iterator[DocumentVisit]:
    while True:
        order = epoch_order(len(lengths), seed=seed, epoch=epoch, shuffle=shuffle)
        for doc in order[index:]:
            doc = int(doc)
            dataset = int(np.searchsorted(bounds, doc, side="right")) - 1
            yield DocumentVisit(doc=doc, dataset=dataset, epoch=epoch)
        epoch, index = epoch + 1, 0


def _dataset_visits(lengths: np.ndarray, bounds: list[int], k: int, seed: Sequence[int],
                    shuffle: bool) -> Iterator[DocumentVisit]:
    lo, hi = bounds[k], bounds[k + 1]
    epoch = 0
    while True:
        for doc in epoch_order(hi - lo, seed=(*seed, k), epoch=epoch, shuffle=shuffle):
            yield DocumentVisit(doc=lo + int(doc), dataset=k, epoch=epoch)
        epoch += 1
