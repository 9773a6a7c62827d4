"""Byte-level text corpora every machine has, for the CPU demo and tests.

* :func:`stdlib_documents`: the Python standard library's own source. Whole files are mostly
  longer than a CPU-sized context (median 6.5 KB; cut at a 2 KB context, 97% of the tokens
  would sit in full-context sequences and every mode would look alike), so by default each
  file is split at its ``def``/``class`` lines (top level and one indent level) and every
  definition is a document. That gives a naturally long-tailed mix like the paper's GitHub
  set: most documents are a few hundred bytes, a few are tens of kilobytes. ``unit="file"``
  keeps whole files.
* :func:`jsonl_documents`: the ``"text"`` field of every line of a JSON-lines file.

Tokens are bytes (vocabulary 256). Order is deterministic: sorted paths, then a seeded
shuffle, so every rank of a job reads the same stream.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path
from typing import Iterator, Literal

import numpy as np

from megatron_bytescale.planner.inputs import check_regular_file, loads_json

BYTE_VOCAB_SIZE = 256

_DEFINITION_START = re.compile(rb"\n(?=(?:    )?(?:@|def |class |async def ))")


def byte_tokens(text: str | bytes) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int64 token ids in [0, 256)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


def stdlib_source_paths(root: str | Path | None = None) -> list[Path]:
    """Sorted ``*.py`` files of the standard library (installed packages excluded)."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"standard-library directory {base} does not exist")
    paths = [
        p
        for p in base.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]
    if not paths:
        raise ValueError(f"no *.py files under {base}")
    return sorted(paths)


def split_definitions(source: bytes) -> list[bytes]:
    """Cut Python source at ``def``/``class``/decorator lines of indent 0 or 4."""
    return [part for part in _DEFINITION_START.split(source) if part]


def stdlib_documents(
    *,
    unit: Literal["definition", "file"] = "definition",
    seed: int = 0,
    min_tokens: int = 2,
    root: str | Path | None = None,
    repeat: bool = True,
) -> Iterator[np.ndarray]:
    """Documents of the standard library's source as byte tokens, in a seeded random order.

    Args:
        unit: ``"definition"`` (default, see the module docstring) or ``"file"``.
        seed: shuffle seed; each pass over the corpus reshuffles with ``seed + pass``.
        min_tokens: documents shorter than this are skipped (one label needs 2 tokens).
        repeat: start another pass when the corpus is exhausted.
    """
    if unit not in ("definition", "file"):
        raise ValueError(f"unit ({unit!r}) must be 'definition' or 'file'")
    paths = stdlib_source_paths(root)
    epoch = 0
    while True:
        order = np.random.default_rng(seed + epoch).permutation(len(paths))
        for index in order:
            data = paths[int(index)].read_bytes()
            parts = split_definitions(data) if unit == "definition" else [data]
            for part in parts:
                if len(part) >= min_tokens:
                    yield byte_tokens(part)
        if not repeat:
            return
        epoch += 1


def jsonl_documents(
    path: str | Path, *, field: str = "text", min_tokens: int = 2, repeat: bool = True
) -> Iterator[np.ndarray]:
    """Byte tokens of ``field`` of every line of a JSON-lines file, in file order.

    Lines are split on ``\\n`` only and each is decoded on its own, so a binary or non-UTF-8
    file is an error naming the file and line, and every line goes through the bounded JSON
    reader (nesting depth, number sizes).
    """
    file = check_regular_file(path, "jsonl file")  # a FIFO would block open() forever
    while True:
        found = False
        with file.open("rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(
                        f"{file}:{line_number}: not UTF-8 text (byte {exc.start} of the line); a jsonl "
                        "file holds one JSON object per line, e.g. {\"text\": \"...\"}"
                    ) from None
                if not line.strip():
                    continue
                record = loads_json(line, f"{file}:{line_number}")
                if not isinstance(record, dict) or field not in record:
                    raise ValueError(f"{file}:{line_number}: no {field!r} field")
                text = record[field]
                if not isinstance(text, str):
                    kind = "null" if text is None else (
                        "a number" if isinstance(text, (int, float)) else f"a {type(text).__name__}")
                    raise ValueError(
                        f"{file}:{line_number}: the {field!r} field is {kind}, not a string; "
                        "every line must carry its document's text"
                    )
                tokens = byte_tokens(text)
                if len(tokens) >= min_tokens:
                    found = True
                    yield tokens
        if not found:
            raise ValueError(f"{file}: no document with at least {min_tokens} tokens")
        if not repeat:
            return
