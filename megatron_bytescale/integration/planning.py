"""Turn a :class:`ByteScaleConfig` and a cost model into the planner function the iterator calls."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

from megatron_bytescale.env import MAX_PROCESSES, env_int
from megatron_bytescale.planner.cost_model import CostModel
from megatron_bytescale.planner.plan import StepPlan
from megatron_bytescale.planner.topology import Topology

from .config import ByteScaleConfig
from .expert_layout import expert_block_of_args, expert_block_words


def make_step_planner(
    config: ByteScaleConfig,
    *,
    hdp_size: int,
    cost_model: CostModel,
    scheduler: Optional[str] = None,
    global_ranks: Optional[Sequence[int]] = None,
    topology: Optional[Topology] = None,
    pp_size: int = 1,
    ep_size: int = 1,
    vpp_size: int = 1,
) -> Callable[[list[int]], StepPlan]:
    """``lengths -> StepPlan`` with the config's scheduler (or ``scheduler``), capacity, etc.

    The function is deterministic (same lengths, same plan on every rank), which the
    ``every_rank`` plan mode relies on. ``global_ranks`` (the global rank of every HDP rank;
    default ``0 .. hdp_size - 1``) places HDP ranks on nodes (:func:`hdp_topology`), unless
    ``topology`` gives the nodes. ``--bytescale-two-level-ring`` plans with two-level rings
    (the runtime must then run them: ``HDPGroupManager.two_level_topology``).
    ``pp_size`` must be the run's pipeline depth (``HDPGroupManager.pp_size``): with PP > 1
    the balance scheduler plans PP-Balance (ring micro-batches at the same local index in every
    member pipeline, which the 1F1B driver needs), and the drivers refuse a plan made for
    another depth. It must divide the cost model's layers. ``ep_size`` must be the HDP ranks one
    of the run's expert groups spans (``HDPGroupManager.ep_size``, ``ETP x EP / TP`` or 1; not
    Megatron's EP size): ring micro-batches then sit at the same local index on all members, so
    each expert group meets slot by slot (``StepPlan.ep_size``).
    ``vpp_size`` > 1: the run's virtual stages per stage
    (``--virtual-pipeline-model-parallel-size``); plans carry it and are estimated with the
    interleaved schedule the driver runs.
    """
    from megatron_bytescale.planner.schedulers import make_plan

    capacity = config.require_capacity()
    chosen = scheduler or config.scheduler
    if config.context_length is not None and not config.offload:
        if config.context_length > hdp_size * capacity:
            raise ValueError(
                f"--bytescale-capacity {capacity} is too small: a sequence of the context length "
                f"(--bytescale-context-length {config.context_length}) needs "
                f"{-(-config.context_length // capacity)} ranks, and there are {hdp_size} HDP "
                "ranks; raise the capacity, use more ranks, shorten the context, or enable "
                "--bytescale-offload"
            )

    cost_model.layers_per_stage(pp_size)  # refuses a depth that does not divide the layers
    if topology is None:
        topology = hdp_topology(config, hdp_size=hdp_size, cost_model=cost_model, global_ranks=global_ranks)
    if config.two_level_ring:
        cost_model = cost_model.with_(two_level_ring=True)
    if config.host_memory_gb is not None:
        cost_model = cost_model.with_(host_memory_bytes=config.host_memory_gb * 1e9)

    if config.seq_split:
        check_seq_split_flags(config, scheduler=chosen, pp_size=pp_size, ep_size=ep_size, vpp_size=vpp_size)
    if vpp_size != 1:
        from megatron_bytescale.planner.plan import check_virtual_pipeline

        check_virtual_pipeline(vpp_size, pp_size, cost_model.layers_per_stage(pp_size))

    def plan(lengths: list[int]) -> StepPlan:
        return make_plan(
            lengths,
            scheduler=chosen,
            hdp_size=hdp_size,
            capacity=capacity,
            cost_model=cost_model,
            pp_size=pp_size,
            ep_size=ep_size,
            offload=config.offload,
            overlong=config.overlong,
            align=config.align,
            context_length=config.context_length,
            topology=topology,
            seq_split=config.seq_split,
            virtual_pipeline_size=vpp_size,
        )

    return plan


def check_seq_split_flags(config: ByteScaleConfig, *, scheduler: str, pp_size: int, ep_size: int,
                          vpp_size: int, expert_block: Optional[str] = None) -> None:
    """Raise ValueError in one line, naming the flags, unless ``--bytescale-seq-split`` can run:
    split chunks run in the plain 1F1B driver only, never offload, and expert groups that span
    several HDP ranks need every ring at one slot (which a split's shifted orders do not keep).
    ``ep_size``: that span, the lockstep block (``HDPGroupManager.ep_size``), not Megatron's EP
    size: an expert group inside one TP group (block 1) runs a split like a dense model;
    ``expert_block``: how to name it with the flags' values (:func:`expert_block_words`)."""
    from megatron_bytescale.planner.schedulers import seq_split_conflicts

    words = {
        "scheduler": f"--bytescale-scheduler {scheduler} (use balance)",
        "pp": f"--pipeline-model-parallel-size {pp_size} (needs >= 2)",
        "vpp": f"--virtual-pipeline-model-parallel-size {vpp_size} (drop it)",
        "ep": f"{expert_block or expert_block_words(ep_size)}, needs 1 (an expert group inside "
              "one TP group)",
        "offload": "--bytescale-offload (use --no-bytescale-offload)",
    }
    why = seq_split_conflicts(scheduler=scheduler, pp_size=pp_size, ep_size=ep_size,
                              virtual_pipeline_size=vpp_size, offload=config.offload)
    if why:
        raise ValueError("--bytescale-seq-split does not run with " + ", ".join(words[k] for k in why))


def seq_split_refusals(args: Any) -> list[str]:
    """What ``--bytescale-seq-split`` does not run with, from Megatron's ``args`` (one line each):
    :func:`check_seq_split_flags`'s rules, plus activation recomputation (a recomputed forward
    is a second forward of a chunk, which its kept prefix refuses)."""
    if not getattr(args, "bytescale_seq_split", False):
        return []
    config = ByteScaleConfig(offload=bool(getattr(args, "bytescale_offload", False)))
    block = expert_block_of_args(args)
    etp = getattr(args, "expert_tensor_parallel_size", None)
    try:
        check_seq_split_flags(
            config, scheduler=str(getattr(args, "bytescale_scheduler", "balance")),
            pp_size=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            ep_size=block,
            expert_block=expert_block_words(
                block, tp=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                etp=int(etp) if etp else None,
                ep=int(getattr(args, "expert_model_parallel_size", 1) or 1)),
            vpp_size=int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
        )
        reasons = []
    except ValueError as exc:
        reasons = [str(exc)]
    granularity = getattr(args, "recompute_granularity", None)
    if granularity:
        reasons.append(f"--bytescale-seq-split does not run with --recompute-granularity {granularity} "
                       "(a recomputed forward repeats a chunk its kept K/V has seen); drop that flag")
    return reasons


def hdp_topology(
    config: ByteScaleConfig,
    *,
    hdp_size: int,
    cost_model: CostModel,
    global_ranks: Optional[Sequence[int]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Topology:
    """The node of every HDP rank: ``global_rank // ranks_per_node``.

    ``ranks_per_node`` is ``--bytescale-ranks-per-node``, else ``LOCAL_WORLD_SIZE`` (torchrun
    starts that many processes per node and numbers global ranks node by node), else the cost
    model's own ``ranks_per_node`` over consecutive HDP ranks. With TP > 1 the HDP group strides
    over global ranks, so fewer HDP ranks share a node than processes do; the map says so.
    """
    env = os.environ if environ is None else environ
    per_node = config.ranks_per_node
    if per_node is None:
        per_node = env_int("LOCAL_WORLD_SIZE", low=1, high=MAX_PROCESSES, environ=env,
                           hint="torchrun sets it to the processes per node; fix or unset it, or "
                                "pass --bytescale-ranks-per-node with the processes per node")
    if per_node is None:
        return Topology.of(cost_model)
    ranks = list(range(hdp_size)) if global_ranks is None else [int(r) for r in global_ranks]
    if len(ranks) != hdp_size:
        raise ValueError(f"global_ranks names {len(ranks)} ranks but the HDP group has {hdp_size}")
    return Topology.from_global_ranks(ranks, per_node)


def check_two_level_heads(num_kv_heads_per_rank: int, topology: Topology) -> None:
    """Raise unless the key/value heads of one tensor-parallel rank split over the HDP ranks of a
    node (the two-level ring's all-to-all gives each of them ``heads / ranks`` of every head
    kind)."""
    per_node = topology.ranks_per_node
    if per_node > 1 and num_kv_heads_per_rank % per_node:
        raise ValueError(
            f"--bytescale-two-level-ring splits the {num_kv_heads_per_rank} key/value heads of a "
            f"tensor-parallel rank over the {per_node} HDP ranks of a node, which does not divide "
            f"them; use a tensor-parallel size that leaves a multiple of {per_node} key/value "
            "heads per rank, or run without --bytescale-two-level-ring"
        )
