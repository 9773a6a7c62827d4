"""Stream-ordered process groups on gloo: what NCCL's one-stream-per-communicator does, on CPU.

Why: on NCCL, every operation a rank issues on one process group (collectives and batched
P2P alike) runs on that group's stream, so it starts only after the operation this rank issued
before it on the same group has finished. Gloo has no such order: its P2P and collectives
progress independently, so a CPU test cannot see a deadlock that needs it (a ring send queued
behind a gradient all-reduce that a ring peer will only join after the ring finishes).

:func:`stream_ordered` runs the chosen gloo groups that way. While it is active, every
``torch.distributed`` operation on one of them (``all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``broadcast``, ``barrier``, ``isend`` / ``irecv`` / ``send`` /
``recv``, ``batch_isend_irecv``, the ops inside ``_coalescing_manager``) is handed to one worker
thread per group, which runs the real gloo operation to completion before it starts the next
one, in issue order. The caller gets an asynchronous handle, as on NCCL:

* a ``batch_isend_irecv`` is ONE stream item (NCCL issues it as one group call), and completes
  when all of its sends and receives have (gloo's sends wait for the matching receive, so an
  item never completes on a message nobody takes);
* an operation with ``async_op=False`` blocks the caller until it completes. On NCCL it only
  enqueues; blocking is stricter, so a run that completes here has an order NCCL can also run;
* ``handle.wait()`` raises :class:`StreamOrderDeadlock` after ``timeout_s`` naming the stuck
  operation and what is queued ahead of it on this rank's stream: a deadlock becomes an error
  in seconds, not a hang.

It models the per-communicator order only: not SM scheduling between concurrent NCCL kernels
of different communicators (which Megatron's own overlapped pipelines rely on as well).

The patch replaces the functions in ``torch.distributed`` and wherever a loaded module holds
them under another name (Megatron binds ``reduce_scatter_tensor`` as
``dist_reduce_scatter_func``), and restores them on exit. Groups that are not emulated pass
through untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["StreamOrderDeadlock", "StreamOrderedGroups", "stream_ordered"]

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "barrier",
)
_P2P = ("isend", "irecv", "send", "recv")


class StreamOrderDeadlock(RuntimeError):
    """An operation on a stream-ordered group did not complete within the time limit."""


class _Handle:
    """The asynchronous handle of one stream item (what a ``Work`` is to its caller)."""

    def __init__(self, stream: "_Stream", label: str) -> None:
        self._stream, self.label = stream, label
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.issued_at = time.monotonic()

    def _finish(self, error: Optional[BaseException]) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        if not self._done.wait(self._stream.timeout_s):
            raise StreamOrderDeadlock(self._stream.describe(self))
        if self._error is not None:
            raise RuntimeError(f"{self.label} failed on a stream-ordered group") from self._error
        return True


class _Stream:
    """One group's stream on this rank: a worker thread running items in issue order."""

    def __init__(self, name: str, timeout_s: float, local: threading.local) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._queue: "queue.Queue[tuple[_Handle, Callable[[], None]] | None]" = queue.Queue()
        self._pending: list[_Handle] = []  # issued, not finished, in issue order
        self._lock = threading.Lock()
        self._local = local
        self.items = 0
        self._thread = threading.Thread(target=self._run, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def submit(self, label: str, run: Callable[[], None]) -> _Handle:
        handle = _Handle(self, label)
        with self._lock:
            self._pending.append(handle)
            self.items += 1
        self._queue.put((handle, run))
        return handle

    def _run(self) -> None:
        self._local.in_worker = True
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, run = item
            error = None
            try:
                run()
            except BaseException as exc:  # handed to whoever waits
                error = exc
            with self._lock:
                self._pending.remove(handle)
            handle._finish(error)

    def describe(self, stuck: _Handle) -> str:
        with self._lock:
            pending = list(self._pending)
        ahead = [h.label for h in pending[: pending.index(stuck)]] if stuck in pending else []
        return (
            f"rank {dist.get_rank()}: {stuck.label} on stream-ordered group {self.name} did not "
            f"complete within {self.timeout_s:g} s; ahead of it on this group's stream: "
            f"{ahead or 'nothing (its peers never issued the matching operation)'}"
        )

    def close(self) -> None:
        self._queue.put(None)


class _Coalesced:
    """What ``_coalescing_manager`` yields for an emulated group: the handles issued inside."""

    def __init__(self) -> None:
        self.works: list[_Handle] = []

    def append(self, work: Optional[_Handle]) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class StreamOrderedGroups:
    """The active emulation (see the module docstring); made by :func:`stream_ordered`."""

    def __init__(self, groups: dict[Any, str], timeout_s: float) -> None:
        self._local = threading.local()
        self._streams = {id(g): _Stream(name, timeout_s, self._local) for g, name in groups.items()}
        self._groups = dict(groups)
        self._originals: dict[str, Callable] = {}
        self._replaced: list[tuple[Any, str, Any]] = []
        self._coalescing: dict[int, list[_Coalesced]] = {}

    # ----------------------------------------------------------------- bookkeeping
    def items(self, group: Any) -> int:
        """How many operations ran (or are queued) on ``group``'s stream since the start."""
        return self._streams[id(group)].items

    def _stream(self, group: Any) -> Optional[_Stream]:
        if getattr(self._local, "in_worker", False):
            return None  # the worker runs the real operation
        if group is None:
            group = c10d.GroupMember.WORLD
        return self._streams.get(id(group))

    def _issue(self, stream: _Stream, label: str, group: Any, run: Callable[[], Any]) -> _Handle:
        def complete() -> None:
            work = run()
            for w in work if isinstance(work, list) else [work]:
                if w is not None:
                    w.wait()

        handle = stream.submit(label, complete)
        stack = self._coalescing.get(id(group))
        if stack:
            stack[-1].append(handle)
        return handle

    # ----------------------------------------------------------------- wrappers
    def _wrap_collective(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            stream = self._stream(group)
            if stream is None:
                return original(*args, **kwargs)
            wants_handle = bool(bound.arguments.get("async_op", False))
            bound.arguments["async_op"] = True
            label = name
            if name in _P2P:
                peer = bound.arguments.get("dst", bound.arguments.get("src"))
                label = f"{name}(peer {peer})"
                wants_handle = name in ("isend", "irecv")
                bound.arguments.pop("async_op")
                real = self._originals["isend" if name in ("isend", "send") else "irecv"]
                handle = self._issue(stream, label, group,
                                     lambda: real(*bound.args, **bound.kwargs))  # fmt: skip
            else:
                handle = self._issue(stream, label, group,
                                     lambda: original(*bound.args, **bound.kwargs))  # fmt: skip
            if wants_handle or self._coalescing.get(id(group)):
                return handle
            handle.wait()
            return None

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_batch(self, original: Callable) -> Callable:
        def batch_isend_irecv(p2p_op_list: list) -> list:
            group = p2p_op_list[0].group if p2p_op_list else None
            stream = self._stream(group)
            if stream is None:
                return original(p2p_op_list)
            peers = ", ".join(
                f"{'send to' if op.op in (dist.isend, self._originals['isend']) else 'recv from'} "
                f"{op.peer}"
                for op in p2p_op_list
            )
            return [self._issue(stream, f"batch_isend_irecv({peers})", group,
                                lambda: original(p2p_op_list))]  # fmt: skip

        batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
        return batch_isend_irecv

    def _wrap_coalescing(self, original: Callable) -> Callable:
        @contextlib.contextmanager
        def _coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False):
            stream = self._stream(group)
            if stream is None:
                with original(group, device, async_ops) as cm:
                    yield cm
                return
            key = id(group if group is not None else c10d.GroupMember.WORLD)
            cm = _Coalesced()
            self._coalescing.setdefault(key, []).append(cm)
            try:
                yield cm
            finally:
                self._coalescing[key].pop()
            if not async_ops:
                cm.wait()

        return _coalescing_manager

    # ----------------------------------------------------------------- install / remove
    def install(self) -> None:
        replacements: dict[int, Any] = {}
        for name in _COLLECTIVES + _P2P:
            original = getattr(c10d, name, None)
            if original is not None:
                self._originals[name] = original
                replacements[id(original)] = self._wrap_collective(name, original)
        batch = c10d.batch_isend_irecv
        self._originals["batch_isend_irecv"] = batch
        replacements[id(batch)] = self._wrap_batch(batch)
        coalescing = c10d._coalescing_manager
        self._originals["_coalescing_manager"] = coalescing
        replacements[id(coalescing)] = self._wrap_coalescing(coalescing)
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if callable(value) and id(value) in replacements:
                    self._replaced.append((module, attr, value))
                    setattr(module, attr, replacements[id(value)])

    def remove(self) -> None:
        for module, attr, value in reversed(self._replaced):
            setattr(module, attr, value)
        self._replaced.clear()
        for stream in self._streams.values():
            stream.close()


@contextlib.contextmanager
def stream_ordered(
    groups: Iterable[Any] | dict[Any, str], *, timeout_s: float = 60.0
) -> Iterator[StreamOrderedGroups]:
    """Run the operations on ``groups`` (gloo process groups) in NCCL's stream order.

    ``groups`` may map each group to a name used in error messages. A wait longer than
    ``timeout_s`` raises :class:`StreamOrderDeadlock`. After a deadlock the stuck gloo
    operations stay pending: finish the process without using those groups again.
    """
    named = dict(groups) if isinstance(groups, dict) else {g: f"#{i}" for i, g in enumerate(groups)}
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    emulation = StreamOrderedGroups(named, timeout_s)
    emulation.install()
    try:
        yield emulation
    finally:
        emulation.remove()
