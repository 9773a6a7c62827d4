"""The expert groups' lockstep in the estimate (``planner/expert_lockstep.py``; no processes).

By hand: two members of one group with slot times 3 and 1 take 3; an empty slot costs its
group's slot; a ring across two groups joins them for its slot; with PP the same per stage inside
1F1B. Properties on seeded random plans: the lockstep estimate is never below the estimate of the
same plan without expert groups, and equals it when every group's members run equal slots.
Plans with ``ep_size`` 1 keep their estimates to the bit (``ep1_estimates.json``, written by
the code before the lockstep was charged: ``python tests/planner/test_expert_lockstep.py``
from a checkout of that code rewrites it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from megatron_bytescale.planner.estimate import estimate_plan, micro_batch_costs, simulate_plan
from megatron_bytescale.planner.plan import PlanBuilder, PlanError, StepPlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_cases import small_cost_model  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "ep1_estimates.json"


def _plan(ep: int, lists: list[list[tuple[int, tuple[int, ...]]]], *, pp: int = 1) -> StepPlan:
    """A timing plan from per-rank ``(order, ring)`` lists (every order one sequence of 8 tokens);
    micro-batches are added in order so every rank's list ascends."""
    rings = {}
    for mbs in lists:
        for o, ring in mbs:
            rings[o] = ring
    builder = PlanBuilder(hdp_size=len(lists), capacity=64, lengths={o: 8 for o in rings})
    for o in sorted(rings):
        assert builder.add(rings[o], [o]) == o
    plan = builder.build(scheduler="manual", pp_size=pp, ep_size=ep, layers_per_stage=2)
    assert [[mb.order for mb in rp.micro_batches] for rp in plan.ranks] == [[o for o, _ in x] for x in lists]
    plan.validate()
    return plan


def _finish(plan: StepPlan, seconds: dict[int, float], *, pp_ff: float = 1 / 3) -> list[float]:
    from megatron_bytescale.planner.expert_lockstep import lockstep_simulation

    return lockstep_simulation(plan, seconds, pp_ff).rank_finish_s.tolist()


def test_two_members_run_at_the_slower_pace():
    plan = _plan(2, [[(0, (0,))], [(1, (1,))]])
    assert _finish(plan, {0: 3.0, 1: 1.0}) == [3.0, 3.0]
    # slot by slot: 3 + 3, not max(3 + 1, 1 + 3)
    plan = _plan(2, [[(0, (0,)), (2, (0,))], [(1, (1,)), (3, (1,))]])
    assert _finish(plan, {0: 3.0, 1: 1.0, 2: 1.0, 3: 3.0}) == [6.0, 6.0]
    # two groups of one (EP 1 as a slot model) and two separate groups are not coupled
    plan = _plan(1, [[(0, (0,))], [(1, (1,))]])
    from megatron_bytescale.planner.expert_lockstep import slot_finish
    assert slot_finish(plan, {0: 3.0, 1: 1.0}).tolist() == [3.0, 1.0]
    plan = _plan(2, [[(0, (0,))], [(1, (1,))], [(2, (2,))], [(3, (3,))]])
    assert _finish(plan, {0: 3.0, 1: 1.0, 2: 2.0, 3: 5.0}) == [3.0, 3.0, 5.0, 5.0]


def test_an_empty_slot_costs_its_groups_slot():
    """Rank 1 runs one 3 s micro-batch, rank 0 two of 1 s: slot 0 takes 3 (rank 0 waits), slot 1
    takes 1 (rank 1 runs an empty micro-batch that waits): 4 for both, where each alone takes 3
    and 2."""
    plan = _plan(2, [[(0, (0,)), (2, (0,))], [(1, (1,))]])
    seconds = {0: 1.0, 1: 3.0, 2: 1.0}
    assert _finish(plan, seconds) == [4.0, 4.0]
    from megatron_bytescale.planner.expert_lockstep import slot_finish
    assert slot_finish(plan, seconds, couple_groups=False).tolist() == [2.0, 3.0]


def test_a_ring_across_groups_joins_them_for_its_slot():
    """Groups {0, 1} and {2, 3}. Slot 0: rank 0 runs 10 s alone, ranks 1 and 2 a 1 s ring across
    the groups, rank 3 1 s; slot 1: rank 3 runs 1 s, rank 2 has an empty slot. Rings only: rank
    0 finishes at 10, rank 3 at 2. Coupled: the ring joins both groups into one component, so
    slot 0 ends at 10 for all four, and slot 1 of group {2, 3} at 11."""
    plan = _plan(2, [[(0, (0,))], [(1, (1, 2))], [(1, (1, 2))], [(2, (3,)), (3, (3,))]])
    seconds = {0: 10.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert _finish(plan, seconds) == [10.0, 10.0, 11.0, 11.0]
    from megatron_bytescale.planner.expert_lockstep import slot_finish
    assert slot_finish(plan, seconds, couple_groups=False).tolist() == [10.0, 1.0, 1.0, 2.0]
    # without the ring the groups are independent: {2, 3} ends at 1 + 1
    plan = _plan(2, [[(0, (0,))], [(1, (1,))], [(4, (2,))], [(2, (3,)), (3, (3,))]])
    assert _finish(plan, {**seconds, 4: 1.0}) == [10.0, 10.0, 2.0, 2.0]


def test_pipelines_wait_for_their_group_per_stage():
    """PP 2, one group of two pipelines, slots (3, 1) then (1, 3) per stage: each stage's pair
    runs two 3 s micro-batches in lockstep, i.e. 1F1B of two equal micro-batches: (m + p - 1) t
    = 9. Alone, pipeline 0 ([3, 1]) and pipeline 1 ([1, 3]) finish sooner."""
    plan = _plan(2, [[(0, (0,)), (2, (0,))], [(1, (1,)), (3, (1,))]], pp=2)
    seconds = {0: 3.0, 1: 1.0, 2: 1.0, 3: 3.0}
    assert _finish(plan, seconds) == pytest.approx([9.0, 9.0], rel=1e-12)
    from megatron_bytescale.planner.order import simulate
    alone = simulate(plan, seconds, forward_fraction=1 / 3).rank_finish_s
    assert max(alone) < 9.0
    # recorded: every order's ops carry its component's times (what the Gantt chart draws)
    from megatron_bytescale.planner.expert_lockstep import lockstep_simulation
    times = lockstep_simulation(plan, seconds, 1 / 3, record=True).node_times
    for o in range(4):
        for phase in "FB":
            for stage in range(2):
                assert (o, phase, stage) in times
    assert times[(0, "F", 0)] == times[(1, "F", 0)] == (0.0, 1.0)
    # an empty slot in a pipeline still runs through it: pipeline 1 holds only a 1 s micro-batch
    plan = _plan(2, [[(0, (0,)), (2, (0,))], [(1, (1,))]], pp=2)
    assert _finish(plan, {0: 3.0, 1: 1.0, 2: 3.0}) == pytest.approx([9.0, 9.0], rel=1e-12)


def test_the_estimate_and_the_simulator_charge_it():
    """estimate_plan and simulate_step time an EP plan with the lockstep, from the cost model's
    own micro-batch times, and record every micro-batch inside its component's span."""
    from megatron_bytescale.planner.expert_lockstep import slot_finish
    from megatron_bytescale.sim.step import simulate_step

    cm = small_cost_model()
    lengths = {0: 200, 1: 20, 2: 20, 3: 300, 4: 60}
    builder = PlanBuilder(hdp_size=4, capacity=256, lengths=lengths)
    builder.add([0], [0])
    builder.add([1, 2], [3])  # a ring across the groups {0, 1} and {2, 3}
    builder.add([3], [1, 2])
    builder.add([1], [4])  # rank 0 has an empty slot 1
    plan = builder.build(scheduler="manual", ep_size=2, layers_per_stage=cm.num_layers)
    plan.validate()
    costs = micro_batch_costs(plan, cm)
    seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
    want = slot_finish(plan, seconds)
    assert want[0] == want[1] == max(seconds[0], seconds[1], seconds[2]) + seconds[3]
    est = estimate_plan(plan, cm)
    assert est.rank_time_s == tuple(want.tolist())
    assert est.step_time_s > estimate_plan(replace(plan, ep_size=1), cm).step_time_s
    assert "expert groups of 2 in lockstep" in est.extra["model"]
    assert simulate_step(plan, cm).micro_batch_phase_s == est.step_time_s
    _, sim = simulate_plan(plan, cm, record=True)
    assert sim.node_times[0] == sim.node_times[1] == sim.node_times[2] == (0.0, float(want[0]) - seconds[3])
    # a plan that breaks the slot rule is refused, not timed
    bad = _plan(1, [[(0, (0,)), (1, (0, 1))], [(1, (0, 1))]])  # the ring at slots 1 and 0
    with pytest.raises(PlanError, match="one slot on all its members"):
        estimate_plan(replace(bad, ep_size=2), cm)


def test_rings_only_is_the_estimates_pp1_timeline():
    """slot_finish without groups reproduces the estimate's own PP 1 timeline (global order) of
    the same plans, so the lockstep is the only thing the groups add."""
    from megatron_bytescale.data.synthetic import synthetic_lengths
    from megatron_bytescale.planner.expert_lockstep import slot_finish
    from megatron_bytescale.planner.presets import preset_cost_model
    from megatron_bytescale.planner.schedulers import make_plan

    cm = preset_cost_model("mistral-8x7b", "paper-fit", expert_parallel_size=2)
    lengths = synthetic_lengths("github", 2_000_000, seed=0, max_length=1 << 19)
    for scheduler in ("balance", "static"):
        plan = make_plan(lengths, scheduler=scheduler, hdp_size=32, capacity=8192, cost_model=cm, ep_size=2,
                         estimate=False, pieces=False)
        costs, sim = simulate_plan(replace(plan, ep_size=1), cm)
        seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
        assert slot_finish(plan, seconds, couple_groups=False).tolist() == pytest.approx(
            sim.rank_finish_s.tolist(), rel=1e-12)
        assert np.all(slot_finish(plan, seconds) >= sim.rank_finish_s * (1 - 1e-12))


def test_barriers_and_sequence_chunks_are_refused_with_expert_groups():
    """Barriers between micro-batch groups (pow2) and sequence-split chunks are not timed with
    expert groups: one-line refusals naming what to use instead."""
    from megatron_bytescale.planner.expert_lockstep import lockstep_simulation
    from megatron_bytescale.planner.schedulers import make_plan

    cm = small_cost_model()
    lengths = [300, 200, 40, 30, 20, 10, 12, 9, 8, 7]
    plan = make_plan(lengths, scheduler="pow2", hdp_size=8, capacity=64, cost_model=cm, offload=False)
    assert plan.meta["barrier_after_orders"]
    with pytest.raises(PlanError, match="barriers between micro-batches cannot be timed with ep_size 2"):
        lockstep_simulation(replace(plan, ep_size=2), {}, 1 / 3)
    with pytest.raises(ValueError, match="scheduler 'pow2' cannot plan for expert parallelism .*barriers"):
        make_plan(lengths, scheduler="pow2", hdp_size=8, capacity=64, cost_model=cm, offload=False, ep_size=2)
    builder = PlanBuilder(hdp_size=2, capacity=512, lengths={0: 600, 1: 30})
    builder.add([0, 1], [0], num_chunks=2)
    builder.add([0], [1])
    split = builder.build(scheduler="manual", pp_size=2, ep_size=2, layers_per_stage=4)
    split.validate()
    with pytest.raises(PlanError, match="sequence chunks cannot be timed with ep_size 2"):
        estimate_plan(split, small_cost_model(num_layers=8))


# --------------------------------------------------------------------------- properties
def _random_lengths(rng: np.random.Generator) -> list[int]:
    """A few long documents (rings at capacity 64) among many short ones."""
    return (rng.integers(5, 64, int(rng.integers(4, 40))).tolist()
            + rng.integers(64, 400, int(rng.integers(0, 5))).tolist())


@pytest.mark.parametrize("pp", [1, 2])
def test_lockstep_is_never_below_the_plan_without_groups(pp):
    from megatron_bytescale.planner.schedulers import make_plan

    cm = small_cost_model()
    rng = np.random.default_rng(19 + pp)
    coupled = 0
    for case in range(12):
        ep = (2, 4)[case % 2]
        plan = make_plan(_random_lengths(rng), scheduler=("balance", "static")[case % 3 == 2], hdp_size=8,
                         capacity=64, cost_model=cm, pp_size=pp, ep_size=ep, offload=bool(case % 4 < 2),
                         pieces=False)
        with_groups = plan.estimate
        without = estimate_plan(replace(plan, ep_size=1), cm)
        assert with_groups.step_time_s >= without.step_time_s * (1 - 1e-12), case
        assert np.all(np.asarray(with_groups.rank_time_s) >= np.asarray(without.rank_time_s) * (1 - 1e-12)), case
        coupled += with_groups.step_time_s > without.step_time_s * (1 + 1e-9)
    assert coupled  # the lockstep shows on some of them


def _equal_slot_plan(rng: np.random.Generator, *, ep: int, groups: int, pp: int) -> StepPlan:
    """Every member of a group runs a micro-batch of the same length in every slot (own
    sequence or a ring over the whole group); no ring leaves its group."""
    lengths: dict[int, int] = {}
    builder = PlanBuilder(hdp_size=ep * groups, capacity=512, lengths={})
    for g in range(groups):
        members = list(range(g * ep, g * ep + ep))
        for _ in range(int(rng.integers(1, 6))):
            length = int(rng.integers(5, 400))
            if rng.random() < 0.3:
                sid = len(lengths)
                lengths[sid] = length * ep
                builder.lengths[sid] = length * ep
                builder.add(members, [sid])
            else:
                for r in members:
                    sid = len(lengths)
                    lengths[sid] = length
                    builder.lengths[sid] = length
                    builder.add([r], [sid])
    return builder.build(scheduler="manual", pp_size=pp, ep_size=ep, layers_per_stage=4)


@pytest.mark.parametrize("pp", [1, 2])
def test_equal_slots_cost_nothing_extra(pp):
    cm = small_cost_model(num_layers=4 * pp)
    rng = np.random.default_rng(7)
    for _ in range(10):
        plan = _equal_slot_plan(rng, ep=int(rng.choice([2, 4])), groups=int(rng.integers(1, 4)), pp=pp)
        plan.validate()
        with_groups = estimate_plan(plan, cm)
        without = estimate_plan(replace(plan, ep_size=1), cm)
        assert with_groups.step_time_s == pytest.approx(without.step_time_s, rel=1e-12)
        assert with_groups.rank_time_s == pytest.approx(without.rank_time_s, rel=1e-12)


# --------------------------------------------------------------------------- EP 1 unchanged
def ep1_cases() -> list[tuple[str, StepPlan, object]]:
    """Seeded plans without expert groups: every scheduler at PP 1, balance and static at PP 2
    and 4 (4 with two virtual stages), offload on and off, and a Mistral preset plan."""
    from megatron_bytescale.data.synthetic import synthetic_lengths
    from megatron_bytescale.planner.estimate import with_virtual_pipeline
    from megatron_bytescale.planner.presets import preset_cost_model
    from megatron_bytescale.planner.schedulers import make_plan

    out = []
    rng = np.random.default_rng(2026)
    for case in range(6):
        lengths = _random_lengths(rng)
        for pp in (1, 2, 4):
            cm = small_cost_model(num_layers=8)
            for scheduler in ("naive", "balance", "static", "pow2") if pp == 1 else ("balance", "static"):
                plan = make_plan(lengths, scheduler=scheduler, hdp_size=8, capacity=64, cost_model=cm,
                                 pp_size=pp, offload=bool(case % 2), estimate=False)
                if pp == 4 and case < 2:
                    plan = with_virtual_pipeline(plan, 2, cm)
                out.append((f"{case}/{pp}/{scheduler}/vpp{plan.virtual_pipeline_size}", plan, cm))
    cm = preset_cost_model("mistral-8x7b", "paper-fit", expert_parallel_size=2)
    lengths = synthetic_lengths("byted", 1_000_000, seed=0, max_length=1 << 18)
    for pp in (1, 4):
        plan = make_plan(lengths, scheduler="balance", hdp_size=32, capacity=8192, cost_model=cm, pp_size=pp,
                         estimate=False, pieces=False)
        out.append((f"mistral/{pp}", plan, cm))
    return out


def fingerprint(plan: StepPlan, cm: object) -> dict:
    """The estimate's and the simulated step's numbers, exact (float.hex)."""
    from megatron_bytescale.sim.step import simulate_step

    est = estimate_plan(plan, cm)
    step = simulate_step(plan, cm)
    return {"step": est.step_time_s.hex(), "ranks": [x.hex() for x in est.rank_time_s],
            "p2p": est.p2p_bytes, "lower": est.extra["lower_bound_s"].hex(),
            "sim_phase": step.micro_batch_phase_s.hex(), "sim_idle": step.breakdown["idle"].hex()}


def test_plans_without_expert_groups_keep_their_estimates_to_the_bit():
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    cases = ep1_cases()
    assert sorted(want) == sorted(name for name, _, _ in cases)
    for name, plan, cm in cases:
        assert plan.ep_size == 1
        assert fingerprint(plan, cm) == want[name], name


if __name__ == "__main__":  # rewrite the golden file from the code on PYTHONPATH
    GOLDEN.write_text(json.dumps({name: fingerprint(plan, cm) for name, plan, cm in ep1_cases()}, indent=0,
                                 sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")
