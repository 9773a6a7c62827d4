"""The HDP group manager: how ByteScale replaces Megatron's context-parallel groups.

Megatron builds a *static* context-parallel (CP) group per rank at start-up, and its TE
attention runs one ring over that fixed group for every micro-batch. ByteScale instead gives
every micro-batch its own ring, of any size, on any ranks (DESIGN.md D1-D3):

* Megatron is initialised with **CP = 1 and DP = d_hdp** (= the DP x CP a static run would
  use). Megatron's data-parallel group, ``get_data_parallel_group(with_context_parallel=True)``,
  *is* the HDP group: DDP reduces gradients over it, the distributed optimizer shards over it
  (ZeRO-1 over all HDP ranks), and ``finalize_model_grads`` all-reduces the token count over it.
* One more process group is created, once: the ring group, over the same ranks as the HDP
  group (one per HDP group with TP / PP). A ring is an ordered tuple of HDP ranks
  (``runtime.Ring``) and its traffic is batched P2P on the ring group, never on the HDP group,
  whose NCCL stream also carries the gradient reductions (D2, docs/communicators.md).
* TP and PP stay Megatron's (D11): there is one HDP group per (TP rank, pipeline stage), and
  :class:`HDPRankMap` reads this process's place in that layout from Megatron's own process
  groups (never from rank arithmetic) and checks that every TP rank and stage of a model
  replica has the same HDP rank, so all of them run the same row of the plan.
* Expert parallelism (``--expert-model-parallel-size E``, ``--expert-tensor-parallel-size``)
  is megatron-core's own: its expert groups (ETP x E consecutive ranks of a stage) are carved
  out of the HDP ranks, each spanning :func:`.expert_layout.expert_lockstep_size` consecutive
  HDP ranks
  (checked by :meth:`HDPRankMap.check_expert_groups`); expert gradients reduce over its
  expert-data-parallel group. The plan keeps those HDP ranks in step (``StepPlan.ep_size``).
* :class:`HDPGroupManager` wraps the group in the runtime's ``HDPGroup`` and holds the
  micro-batch that is running *now*. The schedule driver binds each micro-batch
  (:meth:`HDPGroupManager.bind`) around its forward and backward; ``ByteScaleCoreAttention``
  reads the ring and the attention layout from the manager. This replaces both Megatron's CP
  group and its THD ``PackedSeqParams`` (which the local layer spec rejects).

:class:`HDPParallelLayout` checks, without any process, that a requested Megatron layout can
be served, and refuses with a message naming the flag otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Optional

from .config import RefusedArguments
from .expert_layout import expert_block_words, expert_lockstep_refusal, expert_lockstep_size

if TYPE_CHECKING:  # runtime types, imported lazily at run time
    from megatron_bytescale.runtime import CommCounters, HDPGroup, MicroBatchTensors

logger = logging.getLogger(__name__)

VIRTUAL_PIPELINE_REASON = (
    "interleaved stages split each pipeline stage into model chunks, so they need pipeline "
    "parallelism; add --pipeline-model-parallel-size > 1 or drop the virtual stages"
)


@dataclass(frozen=True, kw_only=True)
class HDPParallelLayout:
    """A Megatron parallel layout as HDP sees it; construction refuses what HDP cannot serve.

    ``context_parallel_size`` and ``hybrid_context_parallel`` are what the user asked Megatron
    for. HDP *replaces* both, so they must be 1 / False: the ranks a static run would spend on
    CP are part of the HDP (data-parallel) group instead. Tensor and (non-interleaved) pipeline
    parallelism stay Megatron's (DESIGN.md D11): there is one HDP group per (TP rank, PP stage).
    ``num_attention_heads`` / ``num_query_groups``, when given, must divide by the TP size
    (each TP rank runs the ring attention on its own heads).
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None

    def __post_init__(self) -> None:
        reasons = self.refusals()
        if reasons:
            raise RefusedArguments(reasons)

    def refusals(self) -> list[str]:
        """Every reason this layout cannot be served (empty when it can)."""
        reasons = []
        if self.world_size < 1:
            reasons.append(f"world size ({self.world_size}) must be >= 1")
        if self.context_parallel_size != 1:
            reasons.append(
                f"--context-parallel-size {self.context_parallel_size} cannot be combined with "
                "--bytescale-hdp: HDP replaces Megatron's static context parallelism. Run with "
                "--context-parallel-size 1; the ranks go to the HDP (data-parallel) group, and "
                "long sequences get rings of the size they need"
            )
        if self.hybrid_context_parallel:
            reasons.append(
                "--hybrid-context-parallel cannot be combined with --bytescale-hdp: both plan "
                "per-sequence rings over the DP x CP ranks; use one of them (ByteScale's rings "
                "are of any size on any ranks, Megatron's are aligned powers of two)"
            )
        sizes_ok = True
        for name, value in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
        ):
            if value < 1:
                sizes_ok = False
                reasons.append(f"{name} ({value}) must be >= 1")
        if self.virtual_pipeline_model_parallel_size not in (None, 1) and self.pipeline_model_parallel_size == 1:
            reasons.append(
                "interleaved pipeline stages (--num-layers-per-virtual-pipeline-stage / "
                "--num-virtual-stages-per-pipeline-rank, here "
                f"{self.virtual_pipeline_model_parallel_size} virtual stages) with "
                f"--pipeline-model-parallel-size 1: {VIRTUAL_PIPELINE_REASON}"
            )
        ep = self.expert_model_parallel_size
        if ep < 1:
            reasons.append(f"--expert-model-parallel-size ({ep}) must be >= 1")
        tp = self.tensor_model_parallel_size
        for flag, count in (
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.num_query_groups),
        ):
            if sizes_ok and count is not None and count % tp:
                reasons.append(
                    f"{flag} {count} is not divisible by --tensor-model-parallel-size {tp}: "
                    "every TP rank runs the ring attention on its own share of the heads; "
                    "choose a TP size that divides the attention heads and the query groups"
                )
        model_parallel = tp * self.pipeline_model_parallel_size
        if sizes_ok and self.world_size >= 1 and self.world_size % model_parallel:
            reasons.append(
                f"world size {self.world_size} is not divisible by TP x PP = {model_parallel}"
            )
        if sizes_ok:
            reasons += self._expert_refusals()
        return reasons

    def _expert_refusals(self) -> list[str]:
        """The expert sizes' refusals, all read from one lockstep block (``ETP x EP / TP`` HDP
        ranks, :func:`expert_lockstep_size`): it must exist, tile the HDP ranks and, with
        interleaved stages, be 1 (an expert group inside one TP group, whose ranks always run
        the same micro-batches, needs no slot rule, which the interleaved driver lacks)."""
        tp, ep = self.tensor_model_parallel_size, self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size or tp
        if etp < 1:
            return [f"--expert-tensor-parallel-size ({etp}) must be >= 1"]
        if ep == 1 and etp == tp:
            return []
        why = expert_lockstep_refusal(tp, etp, ep)
        if why:
            return [why]
        block = expert_lockstep_size(tp, etp, ep)
        reasons = []
        pp, virtual = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if block > 1 and pp > 1 and virtual not in (None, 1):
            reasons.append(
                f"{expert_block_words(block, tp=tp, etp=etp, ep=ep)} with "
                f"--virtual-pipeline-model-parallel-size {virtual} cannot be combined with "
                "--bytescale-hdp: the interleaved driver keeps no slot rule across the HDP ranks "
                "of an expert group; run without virtual stages, or with sizes whose expert "
                "group lies inside one TP group (ETP x EP <= TP, e.g. "
                "--expert-model-parallel-size 1)"
            )
        if self.world_size < 1 or self.world_size % (tp * pp) or self.hdp_size % block == 0:
            return reasons  # (a world size TP x PP does not divide is refused by itself)
        if etp == tp:
            return reasons + [
                f"--expert-model-parallel-size {ep} does not divide the {self.hdp_size} HDP ranks "
                "(world size / (TP x PP)): expert groups are carved out of the HDP ranks; choose "
                "a divisor of the HDP size"
            ]
        return reasons + [
            f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} / "
            f"--tensor-model-parallel-size {tp} = {block} HDP ranks per expert group does not "
            f"divide the {self.hdp_size} HDP ranks (world size / (TP x PP)): expert groups are "
            "carved out of the HDP ranks; choose sizes whose expert groups tile them"
        ]

    @property
    def hdp_size(self) -> int:
        """Number of HDP ranks (= Megatron's data-parallel size with CP = 1)."""
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    @classmethod
    def from_megatron_args(cls, args: Any) -> "HDPParallelLayout":
        """Check a Megatron ``args`` namespace (after ``parse_args``, before or after
        ``validate_args``: virtual stages are read from whichever flag says so)."""
        virtual = virtual_stages_from_args(args)
        heads = getattr(args, "num_attention_heads", None)
        groups = getattr(args, "num_query_groups", None)
        return cls(
            world_size=int(getattr(args, "world_size", 1) or 1),
            tensor_model_parallel_size=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            pipeline_model_parallel_size=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            virtual_pipeline_model_parallel_size=virtual,
            context_parallel_size=int(getattr(args, "context_parallel_size", 1) or 1),
            hybrid_context_parallel=bool(getattr(args, "hybrid_context_parallel", False)),
            expert_model_parallel_size=int(getattr(args, "expert_model_parallel_size", 1) or 1),
            expert_tensor_parallel_size=(
                int(etp) if (etp := getattr(args, "expert_tensor_parallel_size", None)) else None
            ),
            num_attention_heads=int(heads) if heads else None,
            num_query_groups=(
                int(groups) if groups and getattr(args, "group_query_attention", False) else None
            ),
        )


def virtual_stages_from_args(args: Any) -> Optional[int]:
    """Virtual stages per pipeline stage from Megatron ``args``, from whichever flag says so."""
    virtual = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if virtual is None:
        virtual = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_virtual_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if virtual is None and per_virtual_stage:
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        layers = int(getattr(args, "num_layers", 0) or 0)
        virtual = layers // pp // int(per_virtual_stage) if layers else 2
    return virtual


@dataclass(frozen=True, kw_only=True)
class HDPRankMap:
    """Where this process sits in Megatron's layout, read from Megatron's process groups.

    Megatron orders ranks as it likes (``order="tp-cp-ep-dp-pp"`` by default, but users and
    later versions change it), so nothing here derives a rank from arithmetic: every list comes
    from ``torch.distributed.get_process_group_ranks`` of the group Megatron built.

    * ``hdp_global_ranks``: the HDP group (Megatron's DP x CP group with CP = 1) of this TP
      rank and pipeline stage; HDP rank i is global rank ``hdp_global_ranks[i]``. Rings of this
      process only ever contain these ranks (DESIGN.md D11).
    * ``tp_global_ranks`` / ``pp_global_ranks``: this model replica's TP group and this
      pipeline's stages, in TP-rank / stage order.

    What HDP relies on, and :meth:`verify` checks across the world: all TP ranks of a replica
    and all stages of a pipeline have the same HDP rank (so they run the same row of the plan),
    and all members of an HDP group share the TP rank and the stage.
    """

    global_rank: int
    hdp_rank: int
    tp_rank: int
    pp_rank: int
    hdp_global_ranks: tuple[int, ...]
    tp_global_ranks: tuple[int, ...] = ()
    pp_global_ranks: tuple[int, ...] = ()
    ep_global_ranks: tuple[int, ...] = ()
    """This rank's expert-parallel group (Megatron's), in expert-rank order; empty or one rank
    without expert parallelism."""
    tp_ep_global_ranks: tuple[int, ...] = ()
    """This rank's expert tensor-and-expert-parallel group (Megatron's, ETP x EP ranks): every
    rank its MoE layers exchange tokens with. Empty: ETP = TP assumed (E x TP ranks)."""

    @property
    def expert_model_parallel_size(self) -> int:
        """Megatron's expert-parallel size (``--expert-model-parallel-size``)."""
        return max(1, len(self.ep_global_ranks))

    @property
    def ep_size(self) -> int:
        """HDP ranks one expert group spans (:func:`expert_lockstep_size`), the plan's
        ``ep_size``: ``max(1, ETP x EP / TP)``, with ETP x EP read from Megatron's group."""
        group = len(self.tp_ep_global_ranks) or self.expert_model_parallel_size * self.tp_size
        return max(1, group // self.tp_size)

    def check_expert_groups(self, rows: list[tuple[int, int, int]]) -> None:
        """Raise RuntimeError unless this rank's expert group covers exactly the HDP ranks the
        plan keeps in step (``StepPlan.ep_size`` = E': HDP ranks ``g*E' .. g*E'+E'-1``).

        ``rows``: every global rank's (HDP rank, TP rank, stage), from :meth:`verify`.
        Megatron lays expert ranks out as ``tp-ep-dp-pp`` (tp = ETP): its tensor-and-expert
        group is ETP x EP consecutive ranks of a stage, i.e. whole HDP ranks (TP ranks each) or
        a part of one. Another order, or sizes that do not divide one another, would tie ranks
        the plan does not keep in step, so they are refused here rather than hang."""
        members = self.tp_ep_global_ranks or self.ep_global_ranks
        if len(members) <= 1:
            return
        e = self.ep_size
        first = self.hdp_rank - self.hdp_rank % e
        wanted = set(range(first, first + e))
        found = {rows[r][0] for r in members}
        stages = {rows[r][2] for r in members}
        size = len(members)
        if found != wanted or stages != {self.pp_rank} or (size % self.tp_size
                                                           and self.tp_size % size):
            raise RuntimeError(
                f"Megatron's expert group (tensor-and-expert-parallel) of global rank "
                f"{self.global_rank} is {list(members)}, on HDP ranks {sorted(found)}; HDP keeps "
                f"consecutive HDP ranks in step ({sorted(wanted)} here); initialise Megatron with "
                "its default rank order (tp-cp-ep-dp-pp) and --expert-tensor-parallel-size x "
                "--expert-model-parallel-size a multiple or a divisor of the TP size"
            )

    @property
    def hdp_size(self) -> int:
        return len(self.hdp_global_ranks)

    @property
    def tp_size(self) -> int:
        return max(1, len(self.tp_global_ranks))

    @property
    def pp_size(self) -> int:
        return max(1, len(self.pp_global_ranks))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_megatron(cls) -> "HDPRankMap":
        """The map of this process from Megatron's (initialised) ``parallel_state`` groups."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        def ranks(group: Any) -> tuple[int, ...]:
            return tuple(int(r) for r in dist.get_process_group_ranks(group))

        return cls(
            global_rank=dist.get_rank(),
            hdp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            hdp_global_ranks=ranks(ps.get_data_parallel_group(with_context_parallel=True)),
            tp_global_ranks=ranks(ps.get_tensor_model_parallel_group()),
            pp_global_ranks=ranks(ps.get_pipeline_model_parallel_group()),
            ep_global_ranks=ranks(ps.get_expert_model_parallel_group()),
            tp_ep_global_ranks=ranks(ps.get_expert_tensor_and_model_parallel_group()),
        )

    def verify(self) -> list[tuple[int, int, int]]:
        """Check across the world that the groups fit together as HDP needs (one all-gather).

        Returns every global rank's (HDP rank, TP rank, stage) row (:meth:`hdp_groups` reads
        all HDP groups from it).

        Raises RuntimeError on every rank (naming the ranks that disagree) when a TP group or a
        pipeline mixes HDP ranks, or an HDP group mixes TP ranks or stages: then two ranks that
        must run the same micro-batches would run different rows of the plan.
        """
        import torch
        import torch.distributed as dist

        from megatron_bytescale.runtime.hdp_group import collective_device

        world = dist.get_world_size()
        mine = torch.tensor([self.hdp_rank, self.tp_rank, self.pp_rank], dtype=torch.int64,
                            device=collective_device(dist.group.WORLD))
        table = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(table, mine)
        rows = [tuple(int(x) for x in t.cpu().tolist()) for t in table]
        problems = self.inconsistencies(rows)
        flag = torch.tensor([1 if problems else 0], device=mine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            detail = "; ".join(problems) if problems else "see the messages of other ranks"
            raise RuntimeError(
                "Megatron's process groups do not fit HDP (every TP rank and pipeline stage of a "
                f"model replica must have the same data-parallel rank): {detail}"
            )
        return rows

    @staticmethod
    def hdp_groups(rows: list[tuple[int, int, int]]) -> list[tuple[int, ...]]:
        """Every HDP group of the world (global ranks in HDP-rank order), from :meth:`verify`'s
        rows: the ranks that share a TP rank and a stage, ordered by HDP rank."""
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for global_rank, (hdp_rank, tp_rank, pp_rank) in enumerate(rows):
            groups.setdefault((tp_rank, pp_rank), []).append((hdp_rank, global_rank))
        return [tuple(g for _, g in sorted(members)) for _, members in sorted(groups.items())]

    def inconsistencies(self, rows: list[tuple[int, int, int]]) -> list[str]:
        """What is wrong from this rank's view, given every global rank's (hdp, tp, pp) row."""
        problems = []
        for what, members, same in (
            ("TP group", self.tp_global_ranks, (0, 2)),
            ("pipeline", self.pp_global_ranks, (0, 1)),
            ("HDP group", self.hdp_global_ranks, (1, 2)),
        ):
            keys = {tuple(rows[g][i] for i in same) for g in members}
            if len(keys) > 1:
                names = ["HDP rank", "TP rank", "stage"]
                problems.append(
                    f"global ranks {list(members)} ({what} of rank {self.global_rank}) have "
                    + " / ".join(names[i] for i in same) + f" {sorted(keys)}"
                )
        return problems


class HDPGroupManager:
    """The HDP group plus the micro-batch running now; what the core attention consults.

    Args:
        hdp: the runtime's ``HDPGroup`` over Megatron's data-parallel group.
        attention_backend: passed to ``runtime.ring_attention`` (None lets it choose).
        dkv_wire: dtype of the dK/dV accumulators on the ring (``runtime.dkv_wire_dtype``).
        rank_map: where this process sits in Megatron's TP / PP layout (None: TP = PP = 1,
            the HDP group is all there is).

    ``two_level_topology``: when set (``--bytescale-two-level-ring``), rings over several whole
    nodes of it run ``runtime.two_level_ring_attention``; None runs every ring flat.
    """

    def __init__(
        self,
        hdp: "HDPGroup",
        *,
        attention_backend: Optional[str] = None,
        dkv_wire: str = "accumulator",
        rank_map: Optional[HDPRankMap] = None,
    ) -> None:
        self.hdp = hdp
        self.attention_backend = attention_backend
        self.dkv_wire = dkv_wire
        if rank_map is not None and rank_map.hdp_rank != hdp.rank:
            raise ValueError(
                f"the rank map says HDP rank {rank_map.hdp_rank}, the HDP group {hdp.rank}"
            )
        self.rank_map = rank_map
        self.two_level_topology: Any = None
        self._current: "MicroBatchTensors | None" = None
        self._counters: "CommCounters | None" = None

    @classmethod
    def from_megatron(
        cls,
        *,
        attention_backend: Optional[str] = None,
        dkv_wire: str = "accumulator",
        timeout: Optional[timedelta] = None,
    ) -> "HDPGroupManager":
        """Wrap Megatron's (already initialised) data-parallel group as the HDP group.

        Reads the TP / PP layout from Megatron's groups (:class:`HDPRankMap`) and checks it
        across the world, then creates the ring groups, one per HDP group (collectives: call it
        on every rank, once). ``timeout``: the ring groups' wait for a peer, the
        ``distributed_timeout_minutes`` Megatron was initialised with (Megatron does not keep
        it; ``None`` is torch's default, 30 minutes, which is also Megatron's default).
        """
        from megatron.core import parallel_state

        from megatron_bytescale.runtime import HDPGroup, new_ring_groups

        if parallel_state.get_context_parallel_world_size() != 1:
            raise ValueError(
                "Megatron was initialised with context-parallel size "
                f"{parallel_state.get_context_parallel_world_size()}; HDP needs 1 "
                "(use initialize_hdp_model_parallel)"
            )
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        rank_map = HDPRankMap.from_megatron()
        rows = rank_map.verify()
        rank_map.check_expert_groups(rows)
        ring_group = new_ring_groups(HDPRankMap.hdp_groups(rows), timeout=timeout)
        return cls(
            HDPGroup(group, ring_group=ring_group), attention_backend=attention_backend,
            dkv_wire=dkv_wire, rank_map=rank_map,
        )  # fmt: skip

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size of the model replica (1 without a rank map)."""
        return self.rank_map.tp_size if self.rank_map is not None else 1

    @property
    def pp_size(self) -> int:
        """Pipeline stages of the model replica (1 without a rank map)."""
        return self.rank_map.pp_size if self.rank_map is not None else 1

    @property
    def ep_size(self) -> int:
        """HDP ranks one expert group spans, which run the same slots (1 without a rank map):
        the plan's ``ep_size`` (:func:`expert_lockstep_size`; with ETP = TP, the EP size)."""
        return self.rank_map.ep_size if self.rank_map is not None else 1

    @property
    def expert_model_parallel_size(self) -> int:
        """Megatron's ``--expert-model-parallel-size`` (1 without a rank map)."""
        return self.rank_map.expert_model_parallel_size if self.rank_map is not None else 1

    @property
    def rank(self) -> int:
        return self.hdp.rank

    @property
    def size(self) -> int:
        return self.hdp.size

    @contextlib.contextmanager
    def bind(
        self, micro_batch: "MicroBatchTensors", counters: "CommCounters | None" = None
    ) -> Iterator["MicroBatchTensors"]:
        """Make ``micro_batch`` (and its P2P counters) current for the attention layers.

        Bind around forward *and* backward: activation recomputation reruns the attention
        forward during backward and needs the same layout.
        """
        if self._current is not None:
            raise RuntimeError(
                "a micro-batch is already bound to the HDP group manager; micro-batches run one "
                "at a time"
            )
        self._current, self._counters = micro_batch, counters
        try:
            yield micro_batch
        finally:
            self._current, self._counters = None, None

    @property
    def current(self) -> "MicroBatchTensors":
        """The bound micro-batch; raises if attention runs outside :meth:`bind`."""
        if self._current is None:
            raise RuntimeError(
                "ByteScaleCoreAttention ran with no micro-batch bound: run the model through "
                "megatron_bytescale.integration.schedule (or wrap the forward and backward in "
                "HDPGroupManager.bind(micro_batch)) so the attention knows its ring and layout"
            )
        return self._current

    @property
    def bound(self) -> "MicroBatchTensors | None":
        """The bound micro-batch, or None outside :meth:`bind` (never raises)."""
        return self._current

    @property
    def counters(self) -> "CommCounters | None":
        return self._counters


_MANAGER: Optional[HDPGroupManager] = None


def set_hdp_manager(manager: Optional[HDPGroupManager]) -> None:
    """Install (or with None, remove) the process-wide manager the attention layers use."""
    global _MANAGER
    _MANAGER = manager


def installed_hdp_manager() -> Optional[HDPGroupManager]:
    """The installed manager, or None (for code that also runs outside HDP)."""
    return _MANAGER


def get_hdp_manager() -> HDPGroupManager:
    """The manager installed by :func:`initialize_hdp_model_parallel` or :func:`set_hdp_manager`."""
    if _MANAGER is None:
        raise RuntimeError(
            "the HDP group manager is not initialised: call "
            "megatron_bytescale.integration.initialize_hdp_model_parallel(...) after "
            "torch.distributed.init_process_group and before running the model"
        )
    return _MANAGER


def initialize_hdp_model_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    hybrid_context_parallel: bool = False,
    attention_backend: Optional[str] = None,
    dkv_wire: str = "accumulator",
    **megatron_kwargs: Any,
) -> HDPGroupManager:
    """Initialise Megatron for HDP (CP = 1, DP = d_hdp) and install the HDP group manager.

    Takes the arguments of ``parallel_state.initialize_model_parallel`` (keywords only);
    ``context_parallel_size`` and ``hybrid_context_parallel`` are accepted only so that a
    request for them is refused with a clear message.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call init_process_group before "
            "initialize_hdp_model_parallel"
        )
    layout = HDPParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron_kwargs.get(
            "virtual_pipeline_model_parallel_size"
        ),
        context_parallel_size=context_parallel_size,
        hybrid_context_parallel=hybrid_context_parallel,
        expert_model_parallel_size=megatron_kwargs.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=megatron_kwargs.get("expert_tensor_parallel_size"),
    )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            context_parallel_size=1,
            hybrid_context_parallel=False,
            **megatron_kwargs,
        )
    # the ring groups wait for a peer as long as Megatron's own groups (its default: 30 minutes)
    timeout = timedelta(minutes=float(megatron_kwargs.get("distributed_timeout_minutes", 30)))
    manager = HDPGroupManager.from_megatron(
        attention_backend=attention_backend, dkv_wire=dkv_wire, timeout=timeout
    )
    found = (manager.size, manager.tp_size, manager.pp_size)
    wanted = (layout.hdp_size, tensor_model_parallel_size, pipeline_model_parallel_size)
    if found != wanted:
        raise RuntimeError(
            f"Megatron is initialised with HDP x TP x PP = {' x '.join(map(str, found))}, "
            f"expected {' x '.join(map(str, wanted))}; was Megatron initialised with another "
            "layout?"
        )
    set_hdp_manager(manager)
    logger.info(
        "HDP initialised: %d HDP ranks x TP %d x PP %d, Megatron CP = 1", *found
    )
    return manager
