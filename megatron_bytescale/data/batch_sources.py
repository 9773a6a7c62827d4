"""Where a source of global batches starts: seeking step k, for resuming and for the Ray loader.

A source is an iterable of global batches from step 0 (a list, a generator), or a function
``start_step -> iterable`` that yields them from ``start_step`` on. A function can seek cheaply
(e.g. by walking document lengths); an iterable is read from its start and its first k batches
are dropped; a one-shot iterator (a generator) cannot go back once read. The Ray loader sends
the source to other processes, so there it must be a function (or a list, wrapped in one).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional, Union

from .batch import GlobalBatch, TokenSequence

BatchSource = Union[
    Iterable[Union[GlobalBatch, Sequence[TokenSequence]]],
    Callable[[int], Iterable[Union[GlobalBatch, Sequence[TokenSequence]]]],
]
"""Global batches: an iterable from step 0, or a function ``start_step -> iterable``."""


def is_seekable(source: Any) -> bool:
    """A function ``start_step -> iterable`` (callable, not itself iterable)."""
    return callable(source) and not hasattr(source, "__iter__")


def open_source(source: Any, step: int) -> Iterator[Any]:
    """An iterator whose first batch is global step ``step`` of ``source`` (read lazily)."""
    if is_seekable(source):
        return _LazyIterator(lambda: source(step))
    if step:
        return itertools.islice(iter(source), step, None)  # read and dropped lazily
    return iter(source)


def is_one_shot(source: Any) -> bool:
    """An iterator that cannot be read again from its start (``iter(x) is x``)."""
    if is_seekable(source):
        return False
    try:
        return iter(source) is source
    except TypeError:
        return True


def checked_step(value: Any, name: str) -> int:
    """``value`` as a step count, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} ({value!r}) must be an integer >= 0 (a number of trained steps)")
    return value


def ray_source(source: Any) -> Callable[[int], Iterable[Any]]:
    """The source as the Ray loader's reader actors run it: a function ``start_step -> iterable``."""
    if is_seekable(source):
        return source
    if isinstance(source, Sequence):
        return functools.partial(list_batches, list(source))
    raise ValueError(
        f"dataloader='ray' runs the source in reader actors (other processes), so it must be a "
        f"function start_step -> iterable of global batches (or a list), not a "
        f"{type(source).__name__}: a generator or iterator cannot be sent to another process"
    )


def list_batches(batches: Sequence[Any], start_step: int) -> Iterator[Any]:
    """The batches of a list from ``start_step`` on (a list as a seekable source)."""
    return itertools.islice(iter(batches), start_step, None)


class _LazyIterator:
    """Iterates ``make()``, called on the first ``next()`` (on the thread that reads)."""

    def __init__(self, make: Callable[[], Iterable[Any]]) -> None:
        self._make: Optional[Callable[[], Iterable[Any]]] = make
        self._it: Optional[Iterator[Any]] = None

    def __iter__(self) -> "_LazyIterator":
        return self

    def __next__(self) -> Any:
        if self._it is None:
            assert self._make is not None
            self._it, self._make = iter(self._make()), None
        return next(self._it)
