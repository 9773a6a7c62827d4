"""One device storage's offloaded copy, shared by every saved view of it (paper §5.2, D8).

Autograd saves *tensors*, but memory belongs to *storages*: megatron-core's attention output
and the ``[s, 1, h]`` view of it that ``linear_proj`` saves are two tensors over one storage.
Copying each saved tensor on its own moves the shared bytes twice and, in backward, reloads
them into two tensors (twice the resident bytes). So the unit of offload is the storage:

* :class:`OffloadedStorage` holds the bytes of one storage that saved views reference, each
  byte in exactly one place: a host buffer (copied device -> host once) or a device *tail*
  (a copy of the rows that stay, so the original storage can be freed);
* every view asks for the first ``host_bytes`` of its byte span on the host (the offload
  ratio's rows, decided by :mod:`.offload`); a byte goes to the host when any view asks for it
  there (a tail that a later view wants on the host is copied out and dropped), every other
  byte that some view references stays in a tail;
* in backward the storage is reloaded once, into one new device buffer, and every view is
  rebuilt from it with its own dtype, size, stride and storage offset
  (:class:`SavedActivation`);
* when a view of it must stay on the device (saved in a layer that is never offloaded, or a
  pipeline stage's input), the whole storage stays: its host copies are dropped and every view
  reads the original storage (:meth:`OffloadedStorage.make_resident`).

Storages are recognised by address *and* identity (a weak reference): once an offloaded
storage is freed, the caching allocator may hand its address to a new tensor in the same
forward, which is then a different storage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:  # pragma: no cover
    from .offload import MicroBatchOffload

_BASE_ALIGN = 64
"""The reloaded buffer starts this many bytes below the lowest byte held, rounded: any view's
storage offset then stays a whole number of its elements."""


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the bytes of its storage that ``tensor`` can read (its gaps included)."""
    size = tensor.element_size()
    first = tensor.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return first * size, (last + 1) * size


def storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat ``uint8`` tensor over the whole of ``storage`` (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


class _Piece:
    """Bytes ``[start, end)`` of the storage: on the host (``event`` = its D2H copy) or in a
    device ``tail``."""

    __slots__ = ("start", "end", "buffer", "host", "event", "tail")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.buffer = self.host = self.event = self.tail = None

    @property
    def on_host(self) -> bool:
        return self.host is not None


def _gaps(pieces: list[_Piece], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` that no piece holds."""
    gaps, at = [], lo
    for p in sorted(pieces, key=lambda p: p.start):
        if p.end <= at or p.start >= hi:
            continue
        if p.start > at:
            gaps.append((at, p.start))
        at = max(at, p.end)
    if at < hi:
        gaps.append((at, hi))
    return gaps


class OffloadedStorage:
    """The offloaded bytes of one storage saved in one micro-batch (module docstring)."""

    def __init__(self, mb: "MicroBatchOffload", storage: torch.UntypedStorage, layer: int) -> None:
        self.mb, self.layer = mb, layer
        self.ref = StorageWeakRef(storage)
        self.pieces: list[_Piece] = []
        self.full: torch.Tensor | None = None
        """After reload (or :meth:`make_resident`): a ``uint8`` buffer whose byte 0 is storage
        byte ``base``."""
        self.base = 0
        self.ready: list[Any] = []

    def is_storage(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is the very storage this copy was made from (still alive)."""
        return not self.ref.expired() and StorageWeakRef(storage) == self.ref

    @property
    def needs_reload(self) -> bool:
        """Neither reloaded nor kept on the device (both set :attr:`full`)."""
        return self.full is None

    def unheld_bytes(self, lo: int, hi: int) -> int:
        """How many bytes of ``[lo, hi)`` no piece holds yet."""
        return sum(e - s for s, e in _gaps(self.pieces, lo, hi))

    def cover(self, tensor: torch.Tensor, host_bytes: int) -> None:
        """Hold every byte ``tensor`` reads: its first ``host_bytes`` on the host, the rest
        (those no piece holds yet) in device tails."""
        lo, hi = byte_span(tensor)
        mid = min(hi, lo + max(0, host_bytes))
        src = storage_bytes(tensor.untyped_storage(), tensor.device)
        owner, counters = self.mb.owner, self.mb.counters
        if mid > lo:  # the host wins: tails inside [lo, mid) are copied out and dropped
            for p in [p for p in self.pieces if not p.on_host and p.start < mid and p.end > lo]:
                self.pieces.remove(p)
                owner.untrack_storage(p.tail)
                for s, e in ((p.start, max(p.start, lo)), (min(p.end, mid), p.end)):
                    if e > s:
                        self._add_tail(src, s, e)
            for s, e in _gaps(self.pieces, lo, mid):
                piece = _Piece(s, e)
                piece.buffer = owner.pool.acquire(e - s)
                piece.host = piece.buffer[: e - s]
                piece.event = owner.transfers.to_host(src[s:e], piece.host, keep_alive=tensor)
                self.pieces.append(piece)
                counters.offloaded_bytes += e - s
                counters.offloaded_tensors += 1
        for s, e in _gaps(self.pieces, mid, hi):
            self._add_tail(src, s, e)

    def _add_tail(self, src: torch.Tensor, start: int, end: int) -> None:
        piece = _Piece(start, end)
        piece.tail = src[start:end].clone()
        self.mb.owner.track_storage(piece.tail)
        self.pieces.append(piece)

    def reload(self) -> None:
        """Start copying the host pieces back (H2D stream) into one new device buffer."""
        owner = self.mb.owner
        lo = min(p.start for p in self.pieces)
        self.base = lo - lo % _BASE_ALIGN
        full = torch.empty(max(p.end for p in self.pieces) - self.base, dtype=torch.uint8,
                           device=owner.device)
        for p in self.pieces:
            dst = full[p.start - self.base: p.end - self.base]
            if p.on_host:
                event = owner.transfers.to_device(p.host, dst, after=p.event)
                owner.pool.release(p.buffer, ready=event)
                self.mb.counters.reloaded_bytes += p.end - p.start
                self.ready.append(event)
            else:
                dst.copy_(p.tail)
                owner.untrack_storage(p.tail)
        self.pieces = []
        self.full = full
        owner.track_storage(full)

    def make_resident(self, tensor: torch.Tensor) -> None:
        """A view of this storage must stay on the device: keep the whole storage (alive, as
        ``tensor`` reads it) and drop the copies; every view then reads the original."""
        owner = self.mb.owner
        for p in self.pieces:
            if p.on_host:
                owner.pool.release(p.buffer, ready=p.event)
            else:
                owner.untrack_storage(p.tail)
        self.pieces = []
        self.base = 0
        self.full = storage_bytes(tensor.untyped_storage(), tensor.device)
        owner.track_storage(self.full)

    def wait_ready(self) -> None:
        """Make the compute stream wait for this storage's reload (once)."""
        ready, self.ready = self.ready, []
        for event in ready:
            self.mb.owner.transfers.wait(event)

    def view(self, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...],
             offset_bytes: int) -> torch.Tensor:
        """The saved view rebuilt over the reloaded (or kept) bytes."""
        out = torch.empty(0, dtype=dtype, device=self.full.device)
        element = out.element_size()
        return out.set_(self.full.untyped_storage(), (offset_bytes - self.base) // element,
                        size, stride)

    def __del__(self) -> None:
        owner = self.mb.owner
        for p in self.pieces:  # never reloaded (no backward): the copies may still run
            if p.on_host:
                owner.pool.release(p.buffer, ready=p.event)
            else:
                owner.untrack_storage(p.tail)
        if self.full is not None:
            owner.untrack_storage(self.full)


class SavedActivation:
    """What the pack hook returns: the tensor itself (*resident*), or a view of an
    :class:`OffloadedStorage` (size, stride and storage offset, rebuilt in backward)."""

    __slots__ = ("mb", "layer", "kept", "tracked", "storage", "dtype", "size", "stride",
                 "offset_bytes", "__weakref__")

    def __init__(self, mb: "MicroBatchOffload", tensor: torch.Tensor, layer: int | None,
                 storage: OffloadedStorage | None = None, *, tracked: bool = False) -> None:
        self.mb, self.layer, self.storage = mb, layer, storage
        self.kept = tensor if storage is None else None
        self.tracked = tracked and storage is None
        if self.tracked:
            mb.owner.track_storage(tensor)
        self.dtype, self.size, self.stride = tensor.dtype, tuple(tensor.shape), tensor.stride()
        self.offset_bytes = tensor.storage_offset() * tensor.element_size()

    @property
    def offloaded(self) -> bool:
        return self.storage is not None

    def get(self) -> torch.Tensor:
        """The saved tensor, on the device, safe to use on the compute stream."""
        if self.kept is not None:
            return self.kept
        storage = self.storage
        if storage.needs_reload:  # its reload was not started ahead: the whole layer now
            self.mb.reload_layer(storage.layer, prefetch=False)
            if storage.needs_reload:
                storage.reload()
                self.mb.counters.on_demand_reloads += 1
        storage.wait_ready()
        return storage.view(self.dtype, self.size, self.stride, self.offset_bytes)

    def __del__(self) -> None:
        if self.kept is not None and self.tracked:
            self.mb.owner.untrack_storage(self.kept)
