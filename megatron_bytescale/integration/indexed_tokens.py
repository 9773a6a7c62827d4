"""Documents of a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) as token arrays.

Reads through megatron-core's own ``IndexedDataset`` (memory-mapped), so every format Megatron
writes is understood; that is also why this lives in the integration layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset


def is_indexed_prefix(prefix: str | Path) -> bool:
    """Whether ``PREFIX.bin`` and ``PREFIX.idx`` both exist."""
    p = str(prefix)
    return Path(p + ".bin").is_file() and Path(p + ".idx").is_file()


def open_indexed_dataset(prefix: str | Path) -> "IndexedDataset":
    """megatron-core's ``IndexedDataset`` at ``prefix``, checked against corrupt files: a
    truncated or foreign ``.idx``, negative lengths, or a ``.bin`` shorter than its index says
    are errors naming the file (megatron-core would fail later, naming none)."""
    import warnings

    with warnings.catch_warnings():  # megatron.core warns about TE/apex on import
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_bytescale.planner.inputs import check_regular_file

    from .indexed_lengths import check_token_layout, checked_document_lengths, read_index

    index = read_index(str(prefix) + ".idx")
    checked_document_lengths(index.sequence_lengths, index.document_indices, name=f"{prefix}.idx")
    if len(index.sequence_lengths) == 0:
        raise ValueError(f"indexed dataset {prefix} has no sequences")
    bin_path = check_regular_file(str(prefix) + ".bin", "Megatron data file")
    # checked before megatron-core opens the .bin: on a bad one it fails in its constructor
    # and then again in __del__ ("Exception ignored in ...")
    check_token_layout(index, bin_path.stat().st_size)
    try:
        dataset = IndexedDataset(str(prefix))
    except Exception as exc:  # noqa: BLE001 - megatron-core raises many kinds on bad files
        raise ValueError(f"{prefix}: not a readable Megatron indexed dataset ({exc})") from exc
    return dataset


def indexed_documents(
    prefix: str | Path, *, min_tokens: int = 2, repeat: bool = True
) -> Iterator[np.ndarray]:
    """Every sequence of the dataset, in index order, as int64 token ids (negative ids refused)."""
    if not is_indexed_prefix(prefix):
        raise ValueError(
            f"{prefix} is not a Megatron indexed dataset prefix: expected {prefix}.bin and "
            f"{prefix}.idx"
        )
    dataset = open_indexed_dataset(prefix)
    while True:
        found = False
        for index in range(len(dataset)):
            tokens = np.asarray(dataset[index], dtype=np.int64)
            if len(tokens) and tokens.min() < 0:
                raise ValueError(
                    f"indexed dataset {prefix}: sequence {index} holds the negative token id "
                    f"{int(tokens.min())}; token ids are >= 0 (a corrupt .bin, or an index whose "
                    "dtype does not match the data)"
                )
            if len(tokens) >= min_tokens:
                found = True
                yield tokens
        if not found:
            raise ValueError(
                f"indexed dataset {prefix}: no sequence with at least {min_tokens} tokens"
            )
        if not repeat:
            return
