"""A single daemon thread that runs planning jobs in order, for :class:`~.hdp_iterator.HDPDataIterator`."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class PlanWorker:
    """One daemon thread that runs jobs strictly in submission order.

    Not a ``ThreadPoolExecutor``: its threads are joined when the interpreter exits, so a
    planner that never returns would keep the process alive forever.
    """

    def __init__(self, *, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn))
        return future

    def close(self, timeout_s: float = 1.0) -> None:
        """Ask the thread to stop after its current job; wait at most ``timeout_s`` for it."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting thread
                future.set_exception(exc)
