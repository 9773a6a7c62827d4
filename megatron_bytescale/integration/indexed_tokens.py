"""Documents of a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) as token arrays.

Reads through megatron-core's own ``IndexedDataset`` (memory-mapped), so every format Megatron
writes is understood; that is also why this lives in the integration layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np


def is_indexed_prefix(prefix: str | Path) -> bool:
    """Whether ``PREFIX.bin`` and ``PREFIX.idx`` both exist."""
    p = str(prefix)
    return Path(p + ".bin").is_file() and Path(p + ".idx").is_file()


def indexed_documents(
    prefix: str | Path, *, min_tokens: int = 2, repeat: bool = True
) -> Iterator[np.ndarray]:
    """Every sequence of the dataset, in index order, as int64 token ids."""
    if not is_indexed_prefix(prefix):
        raise ValueError(
            f"{prefix} is not a Megatron indexed dataset prefix: expected {prefix}.bin and "
            f"{prefix}.idx"
        )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    if len(dataset) == 0:
        raise ValueError(f"indexed dataset {prefix} has no sequences")
    while True:
        found = False
        for index in range(len(dataset)):
            tokens = np.asarray(dataset[index], dtype=np.int64)
            if len(tokens) >= min_tokens:
                found = True
                yield tokens
        if not found:
            raise ValueError(
                f"indexed dataset {prefix}: no sequence with at least {min_tokens} tokens"
            )
        if not repeat:
            return
