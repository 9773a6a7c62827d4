"""The HDP group manager: how ByteScale replaces Megatron's context-parallel groups.

Megatron builds a *static* context-parallel (CP) group per rank at start-up, and its TE
attention runs one ring over that fixed group for every micro-batch. ByteScale instead gives
every micro-batch its own ring, of any size, on any ranks (DESIGN.md D1-D3):

* Megatron is initialised with **CP = 1 and DP = d_hdp** (= the DP x CP a static run would
  use). Megatron's data-parallel group, ``get_data_parallel_group(with_context_parallel=True)``,
  *is* the HDP group: DDP reduces gradients over it, the distributed optimizer shards over it
  (ZeRO-1 over all HDP ranks), and ``finalize_model_grads`` all-reduces the token count over it.
* No other process group is created. A ring is an ordered tuple of HDP ranks
  (``runtime.Ring``) and its traffic is batched P2P on that one group (D2).
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
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:  # runtime types, imported lazily at run time
    from megatron_bytescale.runtime import CommCounters, HDPGroup, MicroBatchTensors

logger = logging.getLogger(__name__)

PP_SCHEDULE_ISSUE = (
    "the HDP pipeline-parallel schedule driver is a later issue (PP > 1 is not served yet)"
)


@dataclass(frozen=True, kw_only=True)
class HDPParallelLayout:
    """A Megatron parallel layout as HDP sees it; construction refuses what HDP cannot serve.

    ``context_parallel_size`` and ``hybrid_context_parallel`` are what the user asked Megatron
    for. HDP *replaces* both, so they must be 1 / False: the ranks a static run would spend on
    CP are part of the HDP (data-parallel) group instead.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    hybrid_context_parallel: bool = False
    expert_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size ({self.world_size}) must be >= 1")
        if self.context_parallel_size != 1:
            raise ValueError(
                f"--context-parallel-size {self.context_parallel_size} cannot be combined with "
                "--bytescale-hdp: HDP replaces Megatron's static context parallelism. Run with "
                "--context-parallel-size 1; the ranks go to the HDP (data-parallel) group, and "
                "long sequences get rings of the size they need"
            )
        if self.hybrid_context_parallel:
            raise ValueError(
                "--hybrid-context-parallel cannot be combined with --bytescale-hdp: both plan "
                "per-sequence rings over the DP x CP ranks; use one of them (ByteScale's rings "
                "are of any size on any ranks, Megatron's are aligned powers of two)"
            )
        if self.pipeline_model_parallel_size != 1 or self.virtual_pipeline_model_parallel_size:
            virtual = (
                f" (virtual {self.virtual_pipeline_model_parallel_size})"
                if self.virtual_pipeline_model_parallel_size
                else ""
            )
            raise ValueError(
                f"--pipeline-model-parallel-size {self.pipeline_model_parallel_size}{virtual} is "
                f"not supported with --bytescale-hdp yet: {PP_SCHEDULE_ISSUE}. Run with "
                "--pipeline-model-parallel-size 1"
            )
        if self.tensor_model_parallel_size != 1:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tensor_model_parallel_size} is not supported "
                "with --bytescale-hdp yet (HDP with TP > 1 has not been validated); run with "
                "--tensor-model-parallel-size 1"
            )
        if self.expert_model_parallel_size != 1:
            raise ValueError(
                f"--expert-model-parallel-size {self.expert_model_parallel_size} is not supported "
                "with --bytescale-hdp yet (MoE expert parallelism has not been validated)"
            )
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % model_parallel:
            raise ValueError(
                f"world size {self.world_size} is not divisible by TP x PP = {model_parallel}"
            )

    @property
    def hdp_size(self) -> int:
        """Number of HDP ranks (= Megatron's data-parallel size with CP = 1)."""
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    @classmethod
    def from_megatron_args(cls, args: Any) -> "HDPParallelLayout":
        """Check a Megatron ``args`` namespace (after ``parse_args``)."""
        return cls(
            world_size=int(getattr(args, "world_size", 1) or 1),
            tensor_model_parallel_size=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            pipeline_model_parallel_size=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            virtual_pipeline_model_parallel_size=getattr(
                args, "virtual_pipeline_model_parallel_size", None
            ),
            context_parallel_size=int(getattr(args, "context_parallel_size", 1) or 1),
            hybrid_context_parallel=bool(getattr(args, "hybrid_context_parallel", False)),
            expert_model_parallel_size=int(getattr(args, "expert_model_parallel_size", 1) or 1),
        )


class HDPGroupManager:
    """The HDP group plus the micro-batch running now; what the core attention consults.

    Args:
        hdp: the runtime's ``HDPGroup`` over Megatron's data-parallel group.
        attention_backend: passed to ``runtime.ring_attention`` (None lets it choose).

    ``two_level_topology``: when set (``--bytescale-two-level-ring``), rings over several whole
    nodes of it run ``runtime.two_level_ring_attention``; None runs every ring flat.
    """

    def __init__(self, hdp: "HDPGroup", *, attention_backend: Optional[str] = None) -> None:
        self.hdp = hdp
        self.attention_backend = attention_backend
        self.two_level_topology: Any = None
        self._current: "MicroBatchTensors | None" = None
        self._counters: "CommCounters | None" = None

    @classmethod
    def from_megatron(cls, *, attention_backend: Optional[str] = None) -> "HDPGroupManager":
        """Wrap Megatron's (already initialised) data-parallel group as the HDP group."""
        from megatron.core import parallel_state

        from megatron_bytescale.runtime import HDPGroup

        if parallel_state.get_context_parallel_world_size() != 1:
            raise ValueError(
                "Megatron was initialised with context-parallel size "
                f"{parallel_state.get_context_parallel_world_size()}; HDP needs 1 "
                "(use initialize_hdp_model_parallel)"
            )
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return cls(HDPGroup(group), attention_backend=attention_backend)

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
    def counters(self) -> "CommCounters | None":
        return self._counters


_MANAGER: Optional[HDPGroupManager] = None


def set_hdp_manager(manager: Optional[HDPGroupManager]) -> None:
    """Install (or with None, remove) the process-wide manager the attention layers use."""
    global _MANAGER
    _MANAGER = manager


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
    )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            context_parallel_size=1,
            hybrid_context_parallel=False,
            **megatron_kwargs,
        )
    manager = HDPGroupManager.from_megatron(attention_backend=attention_backend)
    if manager.size != layout.hdp_size:
        raise RuntimeError(
            f"Megatron's data-parallel group has {manager.size} ranks, expected the HDP size "
            f"{layout.hdp_size}; was Megatron initialised with another layout?"
        )
    set_hdp_manager(manager)
    logger.info("HDP initialised: %d HDP ranks, Megatron CP = 1", manager.size)
    return manager
