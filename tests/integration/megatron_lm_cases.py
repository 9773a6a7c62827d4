"""Shared by the Megatron-LM hook and patch tests: a small Megatron indexed dataset on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TOLERANCE = 1e-5


def write_indexed_dataset(prefix: Path, documents: list[list[np.ndarray]]) -> None:
    """A Megatron .bin/.idx pair; each document is a list of sequences (sentences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for sequences in documents:
        builder.add_document(torch.from_numpy(np.concatenate(sequences)),
                             [len(s) for s in sequences])
    builder.finalize(str(prefix) + ".idx")


def random_documents(seed: int, count: int, vocab: int = 256) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        parts = 1 + (i % 3 == 0)  # every third document has two sequences
        docs.append([rng.integers(0, vocab, int(rng.integers(1, 400))).astype(np.int32)
                     for _ in range(parts)])
    return docs
