"""A Megatron indexed dataset's documents for HDP: lengths from the ``.idx``, tokens on demand.

The planner needs every document's length before any token is read: a rank reads only the
tokens of the pieces its micro-batches hold, and planning the next step must not wait on the
``.bin``. Lengths come from the index alone (megatron-core's ``IndexedDataset`` memory-maps
both files and reads neither up front): a document is the sum of its sequences (several with
``--split-sentences``). For a corpus of 100M documents that is a pass over ~1 GB of index, so
:func:`document_lengths` keeps the result once per dataset and process (the train, valid and
test splits share it) and, with ``--data-cache-path`` (Megatron's folder for its own index
caches), in a ``.npy`` file there, keyed by the index file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["DocumentReader", "clear_document_length_cache", "document_lengths"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_CACHE: dict[tuple[str, int, int], np.ndarray] = {}


def clear_document_length_cache() -> None:
    """Forget the lengths kept in this process (the files in ``--data-cache-path`` stay)."""
    with _LOCK:
        _CACHE.clear()


def document_lengths(prefix: str, *, cache_dir: Optional[str] = None) -> np.ndarray:
    """Tokens of every document of the indexed dataset ``prefix`` (int64, read-only).

    All documents in index order, empty ones included, so document ``d`` here is document
    ``d`` of Megatron's ``document_indices`` (``--split`` cuts the same documents).

    Raises:
        ValueError: the index is missing, or its sequence lengths or document indices are
            malformed (the message names the file).
    """
    idx = Path(str(prefix) + ".idx")
    try:
        info = idx.stat()
    except OSError as exc:
        raise ValueError(f"--data-path {prefix}: cannot read {idx}: {exc.strerror}") from None
    key = (str(idx.resolve()), info.st_size, info.st_mtime_ns)
    with _LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    path = _cache_file(cache_dir, idx, key) if cache_dir else None
    lengths = _load(path) if path is not None else None
    if lengths is None:
        lengths = _from_index(str(prefix), idx)
        if path is not None:
            _save(path, lengths)
    lengths.setflags(write=False)
    with _LOCK:
        _CACHE[key] = lengths
    return lengths


def _from_index(prefix: str, idx: Path) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    seq = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    bounds = np.asarray(dataset.document_indices, dtype=np.int64)
    if np.any(seq < 0):
        raise ValueError(f"{idx}: sequence {int(np.argmax(seq < 0))} has a negative length; "
                         "the index is corrupt, rebuild it with tools/preprocess_data.py")
    if len(bounds) < 1 or bounds[0] != 0 or bounds[-1] != len(seq) or np.any(np.diff(bounds) < 0):
        raise ValueError(f"{idx}: its document indices do not partition its {len(seq)} "
                         "sequences; the index is corrupt, rebuild it with tools/preprocess_data.py")
    offsets = np.concatenate([[0], np.cumsum(seq)])
    return offsets[bounds[1:]] - offsets[bounds[:-1]]


def _cache_file(cache_dir: str, idx: Path, key: tuple[str, int, int]) -> Path:
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return Path(cache_dir) / "bytescale" / f"{idx.stem}-{digest}-document_lengths.npy"


def _load(path: Path) -> Optional[np.ndarray]:
    if not path.is_file():
        return None
    try:
        lengths = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the unreadable document-length cache %s (%s)", path, exc)
        return None
    if lengths.ndim != 1 or lengths.dtype != np.int64:
        logger.warning("ignoring the document-length cache %s: not a 1-D int64 array", path)
        return None
    return lengths


def _save(path: Path, lengths: np.ndarray) -> None:
    """Write atomically (ranks may write the same file at once); a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(partial, "wb") as handle:
            np.save(handle, lengths, allow_pickle=False)
        os.replace(partial, path)
    except OSError as exc:
        logger.warning("cannot write the document-length cache %s (%s); continuing without it",
                       path, exc)


class DocumentReader:
    """Reads token ranges of the documents from ``first`` on of an indexed dataset, opening it
    on first use (a rank that never needs a token of it never maps the ``.bin``)."""

    def __init__(self, prefix: str, first: int = 0) -> None:
        self.prefix, self.first = str(prefix), int(first)
        self._dataset: Any = None
        self._bounds: Optional[np.ndarray] = None
        self._seq_lengths: Optional[np.ndarray] = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickles unopened (a Ray reader actor opens the dataset in its own process)."""
        return {"prefix": self.prefix, "first": self.first}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"], state["first"])  # type: ignore[misc]

    def _open(self) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self._dataset = IndexedDataset(self.prefix)
        self._seq_lengths = np.asarray(self._dataset.sequence_lengths, dtype=np.int64)
        self._bounds = np.asarray(self._dataset.document_indices, dtype=np.int64)

    def __call__(self, doc: int, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of document ``first + doc``."""
        if self._dataset is None:
            self._open()
        assert self._bounds is not None and self._seq_lengths is not None
        first, last = int(self._bounds[self.first + doc]), int(self._bounds[self.first + doc + 1])
        parts, skip, need = [], start, length
        for seq in range(first, last):
            n = int(self._seq_lengths[seq])
            if skip >= n:
                skip -= n
                continue
            take = min(n - skip, need)
            parts.append(np.asarray(self._dataset.get(seq, offset=skip, length=take)))
            skip, need = 0, need - take
            if need == 0:
                break
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
