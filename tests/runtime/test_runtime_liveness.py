"""The heartbeat thread: it beats, and it is gone when ``stop`` returns.

A daemon thread left inside a store call while the interpreter exits aborts the process
(SIGABRT) after training finished; ``bytescale demo`` once failed that way on one rank.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from megatron_bytescale.runtime.liveness import KEY_PREFIX, Heartbeat


class SlowStore:
    """A store whose ``add`` takes a while, as a TCP store does under load."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.inner = dist.HashStore()
        self.calls = 0
        self.inside = threading.Event()

    def add(self, key: str, amount: int) -> int:
        self.calls += 1
        self.inside.set()
        time.sleep(self.delay_s)
        return self.inner.add(key, amount)


def test_the_counter_moves_and_stop_waits_for_a_beat_in_flight():
    store = SlowStore(delay_s=0.3)
    beat = Heartbeat(store, rank=1, world_size=2, interval_s=0.01).start()
    store.inside.clear()
    if not store.inside.wait(5):
        raise AssertionError("the heartbeat thread never called the store")
    beat.stop()
    assert not beat.running, "stop() returned while the thread was still inside a store call"
    assert int(store.inner.add(KEY_PREFIX + "1", 0)) >= 2  # the start beat and the thread's


def test_stop_is_bounded_when_the_store_hangs():
    store = SlowStore(delay_s=2.0)
    beat = Heartbeat(store, rank=0, world_size=1, interval_s=0.01)
    store.delay_s = 0.0
    beat.start()
    store.delay_s = 2.0
    store.inside.clear()
    store.inside.wait(5)
    started = time.monotonic()
    beat.stop(timeout_s=0.2)
    assert time.monotonic() - started < 1.5
    beat.stop()  # a second stop waits the beat out
    assert not beat.running


def test_a_stopped_rank_reads_as_silent():
    store = dist.HashStore()
    quiet = Heartbeat(store, rank=1, world_size=2, interval_s=0.02).start()
    quiet.stop()
    loud = Heartbeat(store, rank=0, world_size=2, interval_s=0.02).start()
    try:
        assert loud.silent_ranks(window_s=0.2) == [1]
    finally:
        loud.stop()
