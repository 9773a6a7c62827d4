"""The interleaved schedule in wavefronts (:mod:`megatron_bytescale.planner.wavefront_interleaved`)
gives the graph walk's times bit for bit (:func:`..pipeline_floor.walk_schedule`), declines
units at two local indices, and its keys order the template's graph."""

from __future__ import annotations

import random

import numpy as np
import pytest

from megatron_bytescale.planner.pipeline_floor import pipeline_stage_ops, simulate_schedule, walk_schedule
from megatron_bytescale.planner.wavefront_interleaved import simulate_interleaved, template_keys
from planner_cases import random_pipeline_lists


@pytest.mark.parametrize("seed", range(40))
def test_the_same_floats_as_the_graph_walk(seed):
    rng = random.Random(seed)
    lists, dur, _ = random_pipeline_lists(rng)
    pp, vpp = rng.randint(2, 5), rng.randint(2, 4)
    ff = rng.choice([1.0 / 3.0, 0.5, 0.2])
    got = simulate_interleaved(lists, dur, pp=pp, vpp=vpp, forward_fraction=ff)
    want = walk_schedule(lists, dur, pp=pp, vpp=vpp, forward_fraction=ff)
    assert got is not None and want is not None
    assert np.array_equal(got, want.rank_finish_s)
    # simulate_schedule takes the wavefronts and gives the same
    assert np.array_equal(simulate_schedule(lists, dur, pp=pp, vpp=vpp, forward_fraction=ff).rank_finish_s, got)


def test_a_run_told_a_step_to_beat_gives_the_same_floats_or_stops_only_above_it():
    """``stop_above``: the full times whenever the step is at most the value; otherwise the same
    or ``inf`` everywhere, and ``inf`` only where the step is above it."""
    stopped = 0
    for seed in range(40):
        rng = random.Random(seed)
        lists, dur, _ = random_pipeline_lists(rng)
        pp, vpp = rng.randint(2, 5), rng.randint(2, 4)
        ff = rng.choice([1.0 / 3.0, 0.5, 0.2])
        full = simulate_interleaved(lists, dur, pp=pp, vpp=vpp, forward_fraction=ff)
        step = float(full.max())
        for limit in (step, step * (1 + 1e-12), 2 * step):
            assert np.array_equal(simulate_interleaved(lists, dur, pp=pp, vpp=vpp, forward_fraction=ff,
                                                       stop_above=limit), full)
        for limit in (step * 0.999, step * 0.9, step / 2, 0.0):
            got = simulate_interleaved(lists, dur, pp=pp, vpp=vpp, forward_fraction=ff, stop_above=limit)
            if np.isinf(got).all():
                stopped += 1
            else:
                assert np.array_equal(got, full)
    assert stopped >= 60  # it does stop: well below the step, most runs of more than a few keys


def test_the_stop_counts_the_work_a_stage_has_left():
    """One pipeline of 24 units of 1 s, PP 2, v 2, forward fraction 1/2: each stage works 24 s
    and the step is 24.5 s (stage 1 waits 0.5 s for the first forward chunk). Told to beat 24 s,
    the run stops: stage 1's finish so far plus the 24 s less what it has run already passes 24 s
    at the first check, while its finish so far alone stays under 24 s at every check."""
    lists, dur = [list(range(24))], {u: 1.0 for u in range(24)}
    kw = dict(pp=2, vpp=2, forward_fraction=0.5)
    assert simulate_interleaved(lists, dur, **kw).tolist() == [24.5]
    assert np.isinf(simulate_interleaved(lists, dur, stop_above=24.0, **kw)).all()
    assert simulate_interleaved(lists, dur, stop_above=24.5, **kw).tolist() == [24.5]
    # a step equal to the value is no reason to stop, not even at 0 (units that take no time)
    assert simulate_interleaved(lists, {}, stop_above=0.0, **kw).tolist() == [0.0]


def test_a_ring_that_waits_for_its_slowest_member_by_hand():
    """PP 2, v 2, forward fraction 1/2, so an op takes a quarter of its unit's stage time:
    pipeline 0 runs unit 5 (0.5 s an op) then ring 9 (0.25 s), pipeline 1 unit 7 (0.125 s) then
    ring 9. Stage 0 runs F00 F10 F01 F11 B01 B11 B00 B10 (op, local index, chunk), stage 1
    F00 F10 F01 B01 F11 B11 B00 B10. Op by op, pipeline 0 sets every start of the ring: its
    forwards on stage 0 start at 0.5 and 1.5, its backwards on stage 0 at 3.0 and, after
    pipeline 0's B00 on stage 0 (3.5 .. 4.0), at 4.0, so both pipelines end at 4.25 s, while
    pipeline 1's own work ends by 3.375 s (alone, by 1.0 s)."""
    lists = [[5, 9], [7, 9]]
    dur = {5: 2.0, 7: 0.5, 9: 1.0}
    got = simulate_interleaved(lists, dur, pp=2, vpp=2, forward_fraction=0.5)
    assert got.tolist() == [4.25, 4.25]
    assert np.array_equal(got, walk_schedule(lists, dur, pp=2, vpp=2, forward_fraction=0.5).rank_finish_s)
    # alone, pipeline 1 runs its 8 ops of 0.125 s back to back
    assert simulate_interleaved([[5], [7]], dur, pp=2, vpp=2, forward_fraction=0.5)[1] == 1.0


def test_a_unit_at_two_local_indices_or_twice_in_a_list_is_left_to_the_graph_walk():
    assert simulate_interleaved([[1, 2], [2]], {1: 1.0, 2: 1.0}, pp=2, vpp=2, forward_fraction=0.5) is None
    assert simulate_interleaved([[1, 1]], {1: 1.0}, pp=2, vpp=2, forward_fraction=0.5) is None
    # simulate_schedule then walks the graph (a shifted ring may still be acyclic)
    walked = walk_schedule([[1, 2], [2]], {1: 1.0, 2: 1.0}, pp=2, vpp=2)
    result = simulate_schedule([[1, 2], [2]], {1: 1.0, 2: 1.0}, pp=2, vpp=2)
    assert (result is None) == (walked is None)
    if result is not None:
        assert np.array_equal(result.rank_finish_s, walked.rank_finish_s)


def test_empty_pipelines_finish_at_zero_and_unknown_units_take_no_time():
    assert np.array_equal(simulate_interleaved([[], []], {}, pp=2, vpp=2, forward_fraction=0.5), [0.0, 0.0])
    got = simulate_interleaved([[3], []], {}, pp=2, vpp=2, forward_fraction=0.5)
    assert np.array_equal(got, [0.0, 0.0])
    got = simulate_interleaved([[3], [], [4]], {3: 1.0}, pp=3, vpp=2, forward_fraction=0.5)
    assert np.array_equal(got, walk_schedule([[3], [], [4]], {3: 1.0}, pp=3, vpp=2, forward_fraction=0.5).rank_finish_s)
    assert got[1] == 0.0 and got[2] == 0.0 and got[0] > 0.0


@pytest.mark.parametrize("m, pp, vpp", [(4, 2, 2), (6, 3, 2), (8, 4, 4), (4, 4, 3)])
def test_the_keys_grow_along_every_edge_of_the_template(m, pp, vpp):
    bounds, ph, i, c, s, own, dep = template_keys(m, pp, vpp)
    key = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    per = 2 * vpp * pp
    where = {}  # (i, phase, chunk, stage) -> key
    for k, a, b, cc, ss in zip(key.tolist(), i.tolist(), ph.tolist(), c.tolist(), s.tolist()):
        where[(a, b, cc, ss)] = k
    assert len(where) == m * per
    for k, a, d in zip(key.tolist(), i.tolist(), dep.tolist()):  # each op after its chain predecessor
        if d >= 0:
            b, rest = divmod(d, vpp * pp)
            assert where[(a, b, *divmod(rest, pp))] < k
    for stage in range(pp):  # each stage's op sequence in ascending keys
        seq = [where[(a, 0 if p == "F" else 1, cc, stage)] for p, a, cc in pipeline_stage_ops(list(range(m)), pp, vpp,
                                                                                               stage)]
        assert seq == sorted(seq) and len(set(seq)) == len(seq)
