"""Host buffers for offloaded activations, reused across micro-batches and steps (paper §5.2).

Allocating pinned host memory (``cudaHostAlloc``) costs milliseconds and synchronises the device,
so ByteScale keeps a cache of pinned buffers. :class:`HostBufferPool` hands out ``uint8``
buffers by size class and takes them back once the copy that last used them is complete:

* sizes are rounded up to one of eight classes per power of two (at most 12.5% waste, and
  at least 4 KiB), so micro-batches of slightly different lengths share buffers;
* :meth:`acquire` takes the smallest free buffer of at least the requested size and at most
  twice it (best fit), else allocates a new one of the class size;
* :meth:`release` takes a buffer back together with the event of the copy that last read it;
  the buffer is free for reuse only when that event has completed (``query()``, never a
  blocking wait). On CPU the copies are synchronous and the event is ``None``.

The pool only grows when more bytes are in flight at once than ever before (or a size class
is new): after the first step of a steady workload it stops allocating. ``capacity_bytes``
and ``num_buffers`` say how big it is, ``peak_in_use_bytes`` how much a step needed.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

_MIN_CLASS = 4096


def size_class(num_bytes: int) -> int:
    """``num_bytes`` rounded up to the pool's size class (eight classes per power of two)."""
    if num_bytes <= _MIN_CLASS:
        return _MIN_CLASS
    top = 1 << (int(num_bytes) - 1).bit_length()
    step = max(_MIN_CLASS, top // 8)
    return -(-int(num_bytes) // step) * step


class HostBufferPool:
    """Reusable host buffers (pinned when ``pin_memory``) for device <-> host activation copies."""

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = bool(pin_memory)
        self._free_sizes: list[int] = []  # sorted sizes of free buffers (parallel to _free)
        self._free: list[torch.Tensor] = []
        self._pending: list[tuple[torch.Tensor, Any]] = []
        self.capacity_bytes = 0
        self.num_buffers = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0

    def acquire(self, num_bytes: int) -> torch.Tensor:
        """A ``uint8`` host buffer of at least ``num_bytes`` bytes (exclusive until released)."""
        if num_bytes < 1:
            raise ValueError(f"a host buffer needs at least 1 byte, asked for {num_bytes}")
        self._reclaim()
        i = bisect.bisect_left(self._free_sizes, num_bytes)
        if i < len(self._free_sizes) and self._free_sizes[i] <= 2 * size_class(num_bytes):
            self._free_sizes.pop(i)
            buffer = self._free.pop(i)
        else:
            size = size_class(num_bytes)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.capacity_bytes += size
            self.num_buffers += 1
            self.allocations += 1
        self.in_use_bytes += buffer.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, ready: Any = None) -> None:
        """Give ``buffer`` back; it is reused once ``ready`` (an event with ``query()``) completed."""
        self.in_use_bytes -= buffer.numel()
        if ready is None:
            self._add_free(buffer)
        else:
            self._pending.append((buffer, ready))

    def reset_peak(self) -> None:
        """Start a new peak measurement (at a step boundary)."""
        self.peak_in_use_bytes = self.in_use_bytes

    def _reclaim(self) -> None:
        if not self._pending:
            return
        still = []
        for buffer, event in self._pending:
            if event.query():
                self._add_free(buffer)
            else:
                still.append((buffer, event))
        self._pending = still

    def _add_free(self, buffer: torch.Tensor) -> None:
        i = bisect.bisect_left(self._free_sizes, buffer.numel())
        self._free_sizes.insert(i, buffer.numel())
        self._free.insert(i, buffer)
