"""Fast positional constructors for the planner's frozen, slotted dataclasses.

A frozen dataclass's generated ``__init__`` sets every field through ``object.__setattr__``,
which costs about three times what setting the slots directly does. The planner builds tens of
thousands of such objects per step (units, placements, pieces, micro-batches), so that
difference is a sizeable part of planning time. The objects built here are equal to, and hash
like, ones built normally; classes that validate in ``__post_init__`` are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def slot_constructor(cls: type, fields: tuple[str, ...]) -> Callable[..., Any]:
    """A function ``make(v1, ..., vk)`` that builds ``cls`` with ``fields`` set to the values
    (positionally); every other field gets its default, so a field added to ``cls`` later is
    never left unset (a field without a default must be among ``fields``)."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} validates in __post_init__; build it normally")
    rest = []
    for f in dataclasses.fields(cls):
        if f.name in fields:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no plain default: pass it to "
                            "slot_constructor")
        rest.append((getattr(cls, f.name).__set__, f.default))
    if rest:  # the general path sets the defaults after the given fields
        return _with_defaults(cls, fields, tuple(rest))
    new = object.__new__
    setters = tuple(getattr(cls, f).__set__ for f in fields)
    if len(fields) == 2:
        s0, s1 = setters

        def make2(a: Any, b: Any) -> Any:
            obj = new(cls)
            s0(obj, a)
            s1(obj, b)
            return obj
        return make2
    if len(fields) == 3:
        s0, s1, s2 = setters

        def make3(a: Any, b: Any, c: Any) -> Any:
            obj = new(cls)
            s0(obj, a)
            s1(obj, b)
            s2(obj, c)
            return obj
        return make3
    if len(fields) == 5:
        s0, s1, s2, s3, s4 = setters

        def make5(a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
            obj = new(cls)
            s0(obj, a)
            s1(obj, b)
            s2(obj, c)
            s3(obj, d)
            s4(obj, e)
            return obj
        return make5
    if len(fields) == 6:
        s0, s1, s2, s3, s4, s5 = setters

        def make6(a: Any, b: Any, c: Any, d: Any, e: Any, f: Any) -> Any:
            obj = new(cls)
            s0(obj, a)
            s1(obj, b)
            s2(obj, c)
            s3(obj, d)
            s4(obj, e)
            s5(obj, f)
            return obj
        return make6

    def make(*values: Any) -> Any:
        if len(values) != len(setters):
            raise TypeError(f"{cls.__name__} needs {len(setters)} values, got {len(values)}")
        obj = new(cls)
        for s, v in zip(setters, values):
            s(obj, v)
        return obj
    return make


def _with_defaults(cls: type, fields: tuple[str, ...],
                   rest: tuple[tuple[Callable[[Any, Any], None], Any], ...]) -> Callable[..., Any]:
    new = object.__new__
    setters = tuple(getattr(cls, f).__set__ for f in fields)
    if len(fields) == 5 and len(rest) == 1:  # MicroBatch (chunk defaults): one per member of every ring
        s0, s1, s2, s3, s4 = setters
        (r0, v0), = rest

        def make5d(a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
            obj = new(cls)
            s0(obj, a)
            s1(obj, b)
            s2(obj, c)
            s3(obj, d)
            s4(obj, e)
            r0(obj, v0)
            return obj
        return make5d

    def make(*values: Any) -> Any:
        if len(values) != len(setters):
            raise TypeError(f"{cls.__name__} needs {len(setters)} values, got {len(values)}")
        obj = new(cls)
        for s, v in zip(setters, values):
            s(obj, v)
        for s, v in rest:
            s(obj, v)
        return obj
    return make
