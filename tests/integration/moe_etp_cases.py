"""Expert-tensor parallelism other than TP: the ETP layouts of the MoE TP / PP spawn.

Run by ``moe_parallel_cases.moe_parallel_rank_body`` in the same 4 processes, after the EP
layouts, against the same single-process reference (megatron-core's own MoE at TP = PP = EP =
1, every document alone). megatron-core lays expert ranks out as ``tp-ep-dp-pp`` with tp = ETP,
so an expert group (its tensor-and-expert group, ETP x EP consecutive ranks) spans
``max(1, ETP x EP / TP)`` consecutive HDP ranks, which the plan keeps in step (its ``ep_size``):

* TP 2 x ETP 1 x EP 2 (sequence parallelism; HDP 2): the expert group is the TP pair of one
  HDP rank, so no rule at all (``ep_size`` 1): every TP rank sends its own rows' tokens to the
  two whole experts of its pair, and expert gradients reduce over the other HDP rank;
* TP 2 x ETP 1 x EP 4 (HDP 2): one expert per rank, the group is all 4 ranks, i.e. both HDP
  ranks (``ep_size`` 2, an empty slot on HDP rank 1);
* TP 1 x ETP 2 x EP 2 (HDP 4): each expert split over two HDP ranks that run different
  micro-batches (megatron-core gathers their tokens over the expert TP group), the group is all
  4 HDP ranks (``ep_size`` 4, empty slots on three of them).

Each runs a manual plan with a ring of 2 and a pack, router losses on. Then ETP other than TP
with PP:

* TP 2 x PP 2 x ETP 1 x EP 2 (sequence parallelism; HDP 1): at each stage the expert group is
  that stage's TP pair (``ep_size`` 1), two whole experts per rank; the TP x PP manual plan
  (six micro-batches through both stages, two packs) and the balance scheduler's plan.
"""

from __future__ import annotations

from typing import Any, Callable

# (layout name, TP, ETP, EP, HDP ranks kept in step)
ETP_LAYOUTS = [("tp2 etp1 ep2", 2, 1, 2, 1), ("tp2 etp1 ep4", 2, 1, 4, 2),
               ("tp1 etp2 ep2", 1, 2, 2, 4)]

# TP 2 x PP 2 x ETP 1 x EP 2: (layout name, TP, PP, ETP, EP, HDP ranks kept in step)
TPP_ETP_LAYOUT = ("tpp etp1 ep2", 2, 2, 1, 2, 1)
TPP_ETP_RUNS = [f"{TPP_ETP_LAYOUT[0]} manual aux", f"{TPP_ETP_LAYOUT[0]} balance aux"]

# four HDP ranks, one expert group: rings of 2 at slot 1 (documents 1 and 6 are longer than the
# capacity 64), a pack of documents 2 + 4; counts 3 / 2 / 2 / 2, so ranks 1-3 run an empty slot
FOUR_RANK_ROWS = [
    [("local", (0,)), ("ring", (1,), (0, 1)), ("local", (2, 4))],
    [("local", (3,)), ("ring", (1,), (0, 1))],
    [("local", (5,)), ("ring", (6,), (2, 3))],
    [("local", (7,)), ("ring", (6,), (2, 3))],
]


def four_rank_plan(lengths: list[int], *, ep_size: int):
    """The plan of ``FOUR_RANK_ROWS`` on 4 HDP ranks (every ring at one slot on its members)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    from .hdp_cases import CAPACITY

    builder = PlanBuilder(hdp_size=4, capacity=CAPACITY, lengths=dict(enumerate(lengths)))
    for j in range(max(len(r) for r in FOUR_RANK_ROWS)):
        for rank, row in enumerate(FOUR_RANK_ROWS):
            if j < len(row):
                kind, seqs, *ring = row[j]
                if kind == "local":
                    builder.add([rank], list(seqs))
                elif rank == ring[0][0]:
                    builder.add(list(ring[0]), list(seqs))
    return builder.build(scheduler="manual", ep_size=ep_size).validate()


def run_etp_layouts(out: dict[str, Any], references, sequences, lengths: list[int],
                    record_run: Callable, step: Callable, cases: dict[str, dict]) -> None:
    """The ETP layouts' runs into ``out["runs"]`` (``record_run`` / ``step``: the spawn's own
    helpers); each also records the expert group and the HDP ranks the plan kept in step."""
    from megatron.core import parallel_state as ps

    from megatron_bytescale.planner.plan import expert_slots

    from .moe_cases import moe_config
    from .moe_epp_cases import ep_rows_plan
    from .parallel_cases import switch_layout

    def record_experts(name, manager, ran) -> None:
        out["runs"][name].update(
            ep_size=manager.ep_size, expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
            expert_model_parallel_size=manager.expert_model_parallel_size,
            expert_group=[int(r) for r in manager.rank_map.tp_ep_global_ranks],
            plan_ep_size=ran.plan.ep_size,
            slots=[expert_slots(ran.plan, r) for r in range(ran.plan.hdp_size)])

    for layout, tp, etp, ep, _ in ETP_LAYOUTS:
        manager = switch_layout(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=etp)
        if manager.size == 4:
            manual = four_rank_plan(lengths, ep_size=manager.ep_size)
        else:
            manual = ep_rows_plan(lengths, ep_size=manager.ep_size)
        name = f"{layout} manual aux"
        config = moe_config(**cases["aux"], **(dict(sequence_parallel=True) if tp > 1 else {}))
        ran, record, errors = step(config, references["aux"], sequences, lambda _: manual,
                                   manager)
        record_run(name, ran, record, errors, manager, config)
        record_experts(name, manager, ran)

    # TP 2 x PP 2 x ETP 1 x EP 2 (HDP 1): each stage's TP pair is its expert group
    from megatron_bytescale.integration.planning import make_step_planner

    from .hdp_cases import bytescale_config, cost_model
    from .moe_parallel_cases import TPP_CAPACITY, tp_pp_plan

    _, tp, pp, etp, ep, _ = TPP_ETP_LAYOUT
    manager = switch_layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    balance = make_step_planner(
        bytescale_config(capacity=TPP_CAPACITY, context_length=TPP_CAPACITY, scheduler="balance"),
        hdp_size=manager.size, cost_model=cost_model(), pp_size=pp, ep_size=manager.ep_size)
    manual = tp_pp_plan(lengths)
    for name, planner in zip(TPP_ETP_RUNS, (lambda _: manual, balance)):
        # a fresh config per model: wrapping one sets its hooks, which SequentialMLP's deepcopy
        # of the config could not copy for the next model
        config = moe_config(**cases["aux"], sequence_parallel=True)
        ran, record, errors = step(config, references["aux"], sequences, planner, manager)
        record_run(name, ran, record, errors, manager, config)
        record_experts(name, manager, ran)
