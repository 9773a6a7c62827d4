"""Reading user input safely: the one JSON reader, strict integers, regular files only.

Every file a user hands to a ``bytescale`` command (lengths, cost models, node maps, jsonl
corpora, plans) goes through these helpers, so every kind of bad input fails the same way: a
``ValueError`` whose message names the file or field and what to do, never a deep traceback,
a hang or an unbounded read.

* :func:`loads_json` refuses nesting deeper than :data:`MAX_JSON_DEPTH` before parsing it
  (``json.loads`` recurses once per level and a few thousand ``[`` raise RecursionError) and
  integers of more than :data:`MAX_INT_DIGITS` digits (``10**400`` would later overflow a
  float conversion; Python refuses 4,300 digits with a message that names nothing).
* :func:`check_regular_file` refuses FIFOs, devices and directories before they are opened:
  ``open()`` on a FIFO blocks until a writer appears, that is forever.
* :func:`parse_decimal` reads an integer written in ASCII digits only (``int()`` also takes
  ``5_000``, Arabic-Indic and fullwidth digits), and :func:`split_lines` splits on ``\\n``
  and ``\\r\\n`` only (``str.splitlines`` also splits on form feed, ``\\x1c`` or U+2028).
* :func:`bounded_int` checks a value that must be a plain integer in a range.

Standard library and numpy only (it is part of the planner layer).
"""

from __future__ import annotations

import json
import numbers
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64
"""Deepest nesting of lists and objects accepted in any JSON input (plans nest 6 deep)."""
MAX_INT_DIGITS = 30
"""Longest integer literal accepted in JSON input (int64 has 19 digits)."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_LONG_INT = re.compile(r"(?<![\w.])-?[0-9]{%d,}" % (MAX_INT_DIGITS + 1), re.ASCII)
_DECIMAL = re.compile(r"[+-]?[0-9]+", re.ASCII)


def check_regular_file(path: str | Path, what: str) -> Path:
    """``path`` as a Path if it is a regular file (symlinks followed); ValueError otherwise.

    Never opens the file, so a FIFO or a device is refused without blocking on it.
    """
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise ValueError(f"cannot read {what} {str(p)!r}: it does not exist") from None
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode):
        return p
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")
    raise ValueError(f"{what} {str(p)!r} is {kind}; give a regular file (copy a pipe's output to a file first)")


def read_text_file(path: str | Path, what: str, *, max_bytes: int) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``max_bytes`` read; ValueError
    naming ``what`` and the file otherwise."""
    p = check_regular_file(path, what)
    try:
        with p.open("rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise ValueError(f"{what} {str(p)!r} is larger than {max_bytes:,} bytes; is it the right file?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {str(p)!r} is not text (not UTF-8 at byte {exc.start:,}): a binary file?") from None


def json_depth(text: str) -> int:
    """How deep lists and objects nest in the JSON ``text`` (brackets inside strings ignored)."""
    bare = _STRING.sub('""', text) if '"' in text else text
    return _bracket_depth(bare)


def _bracket_depth(bare: str) -> int:
    codes = np.frombuffer(bare.encode("utf-8", errors="replace"), dtype=np.uint8)
    step = (codes == ord("[")).astype(np.int64) + (codes == ord("{"))
    step -= (codes == ord("]")).astype(np.int64) + (codes == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def loads_json(text: str, what: str) -> Any:
    """``json.loads(text)`` for user input: ValueError naming ``what`` for invalid JSON, nesting
    deeper than :data:`MAX_JSON_DEPTH` or integers longer than :data:`MAX_INT_DIGITS` digits."""
    bare = _STRING.sub('""', text) if '"' in text else text
    if bare.count("[") + bare.count("{") > MAX_JSON_DEPTH:  # most files cannot nest that deep
        depth = _bracket_depth(bare)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what} is not valid JSON here: it nests {depth:,} levels deep (at most {MAX_JSON_DEPTH}); "
                             "is it the right file?")
    long_int = _LONG_INT.search(bare)
    if long_int:
        digits = len(long_int.group().lstrip("-"))
        raise ValueError(f"{what} holds a number of {digits:,} digits ({long_int.group()[:12]}...): out of "
                         f"range (at most {MAX_INT_DIGITS} digits)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what} is not valid JSON ({type(exc).__name__}: {str(exc)[:80]})") from None


def split_lines(text: str) -> list[str]:
    """Lines split on ``\\n`` (a trailing ``\\r`` removed), never on other control characters."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def parse_decimal(text: str, what: str, *, max_digits: int = 19) -> int:
    """An integer written in ASCII decimal digits (optional sign, spaces and tabs around it).

    ValueError names ``what`` and the text for anything else: ``5_000``, ``1e6``, non-ASCII
    digits, control characters, or more than ``max_digits`` digits.
    """
    core = text.strip(" \t")
    if not _DECIMAL.fullmatch(core):
        shown = core if len(core) <= 40 else core[:37] + "..."
        raise ValueError(f"{what}: {shown!r} is not an integer written in the digits 0-9")
    digits = len(core.lstrip("+-"))
    if digits > max_digits:
        raise ValueError(f"{what}: a number of {digits:,} digits ({core[:12]}...) is out of range "
                         f"(at most {max_digits} digits)")
    return int(core)


def bounded_int(value: Any, what: str, *, low: int, high: int) -> int:
    """``value`` as an int if it is an integer (not a bool or float) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} ({_short(value)}) must be an integer")
    if not low <= int(value) <= high:
        raise ValueError(f"{what} ({_short(value)}) must be between {low:,} and {high:,}")
    return int(value)


def _short(value: Any) -> str:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 10**30:
        return f"an integer of about {int(int(value).bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
