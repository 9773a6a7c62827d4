"""Integers read from the environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_PORT``), checked where they are read.

torchrun sets these for its workers, but a shell or a job script can set them by hand, and a
bare ``int(os.environ[...])`` then fails with a traceback on every rank that names neither the
variable nor what to do. :func:`env_int` reads one strictly (ASCII digits, no sign, within
bounds) and raises :class:`ValueError` with one line naming the variable, its value and the fix.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

MAX_PROCESSES = 1 << 24
"""Largest world size, rank count or rank accepted (16M processes: far above any job)."""

MAX_PORT = 65535

_TORCHRUN = "torchrun sets it for each worker: unset it, or start the job with torchrun"


def env_int(name: str, *, low: int, high: int, default: Optional[int] = None, hint: str = _TORCHRUN,
            environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``int`` of the variable ``name``, or ``default`` when it is unset.

    Set but empty, signed, non-decimal (``1e3``, ``٣``) or outside ``[low, high]`` is refused:
    an empty ``RANK`` is not rank 0, it is a job script that lost a value.

    Raises:
        ValueError: one line: ``the environment variable NAME='value' must be ...; hint``.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if text.isascii() and text.isdigit() and len(text) <= 64 and low <= int(text) <= high:
        return int(text)
    shown = raw if len(raw) <= 40 else raw[:37] + "..."
    raise ValueError(f"the environment variable {name}={shown!r} must be an integer from {low} to "
                     f"{high:,}; {hint}")


def env_text(name: str, *, hint: str = _TORCHRUN, environ: Optional[Mapping[str, str]] = None) -> str:
    """The value of a variable that must be set and non-empty (``MASTER_ADDR``)."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "")
    if not raw.strip():
        raise ValueError(f"the environment variable {name} is {'empty' if name in env else 'unset'}; "
                         f"{hint}")
    return raw.strip()


def omp_num_threads(environ: Optional[Mapping[str, str]] = None) -> int:
    """``OMP_NUM_THREADS`` for the workers a launcher starts: 1 when unset or empty (what the
    launchers pass on), else a number of threads. libgomp only warns about a bad value, once per
    process, and runs with its default; the launchers refuse it instead."""
    env = os.environ if environ is None else environ
    threads = env.get("OMP_NUM_THREADS") or "1"
    if not (threads.isascii() and threads.isdigit() and len(threads) <= 5 and 1 <= int(threads) <= 4096):
        raise ValueError(f"the environment variable OMP_NUM_THREADS={threads!r} must be a number of "
                         "threads >= 1 (or unset)")
    return int(threads)
