"""Batched point-to-point traffic of one ring on the HDP ring group (DESIGN.md D2).

:class:`RingComm` queues send and receive operations, issues them all with ONE
``torch.distributed.batch_isend_irecv`` on the HDP group's ring group (:meth:`commit`; a
group over the HDP ranks that carries nothing else, so ring steps never queue behind a
gradient reduction on NCCL, see :mod:`.hdp_group`), and
completes them in :meth:`wait`. Callers commit before computing and wait just before they need
the data, so the transfer overlaps the computation.

Why batched: on NCCL a plain ``isend``/``irecv`` lazily creates a dedicated 2-rank communicator
for every (rank, peer) pair, which is exactly the buffer-memory blow-up ByteScale avoids by
keeping one communicator (paper.md §3.4). ``batch_isend_irecv`` runs inside one NCCL group call
on the group's own communicator. On gloo it is equally correct.

gloo needs contiguous tensors (``RuntimeError: input tensor has to be contiguous``); sends are
made contiguous here and receive buffers must be. ``tag`` separates logical channels that are
in flight at the same time between the same two ranks (gloo matches messages by source and
tag in posting order; NCCL ignores tags and matches in posting order).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .counters import CommCounters, MicroBatchCommStats
from .hdp_group import HDPGroup, Ring

logger = logging.getLogger(__name__)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RingComm:
    """Queue, commit and wait for P2P operations between members of ``ring``.

    Args:
        hdp: the HDP group; every operation runs on ``hdp.ring_group``.
        ring: this rank's ring descriptor; peers must be members of it.
        counters: where bytes and P2P calls are counted: a :class:`CommCounters` (charged to
            its current micro-batch) or one :class:`MicroBatchCommStats` record.
        tag: message tag of this channel (see the module docstring).

    One instance is reusable: after :meth:`wait` the next round can be queued.
    """

    def __init__(
        self,
        hdp: HDPGroup,
        ring: Ring,
        *,
        counters: CommCounters | MicroBatchCommStats | None = None,
        tag: int = 0,
    ) -> None:
        if ring.is_local:
            raise ValueError(
                f"ring {list(ring.members)} has size 1: a local micro-batch never communicates"
            )
        hdp.check_ring(ring)
        self._hdp = hdp
        self._ring = ring
        self._record = counters.current() if isinstance(counters, CommCounters) else counters
        self._tag = tag
        self._ops: list[dist.P2POp] = []
        self._in_flight_ops: list[dist.P2POp] = []
        self._works: list | None = None
        self._pending_bytes = (0, 0)

    @property
    def ring(self) -> Ring:
        return self._ring

    @property
    def in_flight(self) -> bool:
        """True between :meth:`commit` and :meth:`wait`."""
        return self._works is not None

    # ------------------------------------------------------------------ queueing
    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Queue sending ``tensor`` to ring member ``peer`` (an HDP rank)."""
        self._check_can_queue(peer)
        self._ops.append(
            dist.P2POp(
                dist.isend,
                tensor.contiguous(),
                peer=self._peer(peer),
                group=self._hdp.ring_group,
                tag=self._tag,
            )
        )

    def recv(self, buffer: torch.Tensor, peer: int) -> torch.Tensor:
        """Queue receiving into ``buffer`` (contiguous) from ring member ``peer``."""
        self._check_can_queue(peer)
        if not buffer.is_contiguous():
            raise RuntimeError("RingComm.recv needs a contiguous receive buffer")
        self._ops.append(
            dist.P2POp(
                dist.irecv, buffer, peer=self._peer(peer), group=self._hdp.ring_group, tag=self._tag
            )
        )
        return buffer

    def send_recv(
        self, to_send: torch.Tensor, recv_buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Queue the ring shift: send ``to_send`` to the next member, receive from the previous.

        Returns the receive buffer (allocated like ``to_send`` when not given); its content is
        valid only after :meth:`wait`.
        """
        if recv_buffer is None:
            recv_buffer = torch.empty_like(to_send, memory_format=torch.contiguous_format)
        elif recv_buffer.shape != to_send.shape or recv_buffer.dtype != to_send.dtype:
            raise RuntimeError(
                f"RingComm.send_recv: receive buffer {tuple(recv_buffer.shape)} "
                f"{recv_buffer.dtype} does not match the sent tensor {tuple(to_send.shape)} "
                f"{to_send.dtype}"
            )
        self.send(to_send, self._ring.next_rank)
        self.recv(recv_buffer, self._ring.prev_rank)
        return recv_buffer

    # ------------------------------------------------------------------ issue / complete
    def commit(self) -> None:
        """Issue every queued operation with one ``batch_isend_irecv`` on the ring group."""
        if self._works is not None:
            raise RuntimeError("RingComm.commit called twice without wait")
        if not self._ops:
            raise RuntimeError("RingComm.commit called with nothing queued")
        sent = sum(_bytes(op.tensor) for op in self._ops if op.op is dist.isend)
        received = sum(_bytes(op.tensor) for op in self._ops if op.op is dist.irecv)
        self._works = dist.batch_isend_irecv(self._ops)
        self._in_flight_ops = self._ops  # keeps (possibly copied) send tensors alive until wait
        self._ops = []
        self._pending_bytes = (sent, received)
        if self._record is not None:
            self._record.p2p_calls += 1

    def wait(self) -> None:
        """Block until the committed operations complete (received buffers are then valid)."""
        if self._works is None:
            raise RuntimeError("RingComm.wait called before commit")
        for work in self._works:
            work.wait()
        self._works = None
        self._in_flight_ops = []
        if self._record is not None:
            self._record.bytes_sent += self._pending_bytes[0]
            self._record.bytes_received += self._pending_bytes[1]
        self._pending_bytes = (0, 0)

    # ------------------------------------------------------------------ helpers
    def _check_can_queue(self, peer: int) -> None:
        if self._works is not None:
            raise RuntimeError(
                "RingComm: cannot queue operations while a commit is in flight; wait first"
            )
        if peer not in self._ring.members or peer == self._ring.rank:
            raise RuntimeError(
                f"RingComm: peer {peer} is not another member of ring {list(self._ring.members)}"
            )

    def _peer(self, hdp_rank: int) -> int:
        return self._hdp.global_rank(hdp_rank)
