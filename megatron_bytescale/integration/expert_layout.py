"""Which HDP ranks a MoE layer's expert group ties together: the planner's pure arithmetic
(:mod:`megatron_bytescale.planner.expert_layout`), imported here for the integration modules
that check Megatron's groups against it (the planner imports no torch or megatron, so the
functions live there and this module re-exports them), and how refusals name the block."""

from __future__ import annotations

from typing import Any, Optional

from megatron_bytescale.planner.expert_layout import expert_lockstep_refusal, expert_lockstep_size

__all__ = ["BLOCK_FLAGS", "expert_block_of_args", "expert_block_words", "expert_lockstep_refusal",
           "expert_lockstep_size"]


BLOCK_FLAGS = ("--expert-tensor-parallel-size x --expert-model-parallel-size / "
               "--tensor-model-parallel-size")


def expert_block_words(block: int, *, tp: Optional[int] = None, etp: Optional[int] = None,
                       ep: Optional[int] = None) -> str:
    """How a refusal names the lockstep block: ``expert groups of B HDP ranks (<flags> = B)``,
    with the flags' values when the caller knows them. One wording for the layout check, the
    planner hooks and the drivers, so a user sees which flags make the block (not the EP size
    alone, which is the block only when ETP = TP)."""
    if tp and ep:
        sizes = (f"--expert-tensor-parallel-size {etp or tp} x --expert-model-parallel-size {ep} "
                 f"/ --tensor-model-parallel-size {tp}")
    else:
        sizes = BLOCK_FLAGS
    return f"expert groups of {block} HDP ranks ({sizes} = {block})"


def expert_block_of_args(args: Any) -> int:
    """The lockstep block of Megatron-LM ``args`` (:func:`expert_lockstep_size`); 1 when the
    sizes do not divide one another, which :class:`.groups.HDPParallelLayout` refuses itself
    (so a second refusal of the same sizes is not reported)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    if expert_lockstep_refusal(tp, int(etp) if etp else None, ep):
        return 1
    return expert_lockstep_size(tp, int(etp) if etp else None, ep)
