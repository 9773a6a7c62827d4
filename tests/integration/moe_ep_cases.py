"""Per-rank body of the expert-parallel MoE test (4 gloo processes, ONE spawn for every check).

Reference: as in ``moe_cases`` (megatron-core's own local MoE GPT, every document alone,
per-token loss, its router losses of each document alone), computed once by rank 0 with
Megatron at EP = 1 (``moe_parallel_cases._reference_phase``). Then, in the same processes,
Megatron is re-initialised with ``--expert-model-parallel-size 2`` on the 4 HDP ranks: expert
groups {0, 1} and {2, 3}, two of the 4 experts on each rank, the MoE dispatcher's all-to-all
(or all-gather) over the expert group, expert gradients reduced over the expert-data-parallel
group {0, 2} / {1, 3}, dense gradients over all 4.

Plans (``StepPlan.ep_size`` 2):

* manual (:func:`ep_manual_plan`): a ring of 2 across the expert groups (ranks 1 and 2) in slot
  0, a ring inside group {0, 1} in slot 1, a pack of two documents; group {0, 1} runs 3 slots
  and group {2, 3} 2, and rank 1 has nothing to train in slot 2: it runs an empty micro-batch
  there (zero tokens into its group's all-to-alls);
* the balance scheduler's plan with ``ep_size=2``;
* a stress run: 30 random global batches, each planned by ``balance`` with ``ep_size=2`` and
  trained (one step each, no reference): the spawn's timeout fails the test on a deadlock.

Each rank compares every reduced gradient (its two experts, the router, the dense weights) with
the matching slice of the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .hdp_cases import CAPACITY, VOCAB, bytescale_config, cost_model
from .moe_cases import MOE_LENGTHS
from .moe_parallel_cases import CASES, _reference_phase, _step

EP = 2
STRESS_PLANS = 30


def ep_manual_plan(*, ep_size: int = EP, rank0_local_first: bool = False):
    """Slots: 0 = ring [1, 2] (doc 1), doc 0 on 0, doc 3 on 3; 1 = ring [0, 1] (doc 6), doc 5
    on 2, docs 2 + 4 packed on 3; 2 = doc 7 on 0, an empty slot on 1. Counts 3 / 2 / 2 / 2.

    ``rank0_local_first`` puts doc 7 before the ring [0, 1] on rank 0: the same micro-batches,
    but the ring then sits at local index 2 on rank 0 and 1 on rank 1 (what EP forbids)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=4, capacity=CAPACITY, lengths=dict(enumerate(MOE_LENGTHS)))
    builder.add([1, 2], [1])
    builder.add([0], [0])
    builder.add([3], [3])
    if rank0_local_first:
        builder.add([0], [7])
    builder.add([0, 1], [6])
    builder.add([2], [5])
    builder.add([3], [2, 4])
    if not rank0_local_first:
        builder.add([0], [7])
    return builder.build(scheduler="manual", ep_size=ep_size)


def stress_batches(count: int, seed: int = 7) -> list[list[list[int]]]:
    """``count`` random global batches of 3-9 documents of 5-200 tokens (rings of 1-4)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, VOCAB, n).tolist() for n in rng.integers(5, 200, rng.integers(3, 10))]
            for _ in range(count)]


def moe_ep_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.planner.plan import expert_slots
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    from .moe_cases import moe_config
    from .parallel_cases import fresh_model, switch_layout

    enable_cpu_megatron()
    rng = np.random.default_rng(19)
    sequences = [rng.integers(0, VOCAB, n).tolist() for n in MOE_LENGTHS]
    references = _reference_phase(sequences)
    out: dict[str, Any] = {"rank": rank,
                           "reference_loss": {k: v["loss"] for k, v in references.items()},
                           "runs": {}}
    manager = switch_layout(expert_model_parallel_size=EP)
    out["ep_size"] = manager.ep_size
    out["expert_group"] = [int(r) for r in manager.rank_map.ep_global_ranks]
    out["expert_dp_group"] = sorted(int(r) for r in __import__("torch").distributed
                                    .get_process_group_ranks(
                                        parallel_state.get_expert_data_parallel_group()))
    balance = make_step_planner(bytescale_config(scheduler="balance"), hdp_size=manager.size,
                                cost_model=cost_model(), ep_size=EP)
    manual = ep_manual_plan()
    runs = [("manual alltoall aux 0", "aux 0", "alltoall", lambda _: manual),
            ("manual alltoall aux", "aux", "alltoall", lambda _: manual),
            ("balance alltoall aux", "aux", "alltoall", balance)]
    for name, case, dispatcher, planner in runs:
        config = moe_config(**CASES[case], dispatcher=dispatcher)
        step, record, errors = _step(config, references[case], sequences, planner, manager)
        out["runs"][name] = {
            "ring_sizes": sorted(set(step.plan.ring_sizes())),
            "micro_batch_counts": step.plan.micro_batch_counts(),
            "slots": [expert_slots(step.plan, r) for r in range(manager.size)],
            "rings_across_groups": sorted({mb.ring for r in step.plan.ranks
                                           for mb in r.micro_batches
                                           if len({m // EP for m in mb.ring}) > 1}),
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "grad_errors": errors,
        }

    # stress: random batches under the EP constraint; a deadlock trips the spawn's timeout
    config = moe_config(**CASES["aux"])
    ddp, optimizer = fresh_model(config, references["aux"])
    stress = {"steps": 0, "trained_tokens": 0, "max_ring": 0, "uneven_groups": 0,
              "empty_slots": 0}
    for step in HDPDataIterator(stress_batches(STRESS_PLANS), planner=balance, hdp=manager.hdp):
        record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        plan = step.plan
        slots = [expert_slots(plan, r) for r in range(plan.hdp_size)]
        stress["steps"] += 1
        stress["trained_tokens"] += record.tokens
        stress["max_ring"] = max(stress["max_ring"], max(plan.ring_sizes()))
        stress["uneven_groups"] += int(len(set(slots)) > 1)
        stress["empty_slots"] += sum(s - n for s, n in zip(slots, plan.micro_batch_counts()))
        stress["total_tokens"] = stress.get("total_tokens", 0) + plan.total_tokens
    out["stress"] = stress
    parallel_state.destroy_model_parallel()
    return out
