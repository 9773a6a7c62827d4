"""MoE at TP 4: the TP-4 layouts of the MoE TP / PP spawn (HDP 1 on the 4 ranks).

Run by ``moe_parallel_cases.moe_parallel_rank_body`` in the same 4 processes, after the ETP
layouts. TP 4 must split the query groups as well as the heads, so the model is the spawn's MoE
GPT with one query group per head (``TP4_QUERY_GROUPS``); its reference is megatron-core's own
MoE of that same model at TP = PP = EP = 1 (every document alone, router losses on), computed
in the spawn's reference phase (``references["tp4 aux"]``). Sequence parallelism throughout
(megatron-core requires it for MoE with TP); one HDP rank, so no rings across ranks: what is
tested is the attention heads and the experts split four ways, and a TP rank routing a quarter
of every micro-batch's rows with the counts summed over the TP group.

* TP 4 x EP 1 (ETP 4, megatron-core's default): every expert split over the 4 TP ranks;
* TP 4 x ETP 1 x EP 4: one whole expert per rank, the expert group is the TP group;
* TP 4 x ETP 2 x EP 2: two experts per expert TP pair, each split over that pair;

the expert group lies inside the one TP group in all three (plan ``ep_size`` 1). Each runs
:func:`tp4_plan`: a pack of three documents, the 120-token document alone in one micro-batch
(a ring of one rank), and the rest alone or in pairs.
"""

from __future__ import annotations

from typing import Any, Callable

TP4_QUERY_GROUPS = 4

# (layout name, ETP, EP)
TP4_LAYOUTS = [("tp4 ep1", 4, 1), ("tp4 etp1 ep4", 1, 4), ("tp4 etp2 ep2", 2, 2)]
TP4_RUNS = [f"{layout} manual aux" for layout, *_ in TP4_LAYOUTS]

# one HDP rank holding the longest document (120 tokens): five micro-batches, a pack of three
TP4_CAPACITY = 128
TP4_ROW = [(1,), (2, 4, 7), (0, 3), (5,), (6,)]


def tp4_plan(lengths: list[int]):
    """The plan of ``TP4_ROW`` on the one HDP rank TP 4 leaves of 4 ranks."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=1, capacity=TP4_CAPACITY, lengths=dict(enumerate(lengths)))
    for seqs in TP4_ROW:
        builder.add([0], list(seqs))
    return builder.build(scheduler="manual").validate()


def run_tp4_layouts(out: dict[str, Any], references, sequences, lengths: list[int],
                    record_run: Callable, step: Callable, cases: dict[str, dict]) -> None:
    """The TP-4 runs into ``out["runs"]`` (``record_run`` / ``step``: the spawn's own helpers),
    each also recording the expert sizes, the expert group and the plan's ``ep_size``."""
    from megatron.core import parallel_state as ps

    from .moe_cases import moe_config
    from .parallel_cases import switch_layout

    manual = tp4_plan(lengths)
    for (layout, etp, ep), name in zip(TP4_LAYOUTS, TP4_RUNS):
        manager = switch_layout(tensor_model_parallel_size=4, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=etp)
        config = moe_config(**cases["aux"], num_query_groups=TP4_QUERY_GROUPS,
                            sequence_parallel=True)
        ran, record, errors = step(config, references["tp4 aux"], sequences, lambda _: manual,
                                   manager)
        record_run(name, ran, record, errors, manager, config)
        out["runs"][name].update(
            ep_size=manager.ep_size, plan_ep_size=ran.plan.ep_size,
            expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
            expert_model_parallel_size=manager.expert_model_parallel_size,
            expert_group=[int(r) for r in manager.rank_map.tp_ep_global_ranks],
            query_groups=config.num_query_groups)
