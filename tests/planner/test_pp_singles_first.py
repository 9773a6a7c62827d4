"""PP-Balance's singles-first variant and its window load, by hand and as candidates of ``balance``.

``singles_first(placements, units, lead)`` gives every pipeline in a ring up to ``lead`` of its
single-rank micro-batches from after its last ring at its front, shortest first: the longest
that every pipeline can match (the j-th lifted at most the smallest j-th longest over the
pipelines), so that the backwards fill the 1F1B window of the widest ring and its members
reach it together. Every pipeline of a ring lifts the same count, so rings keep one local index.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.presets import toy_cost_model
from megatron_bytescale.planner.schedulers import balance as balance_module
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers._common import Placement
from megatron_bytescale.planner.schedulers.pp_balance import local_indices, singles_first
from megatron_bytescale.planner.sharding import Unit
from planner_cases import lists_by_rank


def _case(rows):
    """rows of (ring, stage seconds): sequence k is row k."""
    placements = [Placement(ring=ring, seqs=(k,)) for k, (ring, _) in enumerate(rows)]
    units = [Unit(seqs=(k,), lengths=(1,), ring_size=len(ring), time=t) for k, (ring, t) in enumerate(rows)]
    return placements, units


ROWS = [((0, 1), 5.0),  # 0: the ring, first on pipelines 0 and 1
        ((0,), 1.0), ((0,), 3.0),  # 1, 2
        ((1,), 2.0), ((1,), 4.0), ((1,), 0.5),  # 3, 4, 5
        ((2,), 9.0), ((2,), 1.0)]  # 6, 7: no ring, left alone


def test_each_ring_pipeline_lifts_what_every_one_can_match_shortest_first():
    """Lead 2: pipeline 0's singles are 3.0 and 1.0, pipeline 1's 4.0, 2.0, 0.5, so the j-th
    lifted is at most min(3.0, 4.0) and then min(1.0, 2.0): pipeline 1 lifts 2.0 and 0.5, not
    its longest 4.0 (its ring partner could not match it); pipeline 2 keeps its order."""
    placements, units = _case(ROWS)
    lifted = singles_first(placements, units, 2)
    assert lists_by_rank(lifted) == {0: [1, 2, 0], 1: [5, 3, 0, 4], 2: [6, 7]}
    assert local_indices(lifted) is not None
    assert lists_by_rank(singles_first(placements, units, 3)) == lists_by_rank(lifted)  # as many as all have
    assert lists_by_rank(singles_first(placements, units, 1)) == {0: [2, 0, 1], 1: [3, 0, 4, 5], 2: [6, 7]}


def test_with_nothing_short_enough_a_pipeline_lifts_its_shortest():
    rows = [((0, 1), 9.0), ((0,), 6.0), ((0,), 5.0), ((1,), 1.0), ((1,), 0.5)]
    placements, units = _case(rows)
    assert lists_by_rank(singles_first(placements, units, 2)) == {0: [2, 1, 0], 1: [4, 3, 0]}
    # with one more, longer, single on pipeline 0 it is the one left after the ring: the
    # shortest are lifted, not the longest
    placements, units = _case(rows + [((0,), 7.0)])
    assert lists_by_rank(singles_first(placements, units, 2)) == {0: [2, 1, 0, 5], 1: [4, 3, 0]}


def test_it_gives_up_without_a_ring_a_single_after_it_or_a_lead():
    placements, units = _case(ROWS)
    assert singles_first(placements, units, 0) is None
    placements, units = _case([((0,), 1.0), ((1,), 2.0)])
    assert singles_first(placements, units, 1) is None  # no ring: short-first's job
    placements, units = _case([((0,), 1.0), ((0, 1), 5.0), ((1,), 2.0)])
    assert singles_first(placements, units, 1) is None  # pipeline 0 has nothing after its ring


def _plan(dataset, seed, tokens, hdp, pp):
    lengths = synthetic_lengths(dataset, tokens, seed=seed, max_length=16_384)
    return make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=2_048, cost_model=toy_cost_model(),
                     pp_size=pp, context_length=16_384, offload=False)


def test_balance_keeps_singles_first_where_it_is_faster(monkeypatch):
    plan = _plan("byted", 0, 60_000, 8, 2).validate()
    assert plan.meta["assignment"].endswith("+singles-first"), plan.meta["assignment"]
    monkeypatch.setattr(balance_module, "singles_first", lambda placements, units, lead: None)
    without = _plan("byted", 0, 60_000, 8, 2)
    assert not without.meta["assignment"].endswith("+singles-first")
    assert plan.estimate.step_time_s < without.estimate.step_time_s


@pytest.mark.parametrize("pp", [2, 4])
def test_balance_lifts_pp_minus_one_singles(pp, monkeypatch):
    leads = []

    def recorded(placements, units, lead):
        leads.append(lead)
        return singles_first(placements, units, lead)

    monkeypatch.setattr(balance_module, "singles_first", recorded)
    _plan("github", 2, 60_000, 8, pp)
    assert leads and set(leads) == {pp - 1}


def test_balance_keeps_the_window_load_where_it_is_faster(monkeypatch):
    """github, seed 2, 8 ranks, PP 2: the runs under the window load win (with next-levels-first);
    without that load the step is slower."""
    plan = _plan("github", 2, 60_000, 8, 2).validate()
    assert plan.meta["assignment"].startswith("pp-runs-floor"), plan.meta["assignment"]
    original = balance_module.pp_balance
    windows = []

    def no_window(*args, window=0, **kwargs):
        windows.append(window)
        return original(*args, **kwargs)

    monkeypatch.setattr(balance_module, "pp_balance", no_window)
    without = _plan("github", 2, 60_000, 8, 2)
    assert 1 in windows  # the window is PP - 1
    assert plan.estimate.step_time_s < without.estimate.step_time_s
