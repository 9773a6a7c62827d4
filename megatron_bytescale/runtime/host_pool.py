"""Host buffers for offloaded activations, reused across micro-batches and steps (paper §5.2).

Allocating pinned host memory (``cudaHostAlloc``) costs milliseconds and synchronises the device,
so ByteScale keeps its pinned memory. :class:`HostBufferPool` carves ``uint8`` buffers out of a
few large **slabs** and takes them back once the copy that last used them is complete:

* every slab is a power of two bytes. PyTorch's pinned allocator (``CachingHostAllocator``)
  rounds every block it pins up to a power of two, so a slab of any other size would pin up
  to twice what it asks for; a power-of-two slab pins exactly its size, and
  ``capacity_bytes`` (the sum of the slabs) is what is really pinned;
* buffers are carved first-fit from the slabs' free extents (offsets aligned to 512 bytes),
  and a released buffer's extent merges with its free neighbours. Offloaded activations come
  back in roughly the reverse order they left, so the slabs do not fragment;
* a new slab is the larger of the request (rounded up to a power of two), ``min_slab_bytes``
  and half the capacity so far (a few large slabs, not one per tensor);
* ``limit_bytes`` (the host budget of Eq. 3, ``--bytescale-host-memory-gb``, which the planner
  compares with the activation bytes it offloads) caps the slabs: a new slab is at most the
  largest power of two that still fits under the limit; past the limit the pool still serves
  the request (training does not fail), warns once and counts ``over_limit_bytes``;
* :meth:`release` takes a buffer back together with the event of the copy that last read it;
  its extent is free for reuse only when that event has completed (``query()``, never a
  blocking wait). On CPU the copies are synchronous and the event is ``None``.

The pool only grows when more bytes are in flight at once than ever before: after the first
step of a steady workload it stops allocating. ``capacity_bytes`` and ``num_buffers`` (slabs)
say how big it is, ``peak_in_use_bytes`` how much a step needed.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

ALIGN = 512
MIN_SLAB_BYTES = 1 << 20


def pinned_bytes(num_bytes: int) -> int:
    """Bytes PyTorch's pinned allocator really pins for a request of ``num_bytes``: the next
    power of two (``CachingHostAllocator`` rounds every block up to one)."""
    if num_bytes < 1:
        return 0
    return 1 << (int(num_bytes) - 1).bit_length()


def _aligned(num_bytes: int) -> int:
    return -(-int(num_bytes) // ALIGN) * ALIGN


class HostBufferPool:
    """Reusable host buffers (pinned when ``pin_memory``) for device <-> host activation copies.

    Args:
        pin_memory: pin the slabs (CUDA); CPU runs use ordinary memory.
        limit_bytes: the host budget; slabs stay under it while they can (module docstring).
        min_slab_bytes: the smallest slab (a power of two), so small tensors share one.
    """

    def __init__(
        self,
        *,
        pin_memory: bool,
        limit_bytes: Optional[float] = None,
        min_slab_bytes: int = MIN_SLAB_BYTES,
    ) -> None:
        if limit_bytes is not None and not limit_bytes > 0:
            raise ValueError(f"limit_bytes must be a positive number of bytes, got {limit_bytes}")
        if pinned_bytes(min_slab_bytes) != min_slab_bytes:
            raise ValueError(f"min_slab_bytes must be a power of two, got {min_slab_bytes}")
        self.pin_memory = bool(pin_memory)
        self.limit_bytes = None if limit_bytes is None else int(limit_bytes)
        self.min_slab_bytes = int(min_slab_bytes)
        self._slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (offset, size)
        self._extent: dict[int, tuple[int, int, int, torch.Tensor]] = {}  # id -> slab, off, size
        self._pending: list[tuple[torch.Tensor, Any]] = []
        self.capacity_bytes = 0
        self.num_buffers = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0
        self.over_limit_bytes = 0

    def acquire(self, num_bytes: int) -> torch.Tensor:
        """A ``uint8`` host buffer of at least ``num_bytes`` bytes (exclusive until released)."""
        if num_bytes < 1:
            raise ValueError(f"a host buffer needs at least 1 byte, asked for {num_bytes}")
        self._reclaim()
        size = _aligned(num_bytes)
        found = self._first_fit(size)
        if found is None:
            found = (self._new_slab(size), 0)
        slab, offset = found
        self._take(slab, offset, size)
        buffer = self._slabs[slab][offset : offset + size]
        self._extent[id(buffer)] = (slab, offset, size, buffer)
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, ready: Any = None) -> None:
        """Give ``buffer`` back; it is reused once ``ready`` (an event with ``query()``) completed."""
        if id(buffer) not in self._extent:
            raise ValueError("HostBufferPool.release: this buffer was not acquired from this pool")
        self.in_use_bytes -= self._extent[id(buffer)][2]
        if ready is None:
            self._give_back(buffer)
        else:
            self._pending.append((buffer, ready))

    def reset_peak(self) -> None:
        """Start a new peak measurement (at a step boundary)."""
        self.peak_in_use_bytes = self.in_use_bytes

    @property
    def pending_buffers(self) -> list[torch.Tensor]:
        """Released buffers whose last copy may still run (not reusable yet)."""
        return [buffer for buffer, _ in self._pending]

    @property
    def slab_sizes(self) -> list[int]:
        """The size of every slab, in allocation order (each a power of two)."""
        return [int(s.numel()) for s in self._slabs]

    # ------------------------------------------------------------------ internals
    def _first_fit(self, size: int) -> Optional[tuple[int, int]]:
        for slab, extents in enumerate(self._free):
            for offset, free in extents:
                if free >= size:
                    return slab, offset
        return None

    def _new_slab(self, size: int) -> int:
        need = pinned_bytes(size)
        # grow by about half the capacity each time: few slabs, each carved by many buffers
        want = max(self.min_slab_bytes, need, pinned_bytes(self.capacity_bytes // 2))
        if self.limit_bytes is not None:
            room = self.limit_bytes - self.capacity_bytes
            largest = 1 << (room.bit_length() - 1) if room > 0 else 0  # power of two <= room
            if largest >= need:
                want = min(want, largest)
            else:
                want = need
                if not self.over_limit_bytes:
                    logger.warning(
                        "offloaded activations need more pinned host memory than the host budget "
                        "(%d bytes): pinning %d bytes beyond it; raise --bytescale-host-memory-gb",
                        self.limit_bytes, want,
                    )  # fmt: skip
                self.over_limit_bytes += want
        slab = torch.empty(want, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._slabs.append(slab)
        self._free.append([(0, want)])
        self.capacity_bytes += want
        self.num_buffers += 1
        self.allocations += 1
        return len(self._slabs) - 1

    def _take(self, slab: int, offset: int, size: int) -> None:
        extents = self._free[slab]
        i = next(i for i, (o, _) in enumerate(extents) if o == offset)
        o, free = extents.pop(i)
        if free > size:
            extents.insert(i, (o + size, free - size))

    def _give_back(self, buffer: torch.Tensor) -> None:
        slab, offset, size, _ = self._extent.pop(id(buffer))
        extents = self._free[slab]
        i = bisect.bisect_left(extents, (offset, 0))
        extents.insert(i, (offset, size))
        if i + 1 < len(extents) and extents[i][0] + extents[i][1] == extents[i + 1][0]:
            extents[i] = (extents[i][0], extents[i][1] + extents.pop(i + 1)[1])
        if i > 0 and extents[i - 1][0] + extents[i - 1][1] == extents[i][0]:
            extents[i - 1] = (extents[i - 1][0], extents[i - 1][1] + extents.pop(i)[1])

    def _reclaim(self) -> None:
        if not self._pending:
            return
        still = []
        for buffer, event in self._pending:
            if event.query():
                self._give_back(buffer)
            else:
                still.append((buffer, event))
        self._pending = still
