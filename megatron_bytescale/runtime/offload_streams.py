"""Device <-> host copies of activations on their own streams (paper §5.2 "act_ctx", DESIGN D8).

ByteScale keeps two CUDA streams next to the compute stream: one for D2H (offload in forward),
one for H2D (reload in backward), so that the copies run on the DMA engines while kernels and
NCCL run. The ordering rules are the whole difficulty, so they live in one class,
:class:`ActivationTransfers`, written against a tiny stream interface:

* **offload** (``to_host``): the D2H stream first waits for the compute stream (the tensor is
  produced there), copies into a host buffer, records an event, and marks the source tensor as
  used by the D2H stream (``record_stream``) so the caching allocator does not hand its memory
  to a new tensor before the copy has read it;
* **reload** (``to_device``): the H2D stream waits for the compute stream (the destination was
  allocated there) and for the offload's event (the host buffer must be complete), copies,
  records an event and marks the destination as used by the H2D stream;
* **use** (``wait``): the compute stream waits for the reload's event before the backward
  touches the tensor. Nothing here blocks the host: events are waited for by streams, and
  ``query()`` only looks. When the reload was not finished yet, the stall is timed with two
  timing events on the compute stream, read once they have completed (never waited for).

Two implementations of the stream interface: :class:`CudaStreamOps` (``torch.cuda`` streams and
events, pinned host memory, non-blocking copies) and :class:`HostStreamOps` for CPU runs, where
the "device" tensor is copied synchronously into a separate host buffer and back, the streams
are labels and every event is complete when recorded. The CPU tests therefore run the same
ordering code as a GPU (and can inject a recording stream interface to check the order).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Protocol

import torch


class StreamOps(Protocol):
    """The stream primitives :class:`ActivationTransfers` needs (CUDA or host stand-ins)."""

    non_blocking: bool
    pin_memory: bool

    def current_stream(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def use(self, stream: Any) -> ContextManager[Any]: ...

    def new_event(self, *, timing: bool = False) -> Any: ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaStreamOps:
    """``torch.cuda`` streams and events on ``device``; pinned host buffers, async copies."""

    non_blocking = True
    pin_memory = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def use(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self, *, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class HostStream:
    """A stand-in stream for CPU runs: work submitted to it has already happened."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: "HostStream") -> None:
        """Nothing to wait for: every copy finished when its call returned."""

    def wait_event(self, event: "HostEvent") -> None:
        """Nothing to wait for (see :meth:`wait_stream`)."""


class HostEvent:
    """A stand-in event: complete as soon as recorded; times are host clock readings."""

    def __init__(self) -> None:
        self.time_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time_s = time.perf_counter()

    def query(self) -> bool:
        return self.time_s is not None

    def synchronize(self) -> None:
        """Already complete."""

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to ``end`` (CUDA's unit)."""
        return 1e3 * ((end.time_s or 0.0) - (self.time_s or 0.0))


class HostStreamOps:
    """CPU stand-ins: synchronous copies into plain host buffers; streams are labels."""

    non_blocking = False
    pin_memory = False

    def __init__(self) -> None:
        self._compute = HostStream("compute")
        self._count = 0

    def current_stream(self) -> HostStream:
        return self._compute

    def new_stream(self) -> HostStream:
        self._count += 1
        return HostStream(f"copy{self._count}")

    def use(self, stream: Any) -> ContextManager[Any]:
        return contextlib.nullcontext(stream)

    def new_event(self, *, timing: bool = False) -> HostEvent:
        return HostEvent()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """The copy already read or wrote ``tensor``; nothing to protect."""


def stream_ops_for(device: torch.device) -> StreamOps:
    """:class:`CudaStreamOps` for a CUDA device, :class:`HostStreamOps` otherwise."""
    if device.type == "cuda":
        return CudaStreamOps(device)
    return HostStreamOps()


class ActivationTransfers:
    """The D2H / H2D streams of one offloader and the ordering between them and compute."""

    def __init__(self, ops: StreamOps) -> None:
        self.ops = ops
        self.d2h = ops.new_stream()
        self.h2d = ops.new_stream()
        self.d2h_s = 0.0
        """Host seconds spent in offload copy calls (the copies themselves on CPU, launches on CUDA)."""
        self.h2d_s = 0.0
        """Host seconds spent in reload copy calls (likewise)."""
        self._stalls: list[tuple[Any, Any]] = []

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, *, keep_alive: torch.Tensor) -> Any:
        """Copy device ``src`` into host ``dst`` on the D2H stream; returns the copy's event.

        ``keep_alive`` is the tensor whose memory ``src`` lives in (the caller drops it).
        """
        start = time.perf_counter()
        compute = self.ops.current_stream()
        self.d2h.wait_stream(compute)
        with self.ops.use(self.d2h):
            dst.copy_(src, non_blocking=self.ops.non_blocking)
            self.ops.record_stream(keep_alive, self.d2h)
            event = self.ops.new_event()
            event.record(self.d2h)
        self.d2h_s += time.perf_counter() - start
        return event

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, *, after: Any) -> Any:
        """Copy host ``src`` into device ``dst`` on the H2D stream once ``after`` (the offload's
        event) completed; returns the copy's event."""
        start = time.perf_counter()
        compute = self.ops.current_stream()
        self.h2d.wait_stream(compute)
        if after is not None:
            self.h2d.wait_event(after)
        with self.ops.use(self.h2d):
            dst.copy_(src, non_blocking=self.ops.non_blocking)
            self.ops.record_stream(dst, self.h2d)
            event = self.ops.new_event()
            event.record(self.h2d)
        self.h2d_s += time.perf_counter() - start
        return event

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event``; time the stall if it was not complete."""
        compute = self.ops.current_stream()
        if event.query():
            compute.wait_event(event)
            return
        begin = self.ops.new_event(timing=True)
        end = self.ops.new_event(timing=True)
        begin.record(compute)
        compute.wait_event(event)
        end.record(compute)
        self._stalls.append((begin, end))

    def take_wait_seconds(self) -> float:
        """Seconds the computation waited for reloads, counted since the last call.

        Asynchronous copies (CUDA): the compute stream's stalls, read from their timing events
        once those have completed; a stall whose events the device has not reached yet is
        counted by a later call (no host synchronisation, D12). Synchronous copies (CPU): the
        reload copies themselves, which the computing thread runs.
        """
        total = 0.0
        pending = []
        for begin, end in self._stalls:
            if end.query():
                total += begin.elapsed_time(end) / 1e3
            else:
                pending.append((begin, end))
        self._stalls = pending
        if not self.ops.non_blocking:
            total += self.h2d_s
        return total

    def take_copy_seconds(self) -> float:
        """Host seconds spent in copy calls (offload and reload) since the last call."""
        out = self.d2h_s + self.h2d_s
        self.d2h_s = self.h2d_s = 0.0
        return out
