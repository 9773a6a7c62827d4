"""The HDP runtime: one HDP group, dynamic rings on it, ring attention, plan materialisation.

Imports torch and the planner, never megatron. Nothing happens at import time: no process
group is touched until an :class:`HDPGroup` is created.
"""

from .backends import (
    BACKEND_NAMES,
    AttentionBackend,
    MathBackend,
    Segments,
    TorchBackend,
    accumulation_dtype,
    get_backend,
)
from .chunk_layout import ChunkLayout, chunk_layout_for, make_chunk_layout
from .chunked_attention import ChunkPrefix, chunked_ring_attention
from .counters import CommCounters, MicroBatchCommStats, StepCommStats
from .hdp_group import HDPGroup, Ring, new_ring_groups
from .layout import (
    PAD_TOKEN_ID,
    AttentionLayout,
    MicroBatchTensors,
    SequenceSlot,
    build_micro_batch,
    iter_micro_batches,
    layout_for,
    make_attention_layout,
)
from .offload import ActivationOffloader, MicroBatchOffload, OffloadStats, offload_micro_batch
from .online_softmax import merge_partial_attention
from .p2p_volume import plan_p2p_bytes, ring_attention_p2p_bytes, ring_local_tokens, two_level_p2p_bytes
from .ring_attention import (
    ring_attention,
    ring_attention_backward,
    ring_attention_forward,
    verify_ring_layout,
)
from .ring_comm import RingComm
from .ring_schedule import AttentionBlock, attention_block, prepare_device_metadata, take_rows
from .ring_step import (
    DKV_WIRE_CHOICES,
    EmulatedRing,
    RingForwardState,
    dkv_wire_dtype,
    emulate_ring_attention,
    resolve_backend,
    ring_backward_step,
    ring_forward_step,
    start_ring_forward,
)
from .two_level_ring import two_level_ring_attention

__all__ = [
    "ChunkLayout",
    "ChunkPrefix",
    "chunked_ring_attention",
    "chunk_layout_for",
    "make_chunk_layout",
    "new_ring_groups",
    "AttentionBlock",
    "attention_block",
    "take_rows",
    "DKV_WIRE_CHOICES",
    "EmulatedRing",
    "RingForwardState",
    "accumulation_dtype",
    "dkv_wire_dtype",
    "emulate_ring_attention",
    "prepare_device_metadata",
    "resolve_backend",
    "ring_backward_step",
    "ring_forward_step",
    "start_ring_forward",
    "ActivationOffloader",
    "AttentionBackend",
    "AttentionLayout",
    "BACKEND_NAMES",
    "CommCounters",
    "HDPGroup",
    "MathBackend",
    "MicroBatchCommStats",
    "MicroBatchOffload",
    "MicroBatchTensors",
    "OffloadStats",
    "PAD_TOKEN_ID",
    "Ring",
    "RingComm",
    "Segments",
    "SequenceSlot",
    "StepCommStats",
    "TorchBackend",
    "build_micro_batch",
    "get_backend",
    "iter_micro_batches",
    "layout_for",
    "make_attention_layout",
    "merge_partial_attention",
    "offload_micro_batch",
    "plan_p2p_bytes",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "two_level_p2p_bytes",
    "two_level_ring_attention",
    "ring_attention_p2p_bytes",
    "ring_local_tokens",
    "verify_ring_layout",
]
