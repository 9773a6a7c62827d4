"""``ByteScaleGPTModel``: Megatron's GPTModel with RoPE taken at each token's original position.

Why a subclass: Megatron's ``GPTModel`` builds the rotary table for positions ``0 .. s-1`` of
the *local buffer* and rotates token i of the buffer by position i (with static CP, TE's THD
path re-derives each rank's zigzag positions itself). Under HDP a rank's buffer is neither a
prefix nor one sequence: it packs whole short sequences, each starting again at position 0,
and zigzag shares of long ones (for ring position i, parts i and 2N-1-i, which are not
contiguous). The only reliable source of a token's position is the micro-batch's
``position_ids`` (its index in the original sequence), which Megatron already passes to
``GPTModel.forward``. This subclass replaces the rotary embedding after Megatron's
``_preprocess`` with the table rows gathered by ``position_ids``; attention then applies it
through Megatron's own unfused ``apply_rotary_pos_emb`` (bshd path: one frequency row per
token). Nothing else of the model changes, so its state dict is GPTModel's.

Learned absolute position embeddings already read ``position_ids`` and need no change.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.models.gpt import GPTModel


class ByteScaleGPTModel(GPTModel):
    """GPTModel whose RoPE rotates every token by its position in its original sequence.

    With MoE layers, the routers' aux-loss and z-loss take their HDP meaning
    (:func:`.moe.install_hdp_router_losses`, docs/moe.md).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config", args[0] if args else None)
        if getattr(config, "num_moe_experts", None):
            from .compat import enable_moe_router_without_te
            from .moe import check_moe_config

            check_moe_config(config)  # before building: refusals name their flags
            enable_moe_router_without_te()
        super().__init__(*args, **kwargs)
        if getattr(self.config, "num_moe_experts", None):
            from .moe import install_hdp_router_losses

            install_hdp_router_losses(self)

    def _preprocess(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any
    ):
        output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if (
            self.position_embedding_type != "rope"
            or getattr(self.config, "multi_latent_attention", False)
            or output[1] is None
        ):
            return output
        if position_ids is None:
            raise ValueError(
                "ByteScaleGPTModel needs position_ids (each token's position in its original "
                "sequence) to apply RoPE to an HDP micro-batch"
            )
        return (output[0], self.rotary_for_positions(position_ids), *output[2:])

    def rotary_for_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """RoPE frequencies ``[s, b, 1, dim]`` for ``position_ids`` of shape ``[b, s]``."""
        table = self._rotary_table(position_ids.device)  # [max_len, dim]
        max_position = self.max_sequence_length
        highest = _highest_position(position_ids)
        if highest is not None:
            if highest >= max_position:
                raise ValueError(
                    f"position {highest} is beyond the model's max_sequence_length "
                    f"({max_position}); raise --max-position-embeddings"
                )
        freqs = table[position_ids.t()]  # [s, b, dim]
        return freqs.unsqueeze(2)

    def _rotary_table(self, device: torch.device) -> torch.Tensor:
        cached: Optional[torch.Tensor] = getattr(self, "_bytescale_rope_table", None)
        if cached is None or cached.device != device:
            emb = self.rotary_pos_emb.get_emb(self.max_sequence_length)  # [max_len, 1, 1, dim]
            cached = emb[:, 0, 0, :].to(device, non_blocking=True)  # once per device
            self._bytescale_rope_table = cached
        return cached


def _highest_position(position_ids: torch.Tensor) -> Optional[int]:
    """The largest position, known on the host without reading a device tensor back (D12).

    The bound HDP micro-batch knows it from its layout (the same path on every device);
    without one, a CPU tensor is read (free) and a device tensor is not checked (an
    out-of-range index still fails in the gather).
    """
    if not position_ids.numel() or torch.compiler.is_compiling():
        return None
    from .groups import installed_hdp_manager

    manager = installed_hdp_manager()
    bound = manager.bound if manager is not None else None
    if bound is not None:
        return bound.layout.max_position
    return int(position_ids.max()) if position_ids.device.type == "cpu" else None
