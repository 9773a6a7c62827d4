"""scripts/bench_moe_ep.py's lockstep estimate: by hand, and against the planner's timeline."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.estimate import simulate_plan
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_moe_ep import slot_phase  # noqa: E402


def _plan(ep: int, lists: list[list[tuple[int, tuple[int, ...]]]]) -> SimpleNamespace:
    ranks = [SimpleNamespace(micro_batches=[SimpleNamespace(order=o, ring=ring) for o, ring in mbs]) for mbs in lists]
    return SimpleNamespace(hdp_size=len(lists), ep_size=ep, ranks=ranks)


def test_slot_phase_by_hand():
    """Expert groups {0, 1} and {2, 3}. Slot 0: rank 0 runs 10 s alone, ranks 1 and 2 a 1 s ring
    across the groups, rank 3 1 s; slot 1: rank 3 runs 1 s, rank 2 has an empty slot. Rings only:
    rank 0 finishes at 10. Coupled: the ring joins both groups into one component, so slot 0 ends
    at 10 for all four, and rank 3's slot 1 (with rank 2's empty slot) at 11."""
    seconds = {0: 10.0, 1: 1.0, 2: 1.0, 3: 1.0}
    plan = _plan(2, [[(0, (0,))], [(1, (1, 2))], [(1, (1, 2))], [(2, (3,)), (3, (3,))]])
    assert slot_phase(plan, seconds, couple_groups=False) == pytest.approx(10.0)
    assert slot_phase(plan, seconds, couple_groups=True) == pytest.approx(11.0)
    # EP 1 (groups of one): nothing couples beyond the rings
    assert slot_phase(_plan(1, [[(0, (0,))], [(1, (1, 2))], [(1, (1, 2))], [(2, (3,)), (3, (3,))]]),
                      seconds, couple_groups=True) == pytest.approx(10.0)
    # members wait for each other slot by slot: 10 + 10, not max(11, 11)
    seconds = {0: 10.0, 1: 1.0, 2: 1.0, 3: 10.0}
    plan = _plan(2, [[(0, (0,)), (2, (0,))], [(1, (1,)), (3, (1,))]])
    assert slot_phase(plan, seconds, couple_groups=False) == pytest.approx(11.0)
    assert slot_phase(plan, seconds, couple_groups=True) == pytest.approx(20.0)


def test_uncoupled_slot_phase_is_the_planners_pp1_timeline():
    cm = preset_cost_model("mistral-8x7b", "paper-fit", expert_parallel_size=2)
    lengths = synthetic_lengths("github", 2_000_000, seed=0, max_length=1 << 19)
    for scheduler in ("balance", "static"):
        plan = make_plan(lengths, scheduler=scheduler, hdp_size=32, capacity=8192, cost_model=cm, ep_size=2,
                         estimate=False, pieces=False)
        costs, sim = simulate_plan(plan, cm)
        seconds = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
        free = slot_phase(plan, seconds, couple_groups=False)
        assert free == pytest.approx(float(max(sim.rank_finish_s)), rel=1e-12)
        assert slot_phase(plan, seconds, couple_groups=True) >= free
