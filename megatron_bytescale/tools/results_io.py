"""Writing a command's results so that a failed write never loses them.

A run can take hours and its results are written at its very end, when a full disk, a
read-only mount or a removed directory is discovered too late to rerun. :func:`save_or_print`
writes to a temporary file next to the target and renames it over the target (a reader never
sees half a file, an old file survives a failed write); if that fails, it prints the text to
stdout and says on stderr where it could not go, so the results are still in the terminal or
the job's log.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_or_print(path: str | Path, text: str, *, what: str, prog: str) -> bool:
    """Write ``text`` (the ``what``, e.g. "results JSON") to ``path``; on failure print it to
    stdout and one line on stderr naming ``path`` and the reason. Returns whether it was saved."""
    try:
        write_atomically(path, text)
        return True
    except OSError as exc:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        print(f"{prog}: could not write the {what} to {str(path)!r} ({exc.strerror or exc}); "
              "it is printed above on stdout instead", file=sys.stderr, flush=True)
        return False
