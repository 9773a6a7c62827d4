"""Read the sequence lengths of a global batch from a file.

Two formats, chosen by content (a file whose first non-blank character is ``[`` is JSON):

* text: one positive integer per line; blank lines and lines starting with ``#`` are skipped;
* JSON: a list of positive integers.

Every problem raises :class:`LengthsFileError` (a ``ValueError``) naming the file, and for text
files the line, so a user can fix the file without reading code. Megatron ``.idx`` files are
read by :mod:`megatron_bytescale.integration.indexed_lengths` (it needs megatron-core).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class LengthsFileError(ValueError):
    """A lengths file is missing, unreadable or malformed."""


def read_lengths(path: str | Path) -> np.ndarray:
    """Lengths from a text or JSON file, as int64 (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise LengthsFileError(f"lengths file {str(p)!r} does not exist")
    if p.is_dir():
        raise LengthsFileError(f"lengths file {str(p)!r} is a directory, not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LengthsFileError(f"cannot read lengths file {str(p)!r}: {exc}") from exc
    if text.lstrip().startswith("["):
        return _parse_json(text, str(p))
    return _parse_text(text, str(p))


def _parse_text(text: str, name: str) -> np.ndarray:
    values: list[int] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            value = int(line)
        except ValueError:
            raise LengthsFileError(
                f"{name}, line {lineno}: {line[:40]!r} is not an integer; expected one positive "
                f"integer (a sequence length in tokens) per line"
            ) from None
        if value < 1:
            raise LengthsFileError(f"{name}, line {lineno}: length {value} must be >= 1")
        values.append(value)
    return np.asarray(values, dtype=np.int64)


def _parse_json(text: str, name: str) -> np.ndarray:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LengthsFileError(f"{name}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, list):
        raise LengthsFileError(f"{name}: expected a JSON list of lengths, got {type(data).__name__}")
    for i, x in enumerate(data):
        if isinstance(x, bool) or not isinstance(x, int):
            raise LengthsFileError(f"{name}: element {i} ({x!r}) is not an integer; expected a list of token counts")
        if x < 1:
            raise LengthsFileError(f"{name}: element {i} is {x}; every length must be >= 1")
    return np.asarray(data, dtype=np.int64)


def write_lengths(path: str | Path, lengths: "np.ndarray | list[int]") -> None:
    """Write lengths as text, one per line (the format :func:`read_lengths` reads)."""
    Path(path).write_text("".join(f"{int(x)}\n" for x in lengths), encoding="utf-8")
