"""Counters of ring-attention traffic and time, per micro-batch and per step.

Plain numbers for logs and benchmarks: P2P bytes sent and received (what the planner's cost
model predicts, see :mod:`.p2p_volume`), the number of ``batch_isend_irecv`` calls, and where
the attention time went: in kernels (``compute_s``) or blocked on a transfer (``wait_s``).
With perfect overlap ``wait_s`` is close to zero.

Usage::

    counters = CommCounters()
    for mb in micro_batches:
        counters.start_micro_batch(mb.order)
        ... ring_attention(..., counters=counters) in every layer, forward and backward ...
    step = counters.end_step()        # StepCommStats; counters are empty again
    log(step.as_dict())

The backward of a micro-batch is charged to the micro-batch that ran the forward, even when
another micro-batch was started in between (pipeline schedules).

Times are host wall-clock (``time.perf_counter``). On CPU that is the real split; on CUDA,
kernels are asynchronous, so ``compute_s`` is launch time and the device time shows up in
whichever later call synchronises (usually a ``wait``). ``wait_s`` also includes waiting for a
peer that is still busy (load imbalance), not only wire time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator


@dataclass
class MicroBatchCommStats:
    """Traffic and time of one micro-batch (``order`` is its plan order, None if unnamed)."""

    order: int | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    p2p_calls: int = 0
    attention_calls: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    intra_node_bytes_sent: int = 0
    """Of ``bytes_sent``: what two-level rings sent inside the node (their all-to-all)."""
    inter_node_bytes_sent: int = 0
    """Of ``bytes_sent``: what two-level rings sent between nodes (their ring of nodes). A flat
    ring's split follows from its members' nodes: ``planner.topology.ring_link_bytes``."""

    def add(self, other: "MicroBatchCommStats") -> None:
        self.intra_node_bytes_sent += other.intra_node_bytes_sent
        self.inter_node_bytes_sent += other.inter_node_bytes_sent
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.p2p_calls += other.p2p_calls
        self.attention_calls += other.attention_calls
        self.compute_s += other.compute_s
        self.wait_s += other.wait_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepCommStats:
    """Totals of one step plus its micro-batches in the order they were started."""

    total: MicroBatchCommStats
    micro_batches: list[MicroBatchCommStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = self.total.as_dict()
        out.pop("order")
        out["micro_batches"] = [mb.as_dict() for mb in self.micro_batches]
        return out


class CommCounters:
    """Accumulates :class:`MicroBatchCommStats` for the running step; see the module docstring."""

    def __init__(self) -> None:
        self._micro_batches: list[MicroBatchCommStats] = []
        self._current: MicroBatchCommStats | None = None
        self.steps: list[StepCommStats] = []

    # ------------------------------------------------------------------ lifecycle
    def start_micro_batch(self, order: int | None) -> MicroBatchCommStats:
        """Charge what follows to a new micro-batch ``order``; returns its record."""
        self._current = MicroBatchCommStats(order=order)
        self._micro_batches.append(self._current)
        return self._current

    def current(self) -> MicroBatchCommStats:
        """The record traffic is charged to now (an unnamed one if none was started)."""
        if self._current is None:
            return self.start_micro_batch(None)
        return self._current

    def end_step(self) -> StepCommStats:
        """Close the step: return its totals and per-micro-batch records, then start empty."""
        total = MicroBatchCommStats()
        for mb in self._micro_batches:
            total.add(mb)
        step = StepCommStats(total=total, micro_batches=self._micro_batches)
        self.steps.append(step)
        self._micro_batches = []
        self._current = None
        return step

    # ------------------------------------------------------------------ views of this step
    @property
    def micro_batches(self) -> list[MicroBatchCommStats]:
        return list(self._micro_batches)

    def step_total(self) -> MicroBatchCommStats:
        """Totals of the step so far (without closing it)."""
        total = MicroBatchCommStats()
        for mb in self._micro_batches:
            total.add(mb)
        return total

    @property
    def bytes_sent(self) -> int:
        return self.step_total().bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.step_total().bytes_received


@contextmanager
def timed(record: MicroBatchCommStats | None, what: str) -> Iterator[None]:
    """Add the wall time of the block to ``record.<what>`` (``compute_s`` or ``wait_s``)."""
    if record is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(record, what, getattr(record, what) + time.perf_counter() - start)
