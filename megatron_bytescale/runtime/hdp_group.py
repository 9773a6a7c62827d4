"""The HDP group and ring descriptors (DESIGN.md D1, D2).

All HDP ranks share ONE process group for collectives (gradient reduction, token counts) and
ONE more group over the same ranks for ring traffic, both created once at start-up. A ring is
not a process group: it is an ordered tuple of HDP ranks that exchange data through batched
point-to-point operations on the ring group (:mod:`.ring_comm`). Creating a ring therefore
costs nothing and never touches a communicator, which is what lets ByteScale build a different
ring for every micro-batch without the memory and latency cost of dynamic NCCL communicators
(paper.md §3.4).

Why a second group (docs/communicators.md): on NCCL every operation of one process group runs
on that group's stream, in the order this rank issued it. With ``--overlap-grad-reduce`` a
rank whose last micro-batch is a ring issues a gradient bucket's all-reduce in the middle of
that ring's backward; its remaining ring sends would queue behind the all-reduce, which
completes only when every HDP rank joins it, while a ring peer with micro-batches left joins
only after the ring finishes: a deadlock. On their own communicator the ring's operations
never wait for a collective.

HDP ranks are ranks *inside* the HDP group; the global (world) rank of a peer is looked up in
one place, :meth:`HDPGroup.global_rank`, because ``torch.distributed`` P2P calls address peers
by global rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ring:
    """An ordered ring of HDP ranks as seen by one of its members.

    ``members`` are HDP ranks in ring order; ``position`` is the index of the rank holding
    this descriptor. Data flows from ``members[i]`` to ``members[i + 1]`` (wrapping around).
    A ring of size 1 is a local micro-batch that never communicates.
    """

    members: tuple[int, ...]
    position: int

    def __post_init__(self) -> None:
        members = tuple(int(m) for m in self.members)
        object.__setattr__(self, "members", members)
        if not members:
            raise ValueError("a ring needs at least one member, got an empty ring")
        if len(set(members)) != len(members):
            raise ValueError(f"ring members {list(members)} must be distinct")
        if any(m < 0 for m in members):
            raise ValueError(f"ring members {list(members)} must be non-negative HDP ranks")
        if not 0 <= self.position < len(members):
            raise ValueError(
                f"ring position {self.position} is outside [0, {len(members)}) "
                f"for ring {list(members)}"
            )

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        """The HDP rank of the member holding this descriptor."""
        return self.members[self.position]

    @property
    def next_rank(self) -> int:
        """HDP rank this member sends to."""
        return self.members[(self.position + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        """HDP rank this member receives from."""
        return self.members[(self.position - 1) % self.size]

    @property
    def is_local(self) -> bool:
        """True for a ring of size 1: no communication at all."""
        return self.size == 1


class HDPGroup:
    """The one process group spanning all HDP ranks, and the factory of rings on it.

    Args:
        group: the HDP process group (Megatron's data-parallel group, D1); ``None`` means
            the default (WORLD) group. ``torch.distributed`` must already be initialised.
        ring_group: the group ring traffic runs on: the same ranks as ``group`` in the same
            order, used for nothing else (D2). ``None`` creates it here: with ``new_group`` over
            every rank when ``group`` is WORLD (every process constructs at the same point),
            otherwise with ``use_local_synchronization`` (only the members construct). Layouts
            with several HDP groups (TP / PP) create all of them in one order on every rank and
            pass this rank's (:func:`new_ring_groups`). Passing ``group`` itself puts rings and
            collectives on one communicator, which can deadlock on NCCL; tests use it to show
            that.
        ring_timeout: how long a ring operation may wait for a peer when the ring group is
            created here; give the HDP group's own timeout (``init_process_group``'s, Megatron's
            ``--distributed-timeout-minutes``). ``None`` is torch's default (30 minutes): a
            group made by ``new_group`` does not inherit the default group's timeout, so
            without it a stopped ring member would hold its peers for 30 minutes.

    The global ranks of the group are read once here, so creating rings and sending to peers
    never queries or creates process groups (D2).

    Construct it on every HDP rank at the same point: on NCCL it runs one tiny all-reduce so
    that the group's communicator exists before the first ring sends. (NCCL creates
    communicators lazily; ``batch_isend_irecv`` as the group's first operation would need every
    rank of the group to take part, while a ring involves only its members.)
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        ring_group: dist.ProcessGroup | None = None,
        ring_timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "HDPGroup needs an initialised torch.distributed process group; call "
                "torch.distributed.init_process_group(...) first"
            )
        self._group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        if self._rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the HDP group"
            )
        self._global_ranks = tuple(dist.get_process_group_ranks(self._group))
        if len(self._global_ranks) != self._size:
            raise RuntimeError(
                f"HDP group reports size {self._size} but {len(self._global_ranks)} global ranks"
            )
        if ring_group is None:
            ring_group = _new_ring_group(self._group, self._global_ranks, ring_timeout)
        ring_ranks = tuple(dist.get_process_group_ranks(ring_group))
        if ring_ranks != self._global_ranks:
            raise ValueError(
                f"the ring group's global ranks {list(ring_ranks)} differ from the HDP group's "
                f"{list(self._global_ranks)}; create it over the same ranks in the same order"
            )
        self._ring_group = ring_group
        if ring_group is self._group and uses_nccl(self._group):
            logger.warning(
                "ring traffic shares the HDP group's NCCL communicator: with overlapped gradient "
                "reduction or parameter gathering this can deadlock (docs/communicators.md)"
            )
        if uses_nccl(self._group):
            warm = torch.zeros(1, device=collective_device(self._group))
            dist.all_reduce(warm, group=self._group)
            if ring_group is not self._group:
                dist.all_reduce(warm, group=ring_group)

    @property
    def group(self) -> dist.ProcessGroup:
        """The group of the collectives (gradient reduction, token counts, plan hashes)."""
        return self._group

    @property
    def ring_group(self) -> dist.ProcessGroup:
        """The group ring P2P runs on: same ranks as :attr:`group`, no collective after start-up."""
        return self._ring_group

    @property
    def device(self) -> torch.device:
        """Where tensors for this group's collectives and P2P must live (NCCL: this GPU)."""
        return collective_device(self._group)

    @property
    def rank(self) -> int:
        """This process's rank inside the HDP group."""
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def global_rank(self, hdp_rank: int) -> int:
        """The global (world) rank of HDP rank ``hdp_rank``: the one place ranks are mapped."""
        if not 0 <= hdp_rank < self._size:
            raise ValueError(f"HDP rank {hdp_rank} is outside the HDP group [0, {self._size})")
        return self._global_ranks[hdp_rank]

    def ring(self, members: Sequence[int]) -> Ring:
        """The ring descriptor of ``members`` (HDP ranks, in ring order) for this rank.

        Raises ValueError when members repeat, fall outside the group, or do not include this
        rank. Never creates a process group.
        """
        members_t = tuple(int(m) for m in members)
        if not members_t:
            raise ValueError("ring members must not be empty")
        if len(set(members_t)) != len(members_t):
            raise ValueError(f"ring members {list(members_t)} must be distinct")
        outside = [m for m in members_t if not 0 <= m < self._size]
        if outside:
            raise ValueError(
                f"ring members {outside} of ring {list(members_t)} are outside the HDP group "
                f"[0, {self._size})"
            )
        if self._rank not in members_t:
            raise ValueError(
                f"HDP rank {self._rank} is not a member of ring {list(members_t)}; only members "
                f"may build (and run) a ring"
            )
        return Ring(members_t, members_t.index(self._rank))

    def check_ring(self, ring: Ring) -> None:
        """Raise ValueError unless ``ring`` was built for this rank of this group."""
        outside = [m for m in ring.members if m >= self._size]
        if outside:
            raise ValueError(
                f"ring {list(ring.members)} names HDP ranks {outside} outside the HDP group "
                f"[0, {self._size})"
            )
        if ring.rank != self._rank:
            raise ValueError(
                f"ring {list(ring.members)} at position {ring.position} belongs to HDP rank "
                f"{ring.rank}, but this process is HDP rank {self._rank}"
            )

    def __repr__(self) -> str:
        return f"HDPGroup(rank={self._rank}, size={self._size})"


def _new_ring_group(
    group: dist.ProcessGroup, ranks: tuple[int, ...], timeout: timedelta | None
) -> dist.ProcessGroup:
    if group is dist.group.WORLD:
        return dist.new_group(list(ranks), timeout=timeout)
    return dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)


def new_ring_groups(
    hdp_groups: Sequence[Sequence[int]], *, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """Create one ring group per HDP group and return this rank's; call on EVERY rank.

    ``hdp_groups`` lists the global ranks of every HDP group of the world (with TP / PP there
    is one per (TP rank, stage)); each must be in HDP-rank order. The groups are created in
    sorted order, so every rank makes the same ``new_group`` calls in the same order, as
    ``new_group`` requires (and as Megatron creates its own groups).

    ``timeout``: how long a ring operation waits for a peer; pass the HDP group's (Megatron's
    ``--distributed-timeout-minutes``). ``new_group`` does not inherit it from the default
    group: ``None`` is torch's default of 30 minutes.
    """
    me = dist.get_rank()
    mine = None
    for ranks in sorted(tuple(int(r) for r in g) for g in hdp_groups):
        created = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            if mine is not None:
                raise ValueError(f"global rank {me} is in more than one HDP group: {hdp_groups}")
            mine = created
    if mine is None:
        raise ValueError(f"global rank {me} is in none of the HDP groups {list(hdp_groups)}")
    return mine


def uses_nccl(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` communicates CUDA tensors through NCCL (also "cpu:gloo,cuda:nccl")."""
    return "nccl" in str(dist.get_backend(group))


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """The device a collective or P2P on ``group`` needs its tensors on (NCCL: the current GPU)."""
    if uses_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
