"""Find host syncs on CPU: the calls that would make the host wait for a GPU (DESIGN.md D12).

On a GPU the hot path must never (a) read a device value back to the host (``.item()``,
``int()`` / ``float()`` / ``bool()`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``,
``.to("cpu")``; values of a host copy made that way are not counted again) nor (b) copy host
data to the device with a blocking copy (``.to(device)`` or ``.cuda()`` without
``non_blocking=True``, ``torch.tensor(..., device=...)``): both wait for the device, and
``torch.cuda.set_sync_debug_mode("error")`` rejects them.

On CPU every tensor is a host tensor, so such calls cost nothing and no CUDA tool can flag
them. :func:`host_syncs` patches those entry points for the duration of a ``with`` block and
records (``mode="count"``) or refuses (``mode="raise"``) every call, so a CPU test proves the
block makes none. Reads back count wherever they are made (a Megatron ``.item()`` syncs as
much as ours); blocking copies count only from this package's code, since on a GPU Megatron's
``.to(device)`` calls move tensors that already live on the device. It is deliberately strict:
a ``.to(device)`` that would be a device-to-device no-op on a GPU counts too; code that means
it passes ``non_blocking=True``, which costs nothing. Copies from the host the hot path does
need go through ``backends.host_to_device`` (pinned, non-blocking; the tensor itself on CPU).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["HostSync", "HostSyncError", "host_syncs"]

_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "cpu")
_COPIES = ("to", "cuda")  # copy_ between existing buffers is device to device in the hot path
_FACTORIES = ("tensor", "as_tensor")


class HostSyncError(AssertionError):
    """A call that would make the host wait for the device ran inside :func:`host_syncs`."""


@dataclass
class HostSync:
    """What :func:`host_syncs` saw: one entry per call, ``"<what> at <file>:<line>"``."""

    calls: list[str] = field(default_factory=list)

    @property
    def reads(self) -> list[str]:
        return [c for c in self.calls if c.startswith("read")]

    @property
    def copies(self) -> list[str]:
        return [c for c in self.calls if c.startswith("blocking copy")]


def _is_device(value: Any) -> bool:
    return isinstance(value, (torch.device, torch.Tensor)) or (
        isinstance(value, (str, int)) and not isinstance(value, bool)
    )


def _copy_target(name: str, args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """(moves to a device, to the host) for ``Tensor.<name>(*args, **kwargs)``."""
    if name == "cuda":
        return True, False
    target = kwargs.get("device")
    if target is None:
        for value in args:
            if isinstance(value, torch.dtype):
                continue
            if _is_device(value):
                target = value
                break
    if target is None:
        return False, False  # a dtype change only
    if isinstance(target, (torch.Tensor, torch.device, int)):
        # a device taken from data (``x.device``, ``.to(x)``) is the GPU on a GPU run, even
        # though it is the CPU here: a copy there, never a read back
        return True, False
    return True, torch.device(target).type == "cpu"


def _ours(site: str) -> bool:
    """Whether a call site is this package's code (tests and ``testing/`` count as ours too,
    so the guard's own tests see the calls they make)."""
    path = site.replace("\\", "/")
    return "/megatron_bytescale/" in path or "/tests/" in path


_SHIM = "cpu_compat.py"  # testing.cpu_compat re-issues Megatron's CUDA calls for the CPU


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "host_sync.py" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def host_syncs(mode: str = "raise") -> Iterator[HostSync]:
    """Record (``"count"``) or refuse (``"raise"``) host syncs made in this thread (module
    docstring). Other threads (a background planner) are not watched."""
    if mode not in ("raise", "count"):
        raise ValueError(f"mode must be 'raise' or 'count', got {mode!r}")
    seen = HostSync()
    owner = threading.get_ident()
    saved: list[tuple[Any, str, Any]] = []
    host_copies: dict[int, torch.Tensor] = {}  # by id (kept alive): read back once already

    def note(what: str) -> None:
        if threading.get_ident() != owner:
            return
        site = _site()
        if site.rsplit(":", 1)[0].endswith(_SHIM):
            return  # the CPU stand-in's rewrite of a call already judged where it was made
        if what.startswith("blocking copy") and not _ours(site):
            return  # Megatron's own .to(device) calls move device tensors on a GPU
        entry = f"{what} at {site}"
        seen.calls.append(entry)
        if mode == "raise":
            raise HostSyncError(f"host sync in the hot path: {entry}")

    def read(name: str, original: Callable) -> Callable:
        def method(self, *args, **kwargs):
            if id(self) not in host_copies:  # values of an explicit host copy cost nothing more
                note(f"read Tensor.{name}")
            result = original(self, *args, **kwargs)
            if name == "cpu" and isinstance(result, torch.Tensor):
                host_copies[id(result)] = result
            return result

        return method

    def copy(name: str, original: Callable) -> Callable:
        def method(self, *args, **kwargs):
            to_device, to_host = _copy_target(name, args, kwargs)
            if to_host and id(self) not in host_copies:
                note(f"read Tensor.{name}(cpu)")
            elif to_device and not to_host and not kwargs.get("non_blocking", False):
                note(f"blocking copy Tensor.{name}")
            result = original(self, *args, **kwargs)
            if to_host and isinstance(result, torch.Tensor):
                host_copies[id(result)] = result
            return result

        return method

    def factory(name: str, original: Callable) -> Callable:
        def function(*args, **kwargs):
            if kwargs.get("device") is not None:
                note(f"blocking copy torch.{name}(device=...)")
            return original(*args, **kwargs)

        return function

    for name in _READS:
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, read(name, getattr(torch.Tensor, name)))
    for name in _COPIES:
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, copy(name, getattr(torch.Tensor, name)))
    for name in _FACTORIES:
        saved.append((torch, name, getattr(torch, name)))
        setattr(torch, name, factory(name, getattr(torch, name)))
    try:
        yield seen
    finally:
        for owner_obj, name, original in reversed(saved):
            setattr(owner_obj, name, original)
