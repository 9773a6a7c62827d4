"""Which HDP ranks a MoE layer's expert group ties together (pure arithmetic, no process).

megatron-core lays expert ranks out as ``tp-ep-dp-pp`` with tp = the expert tensor-parallel size
(ETP), so an expert group (its tensor-and-expert-parallel group: every rank a MoE layer exchanges
tokens with) is a block of ETP x EP consecutive ranks of a stage, while an HDP rank is a block of
TP consecutive ranks. The HDP ranks such a block covers must run the same slots (the plan's
``ep_size``). The planner (:mod:`.presets`, :mod:`.moe_cost`, the CLI) and the integration
(:class:`megatron_bytescale.integration.groups.HDPRankMap`, which checks Megatron's actual groups
against this rule) share these functions; they live here because the planner imports no torch.
"""

from __future__ import annotations

from typing import Optional


def expert_lockstep_refusal(tp: int, etp: Optional[int], ep: int, *,
                            who: str = "--bytescale-hdp cannot serve") -> Optional[str]:
    """Why an expert group of ``etp x ep`` ranks cannot be kept in step by HDP plans (None: it can).
    ``who`` completes "which ..." in the message (the training flag, or the planner's words).

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
            f"{who}: an expert group must hold whole TP groups or lie "
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


def expert_parallel_group(rank: int, *, etp: int, ep: int) -> list[int]:
    """The ranks of ``rank``'s EP group (its all-to-all peers) in a stage laid out ``tp-ep-dp-pp``
    with tp = ``etp``: ``ep`` ranks ``etp`` apart inside the block of ``etp x ep`` consecutive
    ranks that holds ``rank`` (ranks counted within the stage)."""
    block = etp * ep
    start = rank // block * block + rank % etp
    return [start + j * etp for j in range(ep)]
