"""The vectorised 1F1B simulation (:mod:`megatron_bytescale.planner.wavefront`) gives the graph
walk's times bit for bit, and declines plans whose rings are not at one local index."""

from __future__ import annotations

import random

import numpy as np
import pytest

from megatron_bytescale.planner import wavefront
from megatron_bytescale.planner.order import _simulate_pipelines
from megatron_bytescale.planner.wavefront import pipelines_alone, simulate_wavefront
from planner_cases import random_pipeline_lists


@pytest.mark.parametrize("tail_ops", [None, 0, 10**9])
@pytest.mark.parametrize("seed", range(4))
def test_the_same_floats_as_the_graph_walk(seed, tail_ops, monkeypatch):
    """Also with the Python tail (the keys after the last ring, once few pipelines are left)
    never taken (0) and taken as soon as no ring is left (10**9)."""
    if tail_ops is not None:
        monkeypatch.setattr(wavefront, "_TAIL_OPS", tail_ops)
    rng = random.Random(seed)
    rings = 0
    for _ in range(500):
        lists, dur, pp = random_pipeline_lists(rng)
        ff = rng.choice([1 / 3, 0.25, 0.5])
        got = simulate_wavefront(lists, dur, pp, ff)
        want = _simulate_pipelines(lists, dur, pp, ff, len(lists), False).rank_finish_s
        assert got is not None and np.array_equal(got, want), (lists, pp)
        rings += len({o for ol in lists for o in ol}) < sum(len(ol) for ol in lists)
    assert rings > 100  # rings were exercised


def test_a_ring_at_two_local_indices_is_left_to_the_graph_walk():
    # order 5 is the second micro-batch of rank 0 and the first of rank 1
    assert simulate_wavefront([[1, 5], [5, 6]], {1: 1.0, 5: 2.0, 6: 1.0}, 2, 1 / 3) is None


def test_empty_pipelines_finish_at_zero():
    assert np.array_equal(simulate_wavefront([[], [3]], {3: 1.5}, 3, 0.5),
                          _simulate_pipelines([[], [3]], {3: 1.5}, 3, 0.5, 2, False).rank_finish_s)
    assert np.array_equal(simulate_wavefront([[], []], {}, 2, 0.5), np.zeros(2))


@pytest.mark.parametrize("seed", range(2))
def test_a_pipeline_alone_finishes_no_later_and_without_rings_the_same(seed):
    rng = random.Random(100 + seed)
    below = 0
    for _ in range(400):
        lists, dur, pp = random_pipeline_lists(rng)
        alone = pipelines_alone([[dur[o] for o in ol] for ol in lists], pp, 1 / 3)
        full = simulate_wavefront(lists, dur, pp, 1 / 3)
        assert np.all(alone <= full)
        if len({o for ol in lists for o in ol}) == sum(len(ol) for ol in lists):
            assert np.array_equal(alone, full)  # no ring: nothing to wait for
        below += bool(np.any(alone < full))
    assert below > 20  # rings made some pipelines wait


@pytest.mark.parametrize("seed", range(3))
def test_pipelines_alone_in_count_bands_are_the_graph_walks_floats(seed):
    """``pipelines_alone`` times pipelines in bands of similar micro-batch counts: lists from 0 to
    ~100 micro-batches, many short and a few long (as balance's candidates have them), so that
    there are several bands, wide ones on the numpy path and narrow ones on the Python tail, and
    empty pipelines. Without rings every pipeline's finish is the graph walk's float."""
    rng = random.Random(300 + seed)
    pp = rng.randint(2, 6)
    counts = [rng.choice([0, rng.randint(1, 6), rng.randint(1, 20)]) for _ in range(60)]
    counts += [rng.randint(21, 110) for _ in range(rng.randint(1, 14))]
    rng.shuffle(counts)
    lists, dur, order = [], {}, 0
    for c in counts:
        lists.append(list(range(order, order + c)))
        for o in lists[-1]:
            dur[o] = rng.random() * rng.choice([1.0, 1e-3, 100.0])
        order += c
    assert len(wavefront._count_bands(np.array(counts))) >= 4
    got = pipelines_alone([[dur[o] for o in ol] for ol in lists], pp, 1 / 3)
    want = _simulate_pipelines(lists, dur, pp, 1 / 3, len(lists), False).rank_finish_s
    assert np.array_equal(got, want)


def test_count_bands_hold_every_pipeline_with_micro_batches_once_at_least_half_as_long_as_the_longest():
    counts = np.array([0, 9, 3, 17, 4, 0, 8, 1, 16, 2, 5])
    bands = wavefront._count_bands(counts)
    assert sorted(np.concatenate(bands).tolist()) == [k for k, c in enumerate(counts) if c > 0]
    for band in bands:
        assert 2 * counts[band].min() > counts[band].max()
    assert [sorted(counts[b].tolist()) for b in bands] == [[9, 16, 17], [5, 8], [3, 4], [2], [1]]


def test_alone_floor_bounds_every_candidate_between_pipeline_floor_and_its_estimate(monkeypatch):
    """Every PP candidate balance ranks: order_free_floor <= alone_floor <= the full estimate, and the
    floors balance computes together equal each computed alone."""
    import megatron_bytescale.planner.schedulers.balance as balance_mod
    from megatron_bytescale.data.synthetic import synthetic_lengths
    from megatron_bytescale.planner.estimate import estimate_plan
    from megatron_bytescale.planner.schedulers import make_plan
    from megatron_bytescale.planner.schedulers._common import emit_plan
    from megatron_bytescale.planner.schedulers.pp_floors import alone_floor, alone_floors, order_free_floor
    from planner_cases import small_cost_model

    seen = []

    def checking(candidates, ctx, pp_size):
        floors = alone_floors(candidates, ctx, pp_size)
        request = checking.request
        for (placements, units), floor in zip(candidates, floors):
            assert floor == alone_floor(placements, units, ctx, pp_size)  # batched as alone
            plan = emit_plan(request, placements, scheduler="balance")
            step = estimate_plan(plan, ctx.cost_model).step_time_s
            assert order_free_floor(placements, units, ctx, pp_size) <= floor * (1 + 1e-12)
            assert floor <= step * (1 + 1e-12)
            seen.append(floor < step)
        return floors

    real = balance_mod._best_pp_plan

    def capture(request, options, meta):
        checking.request = request
        return real(request, options, meta)

    monkeypatch.setattr(balance_mod, "alone_floors", checking)
    monkeypatch.setattr(balance_mod, "_best_pp_plan", capture)
    for ds in ("github", "byted"):
        for pp, hdp in ((2, 8), (4, 8)):
            lengths = synthetic_lengths(ds, 120_000, seed=0, max_length=16_384)
            make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=2_048, cost_model=small_cost_model(),
                      pp_size=pp, context_length=16_384)
    assert len(seen) > 20 and any(seen)


def test_no_pipelines_and_orders_without_a_duration():
    """No pipelines at all: nothing to time. An order missing from the durations weighs nothing
    (what ``order.simulate`` documents for its ``durations``), as in the graph walk."""
    assert simulate_wavefront([], {}, 2, 0.5).shape == (0,)
    assert pipelines_alone([], 3, 0.5).shape == (0,)
    lists, dur = [[1, 2], [3, 2]], {2: 1.5}
    got = simulate_wavefront(lists, dur, 2, 0.5)
    assert np.array_equal(got, _simulate_pipelines(lists, dur, 2, 0.5, 2, False).rank_finish_s)
    # only ring 2 weighs (1.5 s a stage): both members start it at 0, forward and back through
    # 2 stages
    assert got.tolist() == [3.0, 3.0]
