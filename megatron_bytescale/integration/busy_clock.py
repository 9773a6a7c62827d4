"""The clock that busy time (a rank's CPU seconds in its micro-batches) is measured with.

On the CPU demo several ranks share fewer cores than there are ranks, and other work may share
them too, so wall time says nothing about a rank's own work. Process CPU time is better but still
counts the communication library's helper threads (gloo copies and polls on threads of its own)
and so grows with the machine's load. The CPU time of the calling thread counts only what that
thread computed: with one intra-op thread (``torch.set_num_threads(1)``, as the demo and
``bytescale profile`` run) that is every kernel of the micro-batch and nothing else. With more
intra-op threads the kernels run on other threads too, so process CPU time is used instead.
Calibration and the run use the same clock, so the cost model and the measured busy time agree
on what they count.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch


def busy_clock() -> Callable[[], float]:
    """``time.thread_time`` when torch computes on this thread alone, else ``time.process_time``."""
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


def busy_clock_name() -> str:
    """What :func:`busy_clock` measures, for reports."""
    return "thread CPU time" if torch.get_num_threads() == 1 else "process CPU time"


class MicroBatchTiming:
    """Busy (:func:`busy_clock`) and wall time of one micro-batch on a pipeline stage, summed
    over every op the stage runs for it (forward and backward, every model chunk)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.wall_s = 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        clock = busy_clock()
        busy0, wall0 = clock(), time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += clock() - busy0
            self.wall_s += time.perf_counter() - wall0
