"""Document lengths of a Megatron indexed dataset, read from its ``.idx`` only (no token reads).

A Megatron ``.bin``/``.idx`` pair stores *sequences* and groups them into *documents*
(``document_indices`` marks where each document's sequences end). The planner plans documents,
so a document's length is the sum of its sequences' lengths. Only the index file is opened
(memory-mapped by megatron-core's index reader); the ``.bin`` need not even be present.
"""

from __future__ import annotations

import logging
import struct
import warnings
from pathlib import Path

from typing import NamedTuple

import numpy as np

from megatron_bytescale.planner.inputs import check_regular_file

logger = logging.getLogger(__name__)


def index_path(path: str | Path) -> Path:
    """``prefix``, ``prefix.idx`` or ``prefix.bin`` -> ``prefix.idx``."""
    p = Path(path)
    if p.suffix == ".idx":
        return p
    if p.suffix == ".bin":
        return p.with_suffix(".idx")
    return p.with_name(p.name + ".idx")


def read_indexed_lengths(path: str | Path, *, multimodal: bool = False) -> np.ndarray:
    """Lengths (int64) of every non-empty document of the indexed dataset at ``path``.

    Args:
        path: the dataset prefix, or its ``.idx`` / ``.bin`` file.
        multimodal: whether the index was written with modes (multimodal datasets).

    Raises:
        ValueError: the index is missing or is not a Megatron index file (the message names it).
        ImportError: megatron-core is not installed.
    """
    index = read_index(path, multimodal=multimodal)
    return checked_document_lengths(index.sequence_lengths, index.document_indices, name=str(index.path))


class IndexArrays(NamedTuple):
    """What an ``.idx`` file says, copied out of megatron-core's reader."""

    path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray


def read_index(path: str | Path, *, multimodal: bool = False) -> IndexArrays:
    """The arrays of the index file of ``path`` (prefix, ``.idx`` or ``.bin``); ValueError
    naming the file if it is missing, not a regular file or not a Megatron index."""
    idx = index_path(path)
    if not idx.exists():
        raise ValueError(f"Megatron index file {str(idx)!r} does not exist")
    check_regular_file(idx, "Megatron index file")  # a FIFO would block open() forever
    try:
        with warnings.catch_warnings():  # megatron.core warns about TE/apex on import
            warnings.simplefilter("ignore", UserWarning)
            from megatron.core.datasets.indexed_dataset import _IndexReader
    except ImportError as exc:  # pragma: no cover - megatron-core is a dependency
        raise ImportError(
            "reading .idx lengths needs megatron-core; pip install 'megatron-core>=0.16.1'"
        ) from exc
    try:
        reader = _IndexReader(str(idx), multimodal)
    except (AssertionError, ValueError, OSError, KeyError, IndexError, struct.error) as exc:
        raise ValueError(
            f"{str(idx)!r} is not a readable Megatron index file (truncated or not an index: "
            f"{exc or type(exc).__name__})"
        ) from exc
    try:
        # copies: the reader unmaps the file when it goes away, and views would then dangle
        return IndexArrays(
            path=idx, dtype=np.dtype(reader.dtype),
            sequence_lengths=np.array(reader.sequence_lengths, dtype=np.int64, copy=True),
            sequence_pointers=np.array(reader.sequence_pointers, dtype=np.int64, copy=True),
            document_indices=np.array(reader.document_indices, dtype=np.int64, copy=True),
        )
    finally:
        del reader


def check_token_layout(index: IndexArrays, bin_size: int) -> None:
    """Check that the index describes its ``.bin`` the way Megatron writes one: an integer
    token dtype, sequences stored back to back from byte 0 (each pointer = the previous
    pointer + the previous length x the dtype's size), and a ``.bin`` that holds them all.

    A changed dtype code, an overlapping or corrupt pointer or a short ``.bin`` would
    otherwise be read as other tokens (garbage) or fail deep inside numpy.
    """
    name = str(index.path)
    if index.dtype.kind not in "iu":
        raise ValueError(f"{name!r}: token dtype {index.dtype} is not an integer type; the dtype code "
                         "in the header is corrupt (write the dataset again with preprocess_data.py)")
    seq, ptr = index.sequence_lengths, index.sequence_pointers
    if len(seq) == 0:
        return
    itemsize = index.dtype.itemsize
    expected = np.concatenate([[0], np.cumsum(seq[:-1] * itemsize)])
    wrong = np.flatnonzero(ptr != expected)
    if len(wrong):
        i = int(wrong[0])
        raise ValueError(
            f"{name!r}: sequence {i} starts at byte {int(ptr[i])} of the .bin, but with {itemsize}-byte "
            f"{index.dtype} tokens the sequences before it end at byte {int(expected[i])}: the sequence "
            "pointers or the dtype code are corrupt (write the dataset again with preprocess_data.py)"
        )
    needed = int(expected[-1] + seq[-1] * itemsize)
    if bin_size < needed:
        raise ValueError(
            f"{name[:-4]}.bin is truncated: {bin_size} bytes, its index describes {needed}; copy "
            "the file again or write the dataset again"
        )


def checked_document_lengths(sequence_lengths: np.ndarray, document_indices: np.ndarray, *, name: str) -> np.ndarray:
    """Lengths of the non-empty documents of an index, checked: a negative sequence length or
    document indices that do not partition the sequences mean a corrupt index, never a
    document to leave out quietly.
    """
    seq = np.asarray(sequence_lengths, dtype=np.int64)
    bounds = np.asarray(document_indices, dtype=np.int64)
    if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != len(seq) or np.any(np.diff(bounds) < 0):
        raise ValueError(f"{name!r}: document indices do not partition its {len(seq)} sequences "
                         "(a corrupt index; write it again with Megatron's preprocess_data.py)")
    negative = np.flatnonzero(seq < 0)
    if len(negative):
        i = int(negative[0])
        raise ValueError(
            f"{name!r}: sequence {i} has a negative length ({int(seq[i])}); {len(negative)} such "
            "sequence(s): the index is corrupt, write it again with Megatron's preprocess_data.py"
        )
    if len(seq) == 0:
        return np.zeros(0, dtype=np.int64)
    csum = np.concatenate([[0], np.cumsum(seq)])
    docs = csum[bounds[1:]] - csum[bounds[:-1]]
    empty = int(np.sum(docs == 0))
    if empty:
        logger.info("%s: skipped %d empty document(s)", name, empty)
    return docs[docs > 0]
