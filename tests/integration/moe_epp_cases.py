"""Expert parallelism with TP and with PP: the EP layouts of the MoE TP / PP spawn.

Run by ``moe_parallel_cases.moe_parallel_rank_body`` in the same 4 processes, after its EP-1
layouts, against the same single-process reference (megatron-core's own MoE at TP = PP = EP =
1, every document alone):

* TP 2 x HDP 2 x EP 2 (sequence parallelism; the two HDP ranks of a TP rank form one expert
  group, two of the 4 experts each, split over the TP ranks as megatron-core does by default:
  expert tensor-parallel size = TP size);
* PP 2 x HDP 2 x EP 2 (one MoE layer per stage; at each stage the two pipelines form one expert
  group): a pipeline whose group runs more slots runs empty micro-batches through all its
  stages, so both pipelines' 1F1B issue the same forwards and backwards;

each with the manual plan :func:`ep_rows_plan` (a ring of 2 across both ranks / pipelines, a
pack of two documents, counts 5 / 4: rank 1 runs an empty slot) and the balance scheduler's
plan made with ``ep_size=2``, router losses off and on. At PP 2 a few random global batches
planned by balance with ``ep_size=2`` train too (no reference): the spawn's timeout fails the
test on a deadlock.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .hdp_cases import CAPACITY, VOCAB, cost_model
from .parallel_cases import two_rank_config

EP = 2
PP_STRESS_PLANS = 6

# two HDP ranks (or pipelines), one expert group: documents 1 and 6 (120, 90 tokens > capacity
# 64) are rings of both at slots 1 and 3; documents 2 + 4 are packed; counts 5 / 4
EP_ROWS = [
    [("local", (0,)), ("ring", (1,)), ("local", (2, 4)), ("ring", (6,)), ("local", (5,))],
    [("local", (3,)), ("ring", (1,)), ("local", (7,)), ("ring", (6,))],
]


def ep_rows_plan(lengths: list[int], *, pp_size: int = 1, rows=EP_ROWS, ep_size: int = EP):
    """The plan of ``rows`` on 2 HDP ranks with ``ep_size`` (2: rings at one slot on both)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=2, capacity=CAPACITY, lengths=dict(enumerate(lengths)))
    for j in range(max(len(r) for r in rows)):
        for rank, row in enumerate(rows):
            if j < len(row):
                kind, seqs = row[j]
                if kind == "local":
                    builder.add([rank], list(seqs))
                elif rank == 0:
                    builder.add([0, 1], list(seqs))
    extra = dict(pp_size=pp_size, layers_per_stage=1) if pp_size > 1 else {}
    return builder.build(scheduler="manual", ep_size=ep_size, **extra).validate()


def stress_batches(count: int, seed: int = 11) -> list[list[list[int]]]:
    """``count`` random global batches of 2-7 documents of 5-128 tokens (rings of 1-2)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, n).tolist() for n in rng.integers(5, 129, rng.integers(2, 8))]
            for _ in range(count)]


def run_ep_layouts(out: dict[str, Any], references, sequences, lengths: list[int],
                   record_run: Callable, step: Callable, cases: dict[str, dict]) -> None:
    """TP 2 x EP 2 and PP 2 x EP 2 runs into ``out["runs"]``, the PP stress into
    ``out["ep stress"]`` (``record_run`` / ``step``: the spawn's own helpers)."""
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.planner.plan import expert_slots

    from .moe_cases import moe_config
    from .parallel_cases import fresh_model, switch_layout

    def slots(plan) -> list[int]:
        return [expert_slots(plan, r) for r in range(plan.hdp_size)]

    for layout, pp in (("tp", 1), ("pp", 2)):
        if layout == "tp":
            manager = switch_layout(tensor_model_parallel_size=2, expert_model_parallel_size=EP)
        else:
            manager = switch_layout(pipeline_model_parallel_size=2, expert_model_parallel_size=EP)
        balance = make_step_planner(two_rank_config(scheduler="balance"), hdp_size=manager.size,
                                    cost_model=cost_model(), pp_size=pp, ep_size=EP)
        manual = ep_rows_plan(lengths, pp_size=pp)
        extra = dict(sequence_parallel=True) if layout == "tp" else {}
        for name, case, planner in ((f"{layout} ep manual aux 0", "aux 0", lambda _: manual),
                                    (f"{layout} ep manual aux", "aux", lambda _: manual),
                                    (f"{layout} ep balance aux", "aux", balance)):
            config = moe_config(**cases[case], **extra)
            ran, record, errors = step(config, references[case], sequences, planner, manager)
            record_run(name, ran, record, errors, manager, config)
            out["runs"][name].update(ep_size=manager.ep_size, slots=slots(ran.plan),
                                     expert_group=[int(r) for r in manager.rank_map.ep_global_ranks])

    # PP 2 x EP 2 (the layout still initialised): random plans, empty slots, no deadlock
    config = moe_config(**cases["aux"])
    ddp, optimizer = fresh_model(config, references["aux"])
    stress = {"steps": 0, "trained_tokens": 0, "total_tokens": 0, "empty_slots": 0, "rings": 0}
    for ran in HDPDataIterator(stress_batches(PP_STRESS_PLANS), planner=balance, hdp=manager.hdp):
        record = run_hdp_step(ran, model=ddp, optimizer=optimizer, manager=manager)
        stress["steps"] += 1
        stress["trained_tokens"] += record.tokens
        stress["total_tokens"] += ran.plan.total_tokens
        stress["empty_slots"] += sum(s - n for s, n in zip(slots(ran.plan),
                                                           ran.plan.micro_batch_counts()))
        stress["rings"] += sum(size > 1 for size in ran.plan.ring_sizes())
    stress["stage"] = manager.rank_map.pp_rank
    out["ep stress"] = stress
