"""Read the sequence lengths of a global batch from a file.

Two formats, chosen by content (a file whose first non-blank character is ``[`` or ``{`` is
JSON):

* text: one positive integer per line; blank lines and lines starting with ``#`` are skipped;
* JSON: a list of positive integers.

Every problem raises :class:`LengthsFileError` (a ``ValueError``) naming the file, and for text
files the line, so a user can fix the file without reading code. The file is read in chunks
and at most :data:`MAX_FILE_BYTES`, so an endless input (``/dev/zero``, a stuck pipe's
producer aside) or a binary file is refused quickly instead of filling the memory. Megatron
``.idx`` files are read by :mod:`megatron_bytescale.integration.indexed_lengths` (it needs
megatron-core).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_bytescale.planner.inputs import check_regular_file, loads_json, parse_decimal, split_lines
from megatron_bytescale.planner.plan import MAX_SEQUENCE_LENGTH

MAX_FILE_BYTES = 256 * 2**20
"""The largest lengths file read (256 MiB: some 30 million lengths)."""
_CHUNK_BYTES = 2**20


class LengthsFileError(ValueError):
    """A lengths file is missing, unreadable or malformed."""


def read_lengths(path: str | Path) -> np.ndarray:
    """Lengths from a text or JSON file, as int64 (see the module docstring)."""
    if not Path(path).exists():
        raise LengthsFileError(f"lengths file {str(path)!r} does not exist")
    try:
        p = check_regular_file(path, "lengths file")  # a FIFO would block open() forever
    except ValueError as exc:
        raise LengthsFileError(str(exc)) from None
    text = _read_bounded(p)
    if text.lstrip()[:1] in ("[", "{"):
        return _parse_json(text, str(p))
    return _parse_text(text, str(p))


def _read_bounded(p: Path) -> str:
    """The file's text, read in chunks: refused at the first NUL byte or past MAX_FILE_BYTES."""
    chunks: list[bytes] = []
    size = 0
    try:
        with p.open("rb") as handle:
            while chunk := handle.read(_CHUNK_BYTES):
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise LengthsFileError(
                        f"lengths file {str(p)!r} holds binary data (a NUL byte at byte "
                        f"{size + nul:,}); expected text with one length per line or a JSON list "
                        "(a Megatron index must end in .idx)"
                    )
                size += len(chunk)
                if size > MAX_FILE_BYTES:
                    raise LengthsFileError(
                        f"lengths file {str(p)!r} is larger than {MAX_FILE_BYTES // 2**20} MiB (or "
                        "endless); a lengths file holds one integer per sequence of a global batch"
                    )
                chunks.append(chunk)
    except OSError as exc:
        raise LengthsFileError(f"cannot read lengths file {str(p)!r}: {exc.strerror or exc}") from exc
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LengthsFileError(
            f"lengths file {str(p)!r} is not UTF-8 text (byte {exc.start:,}); expected one length "
            "per line or a JSON list"
        ) from None


def _parse_text(text: str, name: str) -> np.ndarray:
    values: list[int] = []
    for lineno, raw in enumerate(split_lines(text), start=1):  # only \n and \r\n end a line
        line = raw.strip(" \t")
        if not line or line.startswith("#"):
            continue
        try:  # ASCII digits only: int() would also read 5_000, Arabic-Indic or fullwidth digits
            if line.isascii() and line.isdigit() and len(line) <= 30:  # the common case, fast
                value = int(line)
            else:  # a sign, or something to name in the message
                value = parse_decimal(line, f"{name}, line {lineno}", max_digits=30)
        except ValueError as exc:
            raise LengthsFileError(
                f"{exc}; expected one positive integer (a sequence length in tokens) per line"
            ) from None
        if value < 1:
            raise LengthsFileError(f"{name}, line {lineno}: length {value} must be >= 1")
        if value > MAX_SEQUENCE_LENGTH:
            raise LengthsFileError(_too_long(f"{name}, line {lineno}", value))
        values.append(value)
    return np.asarray(values, dtype=np.int64)


def _parse_json(text: str, name: str) -> np.ndarray:
    try:
        data = loads_json(text, name)  # nesting depth and number sizes bounded
    except ValueError as exc:
        raise LengthsFileError(str(exc)) from None
    if not isinstance(data, list):
        kind = {dict: "an object", str: "a string"}.get(type(data), type(data).__name__)
        raise LengthsFileError(
            f"{name}: expected a JSON list of lengths such as [4096, 812, 131072], got {kind}"
        )
    for i, x in enumerate(data):
        if isinstance(x, bool) or not isinstance(x, int):
            raise LengthsFileError(f"{name}: element {i} ({x!r}) is not an integer; expected a list of token counts")
        if x < 1:
            raise LengthsFileError(f"{name}: element {i} is {x}; every length must be >= 1")
        if x > MAX_SEQUENCE_LENGTH:
            raise LengthsFileError(_too_long(f"{name}: element {i}", x))
    return np.asarray(data, dtype=np.int64)


def _too_long(where: str, value: int) -> str:
    shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:12]}... ({len(str(value))} digits)"
    return f"{where}: length {shown} is longer than the {MAX_SEQUENCE_LENGTH} (2**40) tokens a sequence may have"


def write_lengths(path: str | Path, lengths: "np.ndarray | list[int]") -> None:
    """Write lengths as text, one per line (the format :func:`read_lengths` reads)."""
    Path(path).write_text("".join(f"{int(x)}\n" for x in lengths), encoding="utf-8")
