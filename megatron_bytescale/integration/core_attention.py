"""``ByteScaleCoreAttention``: Megatron's core-attention slot filled with dynamic-ring attention.

Shape legend (Megatron's): s = tokens in this rank's buffer, b = batch (always 1 under HDP),
np = query heads per TP partition, ng = key/value groups per partition, hn = head dim,
hp = np * hn. In the runtime's THD terms: T = s, Nq = np, Nkv = ng, H = hn.

Megatron's ``SelfAttention`` computes q, k, v, applies RoPE, and calls its ``core_attention``
submodule as ``core_attention(query, key, value, attention_mask, attn_mask_type=...,
attention_bias=..., packed_seq_params=...)`` with ``[s, b, np, hn]`` tensors and expects
``[s, b, hp]`` back. This module keeps that contract. Under HDP a rank's buffer is one packed
row (b = 1) holding whole short sequences and/or zigzag shares of long ones; where each
sequence starts and which ring the micro-batch runs on are not in the tensors, so they come
from the micro-batch bound to the :class:`~.groups.HDPGroupManager` (Megatron's THD
``PackedSeqParams`` cannot carry them, and the local spec rejects it anyway). The work is done
by the runtime's ``ring_attention``: exact causal attention of every original sequence, with
GQA, across the ring, differentiable.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .groups import get_hdp_manager

logger = logging.getLogger(__name__)


class ByteScaleCoreAttention(MegatronModule):
    """Drop-in for Megatron's ``DotProductAttention`` running the current micro-batch's ring.

    Constructor and forward take the same arguments as ``DotProductAttention`` (megatron-core
    0.16.1). Configurations the ring kernel does not implement are refused at construction:
    non-causal masks, attention dropout, sliding windows, non-vanilla softmax, Megatron CP.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        num_splits: Optional[int] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        _refuse_unsupported(config, attn_mask_type, attention_dropout, self.layer_number)
        for name, value in (("k_channels", k_channels), ("v_channels", v_channels)):
            if value is not None and value != config.kv_channels:
                raise ValueError(
                    f"{name} ({value}) differs from kv_channels ({config.kv_channels}); "
                    "ByteScaleCoreAttention needs one head dim for q, k and v"
                )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        if config.num_attention_heads % tp_size or config.num_query_groups % tp_size:
            raise ValueError(
                f"attention heads ({config.num_attention_heads}) and query groups "
                f"({config.num_query_groups}) must divide by the TP size ({tp_size}): every TP "
                "rank runs the ring attention on its own heads; choose "
                "--tensor-model-parallel-size to divide --num-attention-heads and "
                "--num-query-groups"
            )
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.head_dim = config.kv_channels
        self.hidden_per_partition = self.heads_per_partition * self.head_dim
        # Megatron's query-key layer scaling divides the scale by the layer number and
        # multiplies the fp32 scores back; the net softmax input is unchanged, so ignore it.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        _warn_about_core_attention_recompute(config)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[Any] = None,
    ) -> torch.Tensor:
        """[s, 1, np, hn] q and [s, 1, ng, hn] k/v in, [s, 1, hp] out."""
        if packed_seq_params is not None:
            raise ValueError(
                "ByteScaleCoreAttention takes no PackedSeqParams: the micro-batch layout comes "
                "from the HDP group manager; do not pass packed_seq_params to the model"
            )
        if attention_bias is not None:
            raise ValueError("ByteScaleCoreAttention does not support an attention bias")
        if query.dim() != 4 or query.size(1) != 1:
            raise ValueError(
                f"ByteScaleCoreAttention expects [s, 1, heads, head_dim] inputs (one packed row "
                f"per micro-batch), got query of shape {tuple(query.shape)}"
            )
        from megatron_bytescale.runtime import ring_attention

        manager = get_hdp_manager()
        layout = manager.current.layout
        rows, tail = layout.num_tokens, query.size(0) - layout.num_tokens
        if tail < 0:
            raise ValueError(
                f"the micro-batch has {query.size(0)} rows but its attention layout needs "
                f"{rows}; feed the model the bound micro-batch's tokens"
            )
        if not layout.slots:  # an empty slot of expert parallelism: nothing to attend to
            return query.new_zeros(query.size(0), 1, query.size(2) * query.size(3)) + 0 * (
                query.sum() + key.sum() + value.sum())
        # rows past the layout pad the micro-batch to a multiple of the TP size (sequence
        # parallelism): they attend to nothing and get output 0 (and zero gradients)
        q_TNH = query[:rows, 0].contiguous()
        k_TNH = key[:rows, 0].contiguous()
        v_TNH = value[:rows, 0].contiguous()
        current = manager.current
        if getattr(current, "chunk", None) is not None:  # a chunk of a split micro-batch: attends to kept K/V too
            from megatron_bytescale.runtime import ChunkPrefix, chunked_ring_attention

            if current.chunk_prefixes is None:
                raise ValueError(
                    f"micro-batch of order {current.order} is chunk {current.chunk.chunk} of "
                    f"{current.chunk.num_chunks} but has no shared prefixes; split micro-batches "
                    "run only in the pipeline driver"
                )
            prefix = current.chunk_prefixes.setdefault(
                self.layer_number, ChunkPrefix(current.chunk.num_chunks)
            )
            out_TNH = chunked_ring_attention(
                q_TNH, k_TNH, v_TNH, current.chunk, prefix, manager.hdp,
                softmax_scale=self.softmax_scale, backend=manager.attention_backend,
                counters=manager.counters,
            )  # fmt: skip
            out = out_TNH.reshape(rows, 1, -1)
            return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, tail)) if tail else out
        if manager.two_level_topology is not None:
            from megatron_bytescale.runtime import two_level_ring_attention

            out_TNH = two_level_ring_attention(
                q_TNH,
                k_TNH,
                v_TNH,
                layout,
                manager.hdp,
                topology=manager.two_level_topology,
                softmax_scale=self.softmax_scale,
                backend=manager.attention_backend,
                counters=manager.counters,
                dkv_wire=manager.dkv_wire,
            )
            out = out_TNH.reshape(rows, 1, -1)
            return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, tail)) if tail else out
        out_TNH = ring_attention(
            q_TNH,
            k_TNH,
            v_TNH,
            layout,
            manager.hdp,
            softmax_scale=self.softmax_scale,
            backend=manager.attention_backend,
            counters=manager.counters,
            dkv_wire=manager.dkv_wire,
        )
        out = out_TNH.reshape(rows, 1, -1)
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, tail)) if tail else out


_RECOMPUTE_WARNED = False


def _warn_about_core_attention_recompute(config: TransformerConfig) -> None:
    """Selective recompute of ``core_attn`` is correct here but costs a ring for nothing: say so.

    Megatron checkpoints the core attention (its default ``--recompute-modules`` under
    ``--recompute-granularity selective``) to drop an unfused attention's s x s scores. The ring
    attention keeps only q, k, v (which the checkpoint keeps anyway), the output and the
    log-sum-exp, O(s) like flash attention, so recomputing it saves only the output and reruns
    the whole ring forward, all its P2P included, in the backward. It stays correct (the
    micro-batch stays bound through the backward, and every ring member recomputes the same
    layer at the same point), so it is allowed, once with a warning.
    """
    global _RECOMPUTE_WARNED
    if _RECOMPUTE_WARNED or getattr(config, "recompute_granularity", None) != "selective":
        return
    if "core_attn" not in (getattr(config, "recompute_modules", None) or ()):
        return
    _RECOMPUTE_WARNED = True
    logger.warning(
        "selective recompute of core_attn reruns the ring attention's forward (all its P2P) in "
        "the backward to save only its output: the ring keeps O(s) state like flash attention. "
        "Drop core_attn from --recompute-modules (e.g. --recompute-modules layernorm mlp) or "
        "use --recompute-granularity full to trade compute for memory"
    )


def _refuse_unsupported(
    config: TransformerConfig,
    attn_mask_type: AttnMaskType,
    attention_dropout: Optional[float],
    layer_number: int,
) -> None:
    if config.context_parallel_size != 1:
        raise ValueError(
            f"context_parallel_size is {config.context_parallel_size}; HDP runs Megatron with "
            "CP = 1 and forms its own rings"
        )
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(
            f"ByteScaleCoreAttention implements causal attention only, got {attn_mask_type}"
        )
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by the ring attention; set "
            "--attention-dropout 0"
        )
    window = getattr(config, "window_size", None)
    if window is not None:
        raise ValueError(f"sliding-window attention (window_size={window}) is not supported")
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise ValueError(f"softmax_type {softmax_type!r} is not supported (only 'vanilla')")
