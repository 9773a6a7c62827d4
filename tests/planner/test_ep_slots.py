"""Balance evens an expert group's slots (``schedulers/ep_slots.py``; no processes).

By hand: sorting two members' lists pairs long with long; regrouping deals a group's pool so that
a member with one long micro-batch no longer leaves its partner's short ones beside empty slots;
rings keep their slot. Properties on seeded random batches (PP 1 and 2, offload on and off):
balance's plan with the slots evened is valid, trains every token once, keeps every rank's
rings, and its estimate is never above the unsorted plan's.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_bytescale.planner.expert_lockstep import slot_finish
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.ep_slots import regroup_slots, slot_placements, sorted_slots

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_cases import small_cost_model  # noqa: E402


def _mb(order: int, ring: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(order=order, ring=ring, seqs=(order,), offload_ratio=0.0)


def _orders(lists) -> list[list[int]]:
    return [[mb.order for mb in x] for x in lists]


def _timed(lists, ep: int, seconds: dict[int, float]) -> float:
    """PP 1 lockstep phase of per-rank lists (re-emitted slot by slot, as the plan would be)."""
    ranks = [SimpleNamespace(micro_batches=x) for x in lists]
    return float(slot_finish(SimpleNamespace(hdp_size=len(lists), ep_size=ep, ranks=ranks, meta={}),
                             seconds).max())


def test_sorting_pairs_long_with_long_and_keeps_rings():
    seconds = {0: 3.0, 1: 1.0, 2: 1.0, 3: 3.0, 4: 2.0}
    lists = [[_mb(0, (0,)), _mb(2, (0,))], [_mb(1, (1,)), _mb(3, (1,))]]
    assert _timed(lists, 2, seconds) == 6.0
    new = sorted_slots(lists, seconds)
    assert _orders(new) == [[0, 2], [3, 1]] and _timed(new, 2, seconds) == 4.0
    assert _orders(sorted_slots(lists, seconds, longest_first=False)) == [[2, 0], [1, 3]]
    # a ring keeps its slot; the singles move around it
    ring = _mb(4, (0, 1))
    lists = [[_mb(2, (0,)), ring, _mb(0, (0,))], [_mb(1, (1,)), ring, _mb(3, (1,))]]
    new = sorted_slots(lists, seconds)
    assert _orders(new) == [[0, 4, 2], [3, 4, 1]]


def test_regrouping_fills_a_groups_empty_slots():
    """Member 0 holds one 4 s micro-batch, member 1 four of 1 s: slot by slot 4 + 1 + 1 + 1 = 7.
    Dealt again: 4 beside 1, then the three 1 s ones over two slots: 4 + 1 + 1 = 6."""
    seconds = {0: 4.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    lists = [[_mb(0, (0,))], [_mb(1, (1,)), _mb(2, (1,)), _mb(3, (1,)), _mb(4, (1,))]]
    assert _timed(lists, 2, seconds) == 7.0
    new = regroup_slots(lists, seconds, 2)
    assert _timed(new, 2, seconds) == 6.0
    assert sorted(o for x in _orders(new) for o in x) == [0, 1, 2, 3, 4]
    # placements put every single on the rank whose list holds it now
    for p in slot_placements(new):
        if len(p.ring) == 1:
            assert p.seqs[0] in [mb.order for mb in new[p.ring[0]]]


def test_regrouping_keeps_what_sits_before_a_ring():
    """Member 0 runs two singles then a ring across the groups at slot 2; member 1 only singles.
    The ring stays at slot 2 on member 0 (so on its partner in the other group too), member 0
    still has two micro-batches before it, and the long ones fill the ring's slot beside it."""
    seconds = {0: 1.0, 1: 1.0, 2: 5.0, 3: 4.0, 4: 1.0, 5: 1.0, 6: 1.0}
    ring = _mb(2, (0, 2))
    lists = [[_mb(0, (0,)), _mb(1, (0,)), ring], [_mb(3, (1,)), _mb(4, (1,)), _mb(5, (1,)), _mb(6, (1,))],
             [_mb(7, (2,)), _mb(8, (2,)), ring], [_mb(9, (3,))]]
    seconds.update({7: 1.0, 8: 1.0, 9: 1.0})
    new = regroup_slots(lists, seconds, 2)
    assert new[0][2] is ring and new[2][2] is ring and len(new[0]) >= 3
    assert new[1][2].order == 3  # the 4 s single beside the 5 s ring
    assert _timed(new, 2, seconds) < _timed(lists, 2, seconds)
    assert Counter(o for x in _orders(new) for o in x) == Counter(o for x in _orders(lists) for o in x)


def _batch(rng: np.random.Generator) -> list[int]:
    return (rng.integers(5, 64, int(rng.integers(8, 60))).tolist()
            + rng.integers(64, 400, int(rng.integers(0, 5))).tolist())


@pytest.mark.parametrize("pp", [1, 2])
def test_balance_evens_slots_without_losing_anything(pp):
    cm = small_cost_model()
    rng = np.random.default_rng(190 + pp)
    better = 0
    for case in range(10):
        lengths = _batch(rng)
        ep, offload = (2, 4)[case % 2], case % 4 < 2
        kw = dict(scheduler="balance", hdp_size=8, capacity=64, cost_model=cm, pp_size=pp, ep_size=ep,
                  offload=offload)
        plain = make_plan(lengths, even_expert_slots=False, **kw)
        even = make_plan(lengths, **kw)
        even.validate()  # the slot rule, pieces, every token once
        assert even.estimate.step_time_s <= plain.estimate.step_time_s, case
        # the evened candidate's own estimate before evening (at PP 1 every candidate is evened,
        # so the winner may be another candidate than the unsorted plan's)
        assert even.meta["expert_slots_before_s"] >= even.estimate.step_time_s
        if pp > 1:
            assert even.meta["expert_slots_before_s"] == plain.estimate.step_time_s
        assert even.meta["expert_slots"] in ("as placed", "longest-first", "shortest-first",
                                             "regrouped, longest-first", "regrouped, shortest-first")
        # the same micro-batches; rings on the same ranks at the same slot
        def content(plan):
            return Counter((mb.ring if len(mb.ring) > 1 else (), mb.seqs, mb.offload_ratio)
                           for rp in plan.ranks for mb in rp.micro_batches)
        if pp > 1 or even.meta["assignment"] == plain.meta["assignment"]:
            assert content(even) == content(plain)
        assert sorted(s for rp in even.ranks for mb in rp.micro_batches for s in mb.seqs
                      if len(mb.ring) == 1 or mb.ring[0] == rp.rank) == list(range(len(lengths)))
        if pp > 1:  # the same candidate, evened: its rings stay on the same ranks and slots
            for a, b in zip(even.ranks, plain.ranks):
                assert [(k, mb.seqs) for k, mb in enumerate(a.micro_batches) if len(mb.ring) > 1] == \
                       [(k, mb.seqs) for k, mb in enumerate(b.micro_batches) if len(mb.ring) > 1]


def test_even_expert_slots_keeps_the_faster_plan():
    """A group whose member 0 holds one long pack and member 1 four short ones (7 slot-units by
    the lockstep): even_expert_slots regroups it, the estimate falls, the plan stays valid with
    every token once; a plan without expert groups comes back as it was."""
    from megatron_bytescale.planner.plan import PlanBuilder
    from megatron_bytescale.planner.schedulers._common import build_request
    from megatron_bytescale.planner.schedulers.ep_slots import even_expert_slots

    cm = small_cost_model()
    lengths = [60, 15, 15, 15, 15, 30, 30]
    request = build_request(lengths, hdp_size=4, capacity=64, cost_model=cm, pp_size=1, offload=False,
                            overlong="error", align=1, context_length=None, delta=0.05, num_buckets=4, ep_size=2)
    builder = PlanBuilder(hdp_size=4, capacity=64, lengths=dict(enumerate(lengths)))
    builder.add([0], [0])
    for s in (1, 2, 3, 4):
        builder.add([1], [s])
    builder.add([2], [5])
    builder.add([3], [6])
    plan = builder.build(scheduler="balance", ep_size=2, layers_per_stage=cm.num_layers)
    even = even_expert_slots(plan, request, cm, "balance")
    even.validate()
    assert even.meta["expert_slots"].startswith("regrouped")
    assert even.estimate.step_time_s < even.meta["expert_slots_before_s"] * 0.95
    assert sorted(len(rp.micro_batches) for rp in even.ranks[:2]) == [2, 3]
    assert sorted(s for rp in even.ranks for mb in rp.micro_batches for s in mb.seqs) == list(range(7))
    same = replace(plan, ep_size=1)
    assert even_expert_slots(same, request, cm, "balance") is same
