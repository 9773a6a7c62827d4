"""Which HDP ranks a MoE layer's expert group ties together (pure arithmetic, no process).

megatron-core lays expert ranks out as ``tp-ep-dp-pp`` with tp = the expert tensor-parallel size
(ETP), so an expert group (its tensor-and-expert-parallel group: every rank a MoE layer exchanges
tokens with) is a block of ETP x EP consecutive ranks of a stage, while an HDP rank is a block of
TP consecutive ranks. The HDP ranks such a block covers must run the same slots (the plan's
``ep_size``); :class:`.groups.HDPRankMap` checks Megatron's actual groups against this rule.
"""

from __future__ import annotations

from typing import Any, Optional


def expert_lockstep_refusal(tp: int, etp: Optional[int], ep: int) -> Optional[str]:
    """Why an expert group of ``etp x ep`` ranks cannot be kept in step by HDP plans (None: it can).

    megatron-core lays expert ranks out as ``tp-ep-dp-pp`` with tp = ETP, so an expert group
    (its tensor-and-expert group) is a block of ETP x EP consecutive ranks of a stage, while an
    HDP rank is a block of TP consecutive ranks. When one size divides the other the expert
    group covers whole HDP ranks or lies inside one; otherwise it would take part of an HDP
    rank's TP group, whose ranks then could not all run the same micro-batch.
    """
    etp = etp or tp
    block = etp * ep
    if block % tp and tp % block:
        return (
            f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} = {block} "
            f"and --tensor-model-parallel-size {tp} do not divide one another, which "
            "--bytescale-hdp cannot serve: an expert group must hold whole TP groups or lie "
            "inside one; choose sizes where one divides the other"
        )
    return None


def expert_lockstep_size(tp: int, etp: Optional[int], ep: int) -> int:
    """How many consecutive HDP ranks one expert group spans, hence must run the same slots
    (the plan's ``ep_size``): ``max(1, ETP x EP / TP)``.

    An expert group inside one TP group (ETP x EP <= TP) needs no rule: the TP ranks of an HDP
    rank always run the same micro-batch. ``etp`` None means Megatron's default, the TP size.
    Raises ValueError (:func:`expert_lockstep_refusal`) when the sizes do not divide one another.
    """
    why = expert_lockstep_refusal(tp, etp, ep)
    if why:
        raise ValueError(why)
    return max(1, (etp or tp) * ep // tp)


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
