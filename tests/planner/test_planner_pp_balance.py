"""PP-Balance's pieces on hand-made units with times computed by hand.

The linear cost model of ``test_planner_balance_units.py`` (1 ms per padded token per member,
free links, one layer, 4 ranks per node): a sequence of L tokens on a ring of D takes
``2 * D * ceil(L / 2D) / D`` ms per member, a single L ms. A pipeline's load is its stage work
plus ``fill_drain`` x its longest micro-batch; every trace below is worked out in the docstring.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.balance import pp_balance
from megatron_bytescale.planner.schedulers.pp_balance import PipelineLoad
from megatron_bytescale.planner.schedulers.pp_steps import level_steps
from megatron_bytescale.planner.sharding import ShardingContext
from planner_cases import LINEAR_CM as CM, linear_ctx as ctx, linear_unit as unit, small_cost_model


def by_rank(placements, n):
    """Sequence ids per rank, in placement order."""
    out = [[] for _ in range(n)]
    for p in placements:
        for r in p.ring:
            out[r].append(p.seqs[0])
    return out


def loads(placements, units, n, fill_drain=0):
    """Per-pipeline load recomputed independently: stage work + fill_drain x longest."""
    t = {u.seqs[0]: u.time for u in units}
    per = by_rank(placements, n)
    return [sum(t[s] for s in seqs) + fill_drain * max((t[s] for s in seqs), default=0.0) for seqs in per]


UNITS = [unit(0, 2000, ring=2), unit(1, 1200, ring=2), unit(2, 500), unit(3, 400), unit(4, 300),
         unit(5, 200), unit(6, 100)]


def test_rings_widest_first_then_runs_below_the_threshold():
    """Rings R (seq 0, 1.0 s) and S (seq 1, 0.6 s) of 2; singles 0.5, 0.4, 0.3, 0.2, 0.1.

    R takes the least-loaded ranks 0, 1; S the count group of ranks that ran no ring: 2, 3.
    Loads 1, 1, 0.6, 0.6. Runs (delta 0, one bucket): max 1.0, ranks under it: 2, 3. Rank 2
    gets 0.5 (1.1; + 0.4 would pass 1.0), rank 3 gets 0.4 (1.0). Max 1.1: ranks 0, 1, 3 at
    1.0 get 0.3, 0.2, 0.1 (one each: a second would pass 1.1). Loads 1.3, 1.2, 1.1, 1.1.
    """
    placements = pp_balance(UNITS, ctx(4), 4, delta=0.0, num_buckets=1)
    assert by_rank(placements, 4) == [[0, 4], [0, 5], [1, 2], [1, 3, 6]]
    assert [p.ring for p in placements[:2]] == [(0, 1), (2, 3)]
    assert loads(placements, UNITS, 4) == pytest.approx([1.3, 1.2, 1.1, 1.1])


def test_the_lightest_pipeline_goes_first_and_a_run_continues():
    """Singles 0.6, 0.5, 0.3 on 2 empty pipelines (delta 0.3): no pipeline is under the
    threshold (max 0), so both are targets and each takes one (0.6 on 0, 0.5 on 1; a second
    would pass the max 0). Then max 0.6, threshold 0.42: none under it, so both are targets,
    lightest first: 0.3 goes to pipeline 1 (0.5), not 0 (0.6).

    A ring R of 2 (2,500 tokens: 1.25 s) takes pipelines 0, 1; singles 0.5 then 0.4 (delta 0.3):
    max 1.25, threshold 0.875, targets 2 and 3. Pipeline 2 takes 0.5 and, as a run in the same
    bucket, 0.4 too (0.9 <= 1.25), so pipeline 3 stays empty.
    """
    singles = [unit(0, 600), unit(1, 500), unit(2, 300)]
    assert by_rank(pp_balance(singles, ctx(2), 2, delta=0.3, num_buckets=1), 2) == [[0], [1, 2]]
    units = [unit(0, 2500, ring=2), unit(2, 500), unit(1, 400)]
    assert by_rank(pp_balance(units, ctx(4), 4, delta=0.3, num_buckets=1), 4) == [[0], [0], [2, 1], []]


def test_a_run_stops_at_its_bucket_and_offload_ratios_are_kept():
    """A ring of 2 (1,800 tokens: 0.9 s) on pipelines 0, 1; singles 0.5 and 0.4 (offload ratio
    0.25) in 3 buckets of equal work: [0.5], [0.4]. Pipeline 2 takes 0.5, and 0.4 would fit
    under the max (0.9) but is in the next bucket, so pipeline 3 takes it. Every placement
    keeps its unit's offload ratio (the ring's 0.5 too)."""
    units = [unit(0, 1800, ring=2, ratio=0.5), unit(2, 500, ratio=0.25), unit(1, 400, ratio=0.25)]
    placements = pp_balance(units, ctx(4), 4, delta=0.1, num_buckets=3)
    assert by_rank(placements, 4) == [[0], [0], [2], [1]]
    assert [(p.seqs[0], p.offload_ratio) for p in placements] == [(0, 0.5), (2, 0.25), (1, 0.25)]


def test_a_run_may_reach_the_max_but_not_pass_it():
    """Singles 0.9, 0.8, 0.5, 0.3, 0.1 on 3 pipelines (delta 0.3). Round 1 (max 0, all targets):
    0.9, 0.8, 0.5 one each. Round 2: max 0.9, threshold 0.63, target pipeline 2 (0.5): it takes
    0.3 (0.8) and 0.1, which brings it exactly to the max 0.9."""
    units = [unit(3, 900), unit(4, 800), unit(2, 500), unit(0, 300), unit(1, 100)]
    assert by_rank(pp_balance(units, ctx(3), 3, delta=0.3, num_buckets=1), 3) == [[3], [4], [2, 0, 1]]


def test_a_pipeline_at_the_threshold_is_not_a_target():
    """A ring of 3 (2,000 tokens: 0.668 s) with fill_drain 1 loads pipelines 0-2 with
    0.668 + 0.668 = 1.336. Singles 0.4 and 0.1 in buckets [0.4], [0.1]; delta 0, so the threshold
    is the max 1.336, which pipelines 0-2 sit at: only pipeline 3 is a target, in both rounds
    (0.4 + 0.4 = 0.8, then 0.1 + 0 = 0.1 more, since 0.1 is not its longest)."""
    units = [unit(0, 2000, ring=3), unit(2, 400), unit(1, 100)]
    placements = pp_balance(units, ctx(4), 4, delta=0.0, num_buckets=3, fill_drain=1)
    assert by_rank(placements, 4) == [[0], [0], [0], [2, 1]]
    assert loads(placements, units, 4, fill_drain=1) == pytest.approx([1.336, 1.336, 1.336, 0.9])


def test_fill_drain_charges_each_pipeline_its_longest_micro_batch():
    """fill_drain 3, singles 0.8, 0.7, 0.2, 0.1 on 2 pipelines (delta 0): 0.8 on pipeline 0
    (load 0.8 + 3 x 0.8 = 3.2), 0.7 on 1 (2.8). Round 2: max 3.2, target pipeline 1: 0.2 adds
    only 0.2 (shorter than its longest, 0.7), then 0.1 (3.1 <= 3.2) in the same run.

    fill_drain 1, a ring of 2 (800 tokens: 0.4 s) on pipelines 0, 1 (load 0.8); singles 0.3 and
    0.1: pipeline 2 takes 0.3 (0.3 + 0.3 = 0.6) and then 0.1 (0.7 <= 0.8), pipeline 3 nothing."""
    units = [unit(2, 800), unit(0, 700), unit(1, 200), unit(3, 100)]
    placements = pp_balance(units, ctx(2), 2, delta=0.0, num_buckets=1, fill_drain=3)
    assert by_rank(placements, 2) == [[2], [0, 1, 3]]
    assert loads(placements, units, 2, fill_drain=3) == pytest.approx([3.2, 3.1])
    units = [unit(0, 800, ring=2), unit(1, 300), unit(2, 100)]
    placements = pp_balance(units, ctx(4), 4, delta=0.0, num_buckets=1, fill_drain=1)
    assert by_rank(placements, 4) == [[0], [0], [1, 2], []]
    assert loads(placements, units, 4, fill_drain=1) == pytest.approx([0.8, 0.8, 0.7, 0.0])


def window_loads(placements, units, n, window, forward_fraction):
    """Per-pipeline window load recomputed independently: stage work + the idle of the longest
    with the next ``window`` at the larger share and the ``window`` after them at the smaller."""
    t = {u.seqs[0]: u.time for u in units}
    big = max(forward_fraction, 1 - forward_fraction)
    out = []
    for seqs in by_rank(placements, n):
        times = sorted((t[s] for s in seqs), reverse=True)
        idle = (window * times[0] - big * sum(times[1:window + 1])
                - (1 - big) * sum(times[window + 1:2 * window + 1])) if times else 0.0
        out.append(sum(times) + max(idle, 0.0))
    return out


def test_the_window_load_gives_a_long_rings_pipelines_what_hides_beside_it():
    """PP 2 (window 1, forward share 1/3), a ring of 2 (1.0 s) on pipelines 0, 1 (load 1.0 + the
    idle 1.0 = 2.0), singles 0.9, 0.8, 0.7, 0.6, 0.5 on 3 pipelines (delta 0). Pipeline 2 takes
    0.9 (load 1.8); 0.8 would make it 1.7 + (0.9 - 2/3 0.8) = 2.067 > 2.0, so the run stops, and
    in the next round it is the only target and takes it. Pipelines 0 and 1 then take 0.7
    (1.7 + 1.0 - 2/3 0.7 = 2.233) and 0.6 (2.2): each hides 2/3 of it in the ring's window.
    Pipeline 2, the lightest, takes 0.5 (2.2 + 0.9 - 2/3 0.8 - 1/3 0.5 = 2.4). The fill-and-drain
    load charges the ring's pipelines the singles in full and gives pipeline 1 two of them."""
    units = [unit(0, 2000, ring=2), unit(1, 900), unit(2, 800), unit(3, 700), unit(4, 600), unit(5, 500)]
    assert CM.forward_fraction == pytest.approx(1 / 3)
    placements = pp_balance(units, ctx(3), 3, delta=0.0, num_buckets=1, window=1)
    assert by_rank(placements, 3) == [[0, 3], [0, 4], [1, 2, 5]]
    assert window_loads(placements, units, 3, 1, 1 / 3) == pytest.approx([2.2333333, 2.2, 2.4])
    assert by_rank(pp_balance(units, ctx(3), 3, delta=0.0, num_buckets=1, fill_drain=1), 3) == [
        [0, 3], [0, 4, 5], [1, 2]]


def test_the_window_load_counts_the_next_window_at_the_larger_share_and_then_the_smaller():
    """PP 3 (window 2): a ring of 2 (2.0 s) on pipelines 0, 1 and singles 1.0 x 5 on 2 of 4
    pipelines' worth: on its own a pipeline of the ring is at 2.0 + 2 x 2.0 = 6.0; the first two
    singles hide 2/3 each (6.0 + 2 x 1/3), the next two 1/3 each (+ 2 x 2/3), the fifth nothing."""
    load = PipelineLoadProbe(window=2, forward_fraction=1 / 3)
    steps = [load.add(2.0)] + [load.add(1.0) for _ in range(5)]
    assert steps == pytest.approx([6.0, 6 + 1 / 3, 6 + 2 / 3, 7 + 1 / 3, 8.0, 9.0])


@pytest.mark.parametrize("window, forward_fraction", [(1, 1 / 3), (2, 0.7), (3, 1 / 3)])
def test_the_window_load_after_every_micro_batch_equals_its_formula_on_the_whole_list(window, forward_fraction):
    """Lists longer than the 2 window + 1 kept times, with ties and late long ones: after every
    micro-batch the load, and what floor_after said it would be, equal the formula on the whole
    list (the longest, the next window at the larger share, the window after at the smaller)."""
    rng = np.random.default_rng(window)
    big = max(forward_fraction, 1 - forward_fraction)
    for _ in range(20):
        load = PipelineLoad(2, 0, window, forward_fraction)
        times: list[float] = []
        for t in rng.choice([0.5, 1.0, 2.0, 3.0, 7.0], size=int(rng.integers(1, 12))):
            t = float(t)
            said = load.floor_after(1, t)
            load.add(1, t)
            times.append(t)
            top = sorted(times, reverse=True)
            expected = (sum(times) + window * top[0] - big * sum(top[1:window + 1])
                        - (1 - big) * sum(top[window + 1:2 * window + 1]))
            assert said == pytest.approx(expected) and load.loads[1] == pytest.approx(expected), times
        assert load.loads[0] == 0.0


def test_a_window_load_run_continues_while_the_pipeline_stays_under_the_max():
    """A ring of 2 (1.0 s) on pipelines 0, 1 (window loads 2.0); singles 0.4, 0.3, 0.2, 0.1 on 4
    pipelines (delta 0): pipeline 2 takes them all in one run (loads 0.8, 0.9, 1.03, 1.13, each
    under 2.0), pipeline 3 none."""
    units = [unit(0, 2000, ring=2), unit(1, 400), unit(2, 300), unit(3, 200), unit(4, 100)]
    placements = pp_balance(units, ctx(4), 4, delta=0.0, num_buckets=1, window=1)
    assert by_rank(placements, 4) == [[0], [0], [1, 2, 3, 4], []]


def test_a_window_load_run_may_reach_the_max_but_not_pass_it():
    """Forward share 1/2, so every load below is exact: a ring of 2 (1.0 s) loads pipelines 0, 1
    with 2.0; five singles of 0.5 s on 4 pipelines (delta 0). Pipeline 2's run: 1.0, 1.25, 1.5,
    and the fourth single (outside the window of 3 kept times) brings it to exactly 2.0, the max:
    it takes it. Pipeline 3 takes the fifth."""
    half = small_cost_model(num_layers=1, alpha1=0.0, beta1=1e-3, gamma=0.0, p2p_bandwidth_inter=1e30,
                            p2p_bandwidth_intra=1e30, p2p_latency_s=0.0, ring_step_overhead_s=0.0,
                            forward_fraction=0.5)
    c = ShardingContext(capacity=1000, layers=1, cost_model=half, hdp_size=4, offload=False)
    units = [unit(0, 2000, ring=2)] + [unit(k, 500) for k in range(1, 6)]
    placements = pp_balance(units, c, 4, delta=0.0, num_buckets=1, window=1)
    assert by_rank(placements, 4) == [[0], [0], [1, 2, 3, 4], [5]]
    assert window_loads(placements, units, 4, 1, 0.5) == [2.0, 2.0, 2.0, 1.0]


def test_a_fill_and_drain_run_stops_where_the_next_would_pass_the_max():
    """fill_drain 3: a ring of 2 (1.0 s) loads pipelines 0, 1 with 4.0; pipeline 2 takes 0.9
    (3.6), and 0.6 would bring it to 4.2 (shorter than its longest, so no fill-and-drain term),
    past the max: the run stops and pipeline 3 takes it."""
    units = [unit(0, 2000, ring=2), unit(1, 900), unit(2, 600)]
    placements = pp_balance(units, ctx(4), 4, delta=0.0, num_buckets=1, fill_drain=3)
    assert by_rank(placements, 4) == [[0], [0], [1], [2]]


def test_a_later_count_group_that_fits_one_node_beats_an_earlier_one_that_must_wait():
    """8 pipelines on 2 nodes (0-3, 4-7), loads 1, 2, 50, 50, 1, 0, 0, 0. A ring of 3 (5.0 s)
    takes 5, 6, 7. The next ring of 3 sees the count groups {0-4} (its 3 least loaded, 0, 4 and
    1, span both nodes, so on one node it starts at 50) and {5, 6, 7} (one node, at 5.0): it
    goes to 5, 6, 7. Stopping the search after the first group would leave it on 0, 1, 2."""
    from megatron_bytescale.planner.schedulers.placement import RingPlacer
    from megatron_bytescale.planner.schedulers.pp_balance import _place_rings_aligned

    c = ctx(8)
    load = PipelineLoad(8, 0, 0, CM.forward_fraction)
    load.loads[:] = [1.0, 2.0, 50.0, 50.0, 1.0, 0.0, 0.0, 0.0]
    first, second = unit(0, 15000, ring=3), unit(1, 300, ring=3)
    placements = _place_rings_aligned([second, first], c, RingPlacer(c.nodes, 8), load)
    assert [p.ring for p in placements] == [(5, 6, 7), (5, 6, 7)]


def test_the_fill_and_drain_load_adds_only_the_work_of_a_shorter_micro_batch():
    """fill_drain 3, singles 0.8, 0.7, 0.2, 0.1 (the trace of
    test_fill_drain_charges_each_pipeline_its_longest_micro_batch): loads 3.2 and 3.1. A ring
    (fill_drain 1) of 2.5 s, then one of 0.5 s on the same pipelines (loads 0, 1, 9, 2 as in
    test_a_ring_goes_to_the_count_group_whose_dth_least_load_is_lowest): 2 x 2.5, then + 0.5."""
    from megatron_bytescale.planner.schedulers.placement import RingPlacer
    from megatron_bytescale.planner.schedulers.pp_balance import _place_rings_aligned, _place_runs

    load = PipelineLoad(2, 3, 0, CM.forward_fraction)
    _place_runs([unit(2, 800), unit(0, 700), unit(1, 200), unit(3, 100)], load, delta=0.0, num_buckets=1)
    assert load.loads == pytest.approx([3.2, 3.1])
    c = ctx(4)
    load = PipelineLoad(4, 1, 0, CM.forward_fraction)
    load.loads[:] = [0.0, 1.0, 9.0, 2.0]
    first, second = unit(0, 5000, ring=2), unit(1, 1000, ring=2)
    placements = _place_rings_aligned([second, first], c, RingPlacer(c.nodes, 4), load)
    assert [p.ring for p in placements] == [(0, 1), (0, 1)]
    assert load.loads == pytest.approx([5.5, 6.5, 9.0, 2.0])


class PipelineLoadProbe:
    """One pipeline of pp_balance's window load: its load after each micro-batch."""

    def __init__(self, window: int, forward_fraction: float) -> None:
        self.load = PipelineLoad(1, 0, window, forward_fraction)

    def add(self, t: float) -> float:
        self.load.add(0, t)
        return self.load.loads[0]


@pytest.mark.parametrize("forward_fraction", [1 / 3, 0.6])
def test_the_order_free_floor_is_the_stage_work_plus_the_longest_micro_batch_idle(forward_fraction):
    """Pipelines 0-3 on one node: a ring of 2 (2,000 tokens: 1.0 s on each member), singles of
    0.5, 0.3 and 0.2 s on pipeline 1, of 0.6, 0.4 and 0.25 s on pipeline 2 and 0.1 s on
    pipeline 3. One stage: the busiest pipeline's work, 2.0 s. PP 2 (w = 1): pipeline 1 adds
    w x 1.0 less the larger share (``max(f, 1 - f)``, forward or backward) of 0.5 and the
    smaller of 0.3; pipeline 2's own shares are its own (0.4 and 0.25). PP 3 (w = 2): 2 x 1.0
    less the larger share of 0.5 + 0.3 and the smaller of 0.2; pipeline 0 holds the ring
    alone, 1.0 + 2 x 1.0. No order of pipeline 1's micro-batches runs faster alone than the
    bound."""
    import itertools

    from megatron_bytescale.planner.schedulers._common import Placement
    from megatron_bytescale.planner.schedulers.pp_floors import alone_floor, order_free_floor

    c4 = ShardingContext(capacity=1000, layers=1, cost_model=CM.with_(forward_fraction=forward_fraction),
                         hdp_size=4, offload=False)
    units = [unit(0, 2000, ring=2), unit(1, 500), unit(2, 300), unit(3, 200), unit(4, 100),
             unit(5, 600), unit(6, 400), unit(7, 250)]
    placements = [Placement(ring=(0, 1), seqs=(0,))] + [
        Placement(ring=(r,), seqs=(s,)) for r, s in ((1, 1), (1, 2), (1, 3), (3, 4), (2, 5), (2, 6), (2, 7))]
    big, small = max(forward_fraction, 1 - forward_fraction), min(forward_fraction, 1 - forward_fraction)
    assert order_free_floor(placements, units, c4, 1) == pytest.approx(2.0)
    assert order_free_floor(placements, units, c4, 2) == pytest.approx(3.0 - 0.5 * big - 0.3 * small)
    assert order_free_floor(placements, units, c4, 3) == pytest.approx(max(4.0 - 0.8 * big - 0.2 * small, 3.0))
    assert order_free_floor(placements[4:5], units, c4, 2) == pytest.approx(0.2)
    assert order_free_floor([], units, c4, 2) == 0.0
    for pp in (2, 3):
        bound = order_free_floor(placements, units, c4, pp)
        assert min(alone_floor(list(order) + placements[4:], units, c4, pp)
                   for order in itertools.permutations(placements[:4])) >= bound * (1 - 1e-12)


def test_the_floors_time_a_ring_where_it_sits():
    """A ring of 2 costed inside a node (0.5 s a member) but placed on ranks 3 and 4, across
    the boundary of two 4-rank nodes over a slow network, runs at its placed time there; both
    floors charge that time, not the unit's own."""
    from megatron_bytescale.planner.schedulers._common import Placement
    from megatron_bytescale.planner.schedulers.pp_floors import alone_floor, order_free_floor

    slow = ShardingContext(capacity=1000, layers=1, cost_model=CM.with_(p2p_bandwidth_inter=1e6),
                           hdp_size=8, offload=False)
    ring = unit(0, 1000, ring=2)
    placements = [Placement(ring=(3, 4), seqs=(0,))]
    placed = slow.placed_time(ring, (3, 4))
    assert placed > ring.time * 1.2  # the crossing shows
    assert order_free_floor(placements, [ring], slow, 1) == pytest.approx(placed)
    assert alone_floor(placements, [ring], slow, 2) == pytest.approx(2 * placed)  # crosses 2 stages
    assert order_free_floor(placements, [ring], slow, 2) == pytest.approx(2 * placed)


def test_a_ring_moves_onto_one_node_inside_its_count_group():
    """6 pipelines on 2 nodes (0-3, 4-5). A ring of 3 takes 0, 1, 2; the ring of 2 goes to the
    count group {3, 4, 5} (no ring yet), whose least-loaded pair 3, 4 straddles the nodes: it
    moves to 4, 5 on one node, and the single then goes to pipeline 3, the lightest."""
    units = [unit(2, 500), unit(0, 400, ring=3), unit(1, 200, ring=2)]
    placements = pp_balance(units, ctx(6), 6, delta=0.0, num_buckets=2, fill_drain=1)
    assert [p.ring for p in placements] == [(0, 1, 2), (4, 5), (3,)]


@pytest.mark.parametrize("hdp_size, pp_size, lengths, assignment, widened", [
    (4, 2, [160, 320, 380, 320], "pp-steps", 0),
    (6, 2, [140, 380], "pp-steps-eq3", 0),
    (4, 4, [320, 250, 20, 330], "pp-steps-eq3", 0),
    (8, 4, [360, 240, 320, 340], "pp-runs", 1),
    (6, 2, [180, 350, 330, 390], "pp-runs+next-levels-first", 0),
    (8, 4, [300, 50, 250, 180], "pp-runs-floor", 3),
    (8, 4, [160, 320, 250, 20, 330], "pp-runs-floor", 2),  # a window of PP + 1 changes it
    (8, 4, [170, 10, 270, 210, 100], "pp-runs-floor", 4),  # and one of PP - 2
    (8, 2, [140, 70, 240, 320], "pp-runs-floor+next-levels-first", 2),
    (8, 4, [360, 110, 260, 320], "pp-runs-isolated", 2),
    (8, 2, [110, 270, 160, 20], "pp-runs-1f1b", 3),
    (8, 4, [190, 270, 120, 390], "pp-runs-1f1b", 3),
])
def test_pp_balance_keeps_the_fastest_candidate(hdp_size, pp_size, lengths, assignment, widened):
    """PP-Balance plans its candidates (level steps on the widened and on Eq. 3's units, runs on
    the widened units with three loads and with the longest rings on pipelines of their own,
    Alg. 1's aligned fill), each also with the next levels first and with singles first, and
    keeps the fastest by the 1F1B estimate, the first on a tie. These are small
    batches of a seeded search on which each candidate wins (the fill, naive's plan, won on none
    of 3,000 such batches once level steps were added; it stays as the safety net), and a valid
    plan covers every token."""
    kw = dict(hdp_size=hdp_size, capacity=100, cost_model=small_cost_model(), pp_size=pp_size, offload=False)
    plan = make_plan(lengths, scheduler="balance", **kw).validate()
    naive = make_plan(lengths, scheduler="naive", **kw)
    assert plan.scheduler == "balance" and plan.meta["mode"] == "PP-Balance"
    assert (plan.meta["assignment"].removesuffix("+short-first"), plan.meta["widened_units"]) == (assignment, widened)
    assert plan.estimate.step_time_s <= naive.estimate.step_time_s


def test_level_steps_keep_rings_in_lockstep_and_give_the_tail_by_finish_time():
    """Rings R (seq 0, 1.0 s) and S (seq 1, 0.6 s) of 2 on 4 pipelines; singles 0.5 ... 0.1.

    Step 1: R takes ranks 0, 1, S ranks 2, 3 (both count group 0), no rank is free, and no ring
    is left: the ring phase ends and all five singles are the tail. The finish times given are
    0.3, 0.2, 0.45, 0.05 (not the stage work, 1.0, 1.0, 0.6, 0.6). Longest first, each to the
    pipeline that finishes first: 0.5 -> 3 (0.55), 0.4 -> 1 (0.6), 0.3 -> 0 (0.6), 0.2 -> 2
    (0.65), 0.1 -> 3 (0.65). By stage work, pipelines 2 and 3 would have taken the most."""
    calls = []

    def finish_times(placements):
        calls.append([p.ring for p in placements])
        return np.array([0.3, 0.2, 0.45, 0.05])

    placements = level_steps(UNITS, ctx(4), 4, finish_times)
    assert calls == [[(0, 1), (2, 3)]]  # called once, on the ring phase
    assert by_rank(placements, 4) == [[0, 4], [0, 3], [1, 5], [1, 2, 6]]


def test_level_steps_fill_the_free_ranks_of_a_ring_step_longest_first():
    """One ring of 2 (1.0 s) on 4 pipelines: ranks 2, 3 are free in its step and take the two
    longest singles (0.5, 0.4) at local index 0; the last (0.3) is the tail and goes to the
    pipeline that finishes first (3)."""
    units = [unit(0, 2000, ring=2), unit(4, 300), unit(2, 500), unit(3, 400)]
    placements = level_steps(units, ctx(4), 4, lambda p: np.array([1.0, 1.0, 0.5, 0.4]))
    assert by_rank(placements, 4) == [[0], [0], [2], [3, 4]]


def test_only_pipelines_below_the_threshold_take_work_while_one_exists():
    """Singles 1.0, 0.8, 0.1, 0.5, 0.5 on 3 pipelines (delta 0.3, one bucket, in this order).
    Round 1 (max 0, all targets): 1.0, 0.8 and 0.1 one each. Round 2: max 1.0, threshold 0.7:
    only pipeline 2 (0.1) is below it; it takes 0.5 (0.6; another 0.5 would pass the max).
    Round 3: max 1.0, pipeline 2 (0.6) is still the only one below 0.7 and takes the last 0.5.
    Pipeline 1, at 0.8, within delta of the max, takes nothing."""
    units = [unit(0, 1000), unit(1, 800), unit(2, 100), unit(3, 500), unit(4, 500)]
    assert by_rank(pp_balance(units, ctx(3), 3, delta=0.3, num_buckets=1), 3) == [[0], [1], [2, 3, 4]]


def test_a_ring_goes_to_the_count_group_whose_dth_least_load_is_lowest():
    """4 pipelines on one node, loads 0, 1, 9, 2. The first ring of 2 (2.5 s) takes pipelines 0
    and 1 (loads 2.5 and 3.5, one ring run). The second ring of 2 then has two count groups:
    {3, 2} (loads 2, 9: it could start at 9) and {0, 1} (2.5, 3.5: at 3.5). It must go to 0 and
    1; a group ranked by its least load instead of its d-th least would put it on 2 and 3."""
    from megatron_bytescale.planner.schedulers.placement import RingPlacer
    from megatron_bytescale.planner.schedulers.pp_balance import PipelineLoad, _place_rings_aligned

    c = ctx(4)
    load = PipelineLoad(4, 0, 0, CM.forward_fraction)
    load.loads[:] = [0.0, 1.0, 9.0, 2.0]
    first, second = unit(0, 5000, ring=2), unit(1, 1000, ring=2)
    placements = _place_rings_aligned([second, first], c, RingPlacer(c.nodes, 4), load)
    assert [(p.seqs, p.ring) for p in placements] == [((0,), (0, 1)), ((1,), (0, 1))]
    assert load.loads == [0.0 + first.time + second.time, 1.0 + first.time + second.time, 9.0, 2.0]


def _rings_by_full_search(rings, c, placer, load, ranks=None):
    """What ``_place_rings_aligned`` chooses, by the plain search: every ring (widest first) on
    the best ``(extra nodes, start, count)`` over every count group, each group's list rebuilt
    from the loads; no group skipped, nothing kept between rings."""
    from megatron_bytescale.planner.schedulers._common import Placement

    topo = placer.topology
    eligible = range(len(load.loads) if ranks is None else ranks)
    count = [0] * len(load.loads)
    out = []
    for u in sorted(rings, key=lambda x: (-x.ring_size, -x.time, x.seqs[0])):
        d, best = u.ring_size, None
        for group in sorted({count[r] for r in eligible}):
            ranked = sorted((load.loads[r], r) for r in eligible if count[r] == group)
            if len(ranked) < d:
                continue
            start, members = ranked[d - 1][0], [r for _, r in ranked[:d]]
            if topo.ring_nodes(members) > topo.min_nodes(d):
                start, members = placer.fewest_nodes_ranked(d, ranked, earliest=start)
            score = (topo.ring_nodes(members) - topo.min_nodes(d), start, group)
            if best is None or score < best[0]:
                best = (score, topo.node_contiguous(members))
        ring = best[1]
        t = c.placed_time(u, ring)
        for r in ring:
            if load.window:
                load.add(r, t)
            else:
                x = t - load.longest[r]
                load.loads[r] += t + load.fill_drain * max(x, 0.0)
                load.longest[r] = max(load.longest[r], t)
            count[r] += 1
        out.append(Placement(ring=ring, seqs=u.seqs, offload_ratio=u.offload_ratio))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_ring_placement_equals_the_search_of_every_count_group(seed):
    """``_place_rings_aligned`` keeps each count group's list sorted, stops at the first group
    that cannot win, reuses a group's choice while the group is unchanged and drops a group's
    front at once; the plain search of every group, lists rebuilt per ring, must make the same
    rings and loads. Random batches: runs of rings of one size (the kept choices), loads from a
    few values (ties), nodes of 2, 3 and 4 ranks and irregular node maps, all three pipeline
    loads, rings on a prefix of the ranks."""
    import random

    from megatron_bytescale.planner.schedulers.placement import RingPlacer
    from megatron_bytescale.planner.schedulers.pp_balance import _place_rings_aligned
    from megatron_bytescale.planner.topology import Topology

    rng = random.Random(seed)
    kinds = set()
    for trial in range(60):
        if rng.random() < 0.3:
            sizes = [rng.randint(1, 5) for _ in range(rng.randint(3, 7))]
            topology = Topology.from_node_map([k for k, m in enumerate(sizes) for _ in range(m)])
            n = sum(sizes)
        else:
            g = rng.choice([2, 3, 4])
            n = g * rng.randint(2, 6)
            topology = Topology(ranks_per_node=g)
        ranks = None if rng.random() < 0.6 else rng.randint(max(2, n // 2), n)
        top = n if ranks is None else ranks
        c = ShardingContext(capacity=1000, layers=1, cost_model=CM, hdp_size=n, offload=False, topology=topology)
        rings, seq = [], 0
        while len(rings) < rng.randint(3, 3 * n):
            d = rng.randint(2, min(top, 9))
            for _ in range(rng.choice([1, 1, 3, 6])):
                rings.append(unit(seq, rng.choice([400, 900, 1500, 3000]) + rng.randint(0, 40), ring=d))
                seq += 1
        fill_drain, window = rng.choice([(0, 0), (3, 0), (0, 3), (0, 1)])
        start = [rng.choice([0.0, 0.5, 1.0, 2.5]) for _ in range(n)]
        loads = []
        for _ in range(2):
            load = PipelineLoad(n, fill_drain, window, CM.forward_fraction)
            load.loads[:] = start
            loads.append(load)
        placer = RingPlacer(topology.first(top), top)
        got = _place_rings_aligned(list(rings), c, placer, loads[0], ranks)
        want = _rings_by_full_search(rings, c, RingPlacer(topology.first(top), top), loads[1], ranks)
        assert got == want, (seed, trial)
        assert loads[0].loads == loads[1].loads
        kinds.add((fill_drain, window, ranks is None, topology.node_of is None))
    assert len(kinds) >= 8
