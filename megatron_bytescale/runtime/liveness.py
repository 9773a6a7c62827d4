"""Which rank stopped answering: a heartbeat per rank in the job's key-value store.

When one rank of a collective stops (a ``SIGSTOP``, a hung kernel, a dead host), the others
only learn that the collective timed out; gloo's and NCCL's messages name no peer. Each rank
therefore bumps a counter in the job's ``torch.distributed`` store from a daemon thread, and a
rank that saw a collective fail asks :meth:`Heartbeat.silent_ranks` which counters stopped
moving. The store is the rendezvous store (torchrun's), not the process group, so it still
answers when the group is stuck.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

KEY_PREFIX = "bytescale/heartbeat/"


class Heartbeat:
    """Bump this rank's counter every ``interval_s`` seconds on a daemon thread.

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (e.g. a ``TCPStore`` client to
            ``MASTER_ADDR:MASTER_PORT``).
        rank: this process's rank; ``world_size``: how many ranks beat.
        interval_s: seconds between beats.
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s ({interval_s}) must be > 0")
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="bytescale-heartbeat", daemon=True)

    @classmethod
    def from_env(cls, *, rank: int, world_size: int, interval_s: float = 1.0) -> "Heartbeat":
        """A heartbeat on the store torchrun serves at ``MASTER_ADDR:MASTER_PORT``."""
        from ..env import MAX_PORT, env_int, env_text

        hint = "torchrun sets it for each worker: start the job with torchrun"
        address = env_text("MASTER_ADDR", hint=hint)
        port = env_int("MASTER_PORT", low=1, high=MAX_PORT, hint=hint)
        if port is None:
            raise ValueError(f"the environment variable MASTER_PORT is unset; {hint}")
        store = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=30))
        return cls(store, rank=rank, world_size=world_size, interval_s=interval_s)

    def start(self) -> "Heartbeat":
        self._store.add(KEY_PREFIX + str(self.rank), 1)
        self._thread.start()
        return self

    def stop(self, *, timeout_s: float = 60.0) -> None:
        """Stop beating and wait for the thread: a daemon thread still inside a store call when
        the interpreter exits can abort the process (SIGABRT) after training finished.

        The wait is bounded: a store call gives up after the store's own timeout (30 s for
        :meth:`from_env`), and the thread ends on that error.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the beating thread is still alive."""
        return self._thread.is_alive()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(KEY_PREFIX + str(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def beats(self) -> list[int]:
        """Every rank's counter now (0 for a rank that never beat)."""
        return [int(self._store.add(KEY_PREFIX + str(r), 0)) for r in range(self.world_size)]

    def silent_ranks(self, *, window_s: float | None = None) -> list[int]:
        """Ranks whose counter did not move over ``window_s`` (default: 3 beats)."""
        window = 3 * self.interval_s if window_s is None else window_s
        before = self.beats()
        time.sleep(window)
        after = self.beats()
        return [r for r, (a, b) in enumerate(zip(before, after)) if b == a and r != self.rank]
