"""Balance quality at scale, as a test: Byted-like and GitHub-like 32M-token batches, 64-1,024 ranks.

``test_balance_is_never_worse_than_naive`` holds by construction (balance keeps naive's fill as a
candidate), so it cannot see balance getting worse. Here the balance step is compared with two
lower bounds no schedule can beat, both computed in this file from the cost model's public
``micro_batch_time`` (not from ``estimate.py``):

* the work bound: rank-seconds of every micro-batch of the plan / ranks (perfect balance);
* the critical path: the longest sequence on its fastest ring of any size (a micro-batch
  carrying it cannot be faster, whatever else it carries).

The step itself is re-timed here by a plain event simulation (a ring starts when all members are
free). Widening a long sequence only to twice the work bound (a real regression: 33 s -> 65 s on
the Byted batch at 1,024 ranks) fails the 1.12x bound; so would any assignment worse than ~12 %.

With pipeline parallelism the step is held to the same 1.1x of a larger bound: the work bound
per stage, the critical path crossing every stage forward and backward (pp times longer), and
the 1F1B floor of the plan's own pipelines, ``planner.pipeline_floor.idle_floor`` (its
docstring proves it; tested here against every order of small lists): whatever the order,
while a long micro-batch crosses the other pp - 1 stages forward and back, stage 0 runs only
the 2 (pp - 1) ops its 1F1B window holds, and idles for the rest. The step is at least every
pipeline's stage work plus that floor, so at least their mean over the pipelines (the mean,
not the slowest pipeline, so an unbalanced assignment does not raise its own bound). The floor
is of the plan's own lists: it says no order of them beats it, not that no other assignment
could; the work and critical-path terms, which any assignment of the same rings must meet,
stay in the bound, with a fourth term that needs no assignment:
``planner.pipeline_floor.assignment_floor``, a pigeonhole argument on two length levels (some
pipeline takes two long micro-batches, a long and a medium one, or its share of the medium
ones). All terms are of the plan's own micro-batches, so a plan that wins with other rings is
held to their bounds, which can be lower: byted-1024-pp2 measured 1.038x with the runs' rings
and, since the next-levels-first candidate wins there with the level steps' rings (32.29 s
against 32.50 s), 1.127x. Before the floors were counted, five cases missed max(work, pp x
critical path) by 1.16-1.55x; in four of them the mean floor alone is 1.15-1.42x above that
bound, so no 1F1B order of their lists could reach it (docs/pipeline.md, "The 1F1B floor of a
pipeline's list"). Two cases still miss: strict expected failures, the measured ratio in the
reason.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.pipeline_floor import assignment_floor, idle_floor
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan

TOKENS = 32 * 2**20
CONTEXT = 2_097_152
CAPACITY = 8192
# "about 1.1x": the worst case measured is 1.109 (GitHub, 256 ranks, no offload), where every
# ring of 2-7 ranks must sit inside one 8-rank node (docs/topology.md); placed on the
# least-loaded ranks wherever they are, the same batch measured 1.098
DP_BOUND = 1.12
BOUND = 1.1  # PP-Balance

CM = preset_cost_model("llama-7b")
_LENGTHS: dict[tuple[str, int], np.ndarray] = {}


def lengths_of(dataset: str, seed: int) -> np.ndarray:
    if (dataset, seed) not in _LENGTHS:
        _LENGTHS[(dataset, seed)] = synthetic_lengths(dataset, TOKENS, seed=seed, max_length=CONTEXT)
    return _LENGTHS[(dataset, seed)]


def micro_batches(plan):
    """{order: (ring, lengths, offload_ratio)} over the whole plan."""
    lengths = plan.sequence_lengths()
    out = {}
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            out.setdefault(mb.order, (mb.ring, [lengths[s] for s in mb.seqs], mb.offload_ratio))
    return out


def member_seconds(plan, ring, lengths, ratio) -> float:
    return CM.micro_batch_time(lengths, len(ring), layers=plan.layers_per_stage, offload_ratio=ratio,
                               align=plan.align, intra_node=CM.ring_is_intra_node(ring))


def retimed_step(plan) -> tuple[float, float]:
    """(step, work bound) of a PP = 1 plan by a plain event simulation in global order."""
    free = np.zeros(plan.hdp_size)
    work = 0.0
    for order, (ring, lengths, ratio) in sorted(micro_batches(plan).items()):
        t = member_seconds(plan, ring, lengths, ratio)
        members = list(ring)
        free[members] = free[members].max() + t
        work += t * len(ring)
    return float(free.max()), work / plan.hdp_size


def critical_path(plan, top: int = 3) -> float:
    """The slowest of the ``top`` longest sequences, each alone on its fastest ring size."""
    longest = sorted((s.length for s in plan.sequences), reverse=True)[:top]
    best = 0.0
    for n in longest:
        fastest = min(
            CM.micro_batch_time([n], d, layers=plan.layers_per_stage, align=plan.align,
                                intra_node=d <= CM.ranks_per_node)
            for d in range(1, plan.hdp_size + 1)
        )
        best = max(best, fastest)
    return best


CASES = [
    # (dataset, ranks, offload, seed); 64 ranks cannot hold a 2M sequence without offload
    ("byted", 64, True, 0),
    ("github", 64, True, 0),
    ("byted", 256, True, 0),
    ("byted", 256, False, 1),
    ("github", 256, True, 1),
    ("github", 256, False, 0),
    ("byted", 1024, True, 0),
    ("byted", 1024, False, 0),
    ("github", 1024, True, 0),
    ("github", 1024, False, 1),
]


@pytest.mark.parametrize("dataset, ranks, offload, seed", CASES, ids=[f"{c[0]}-{c[1]}-offload{int(c[2])}-seed{c[3]}" for c in CASES])
def test_balance_is_within_ten_percent_of_the_lower_bounds(dataset, ranks, offload, seed):
    plan = make_plan(lengths_of(dataset, seed), scheduler="balance", hdp_size=ranks, capacity=CAPACITY,
                     cost_model=CM, context_length=CONTEXT, offload=offload)
    # the LPT assignment is what ran: a fallback (naive's fill) cannot hide a regression of it
    assert plan.meta["assignment"] == "lpt", plan.meta
    assert plan.meta["offload"] is offload
    # with offload allowed, balance keeps Eq. 3's offloaded rings only where they are faster
    # (selective offload; on the GitHub batch at 1,024 ranks the offload-free plan wins)
    assert (plan.meta["offloaded_micro_batches"] > 0) == (plan.meta["offload_choice"] == "eq3")
    step, work_bound = retimed_step(plan)
    assert plan.estimate.step_time_s == pytest.approx(step, rel=1e-9)
    bound = max(work_bound, critical_path(plan))
    assert step <= DP_BOUND * bound, (
        f"{dataset} on {ranks} ranks: step {step:.2f} s > {DP_BOUND} x max(work bound "
        f"{work_bound:.2f} s, critical path {critical_path(plan):.2f} s)")


def one_pipeline_1f1b(stage_times, pp: int, forward_fraction: float) -> float:
    """Makespan of one pipeline running its list (in this order) under 1F1B: a plain event loop."""
    m = len(stage_times)
    orders = []
    for s in range(pp):
        warmup = min(pp - 1 - s, m)
        ops = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        orders.append(ops + [("B", i) for i in range(m - warmup, m)])
    done: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * pp, [0] * pp
    while any(nxt[s] < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                need = ("F", i, s - 1) if kind == "F" else (("B", i, s + 1) if s < pp - 1 else ("F", i, s))
                if (kind == "F" and s == 0) or need in done:
                    start = max(free[s], done.get(need, 0.0))
                    share = forward_fraction if kind == "F" else 1 - forward_fraction
                    free[s] = done[(kind, i, s)] = start + share * stage_times[i]
                    nxt[s] += 1
                else:
                    break
    return max(free)


@pytest.mark.parametrize("phi", [CM.forward_fraction, 0.7])
def test_the_pipeline_floor_is_a_bound_every_order_keeps_and_meets_where_it_can(phi):
    """No order beats stage work + floor; equal micro-batches and one long between short ones meet it."""
    rng = np.random.default_rng(0)
    for pp in (2, 3, 4):
        for trial in range(12):
            times = list(rng.choice([0.5, 1.0, 3.0, 10.0], size=int(rng.integers(1, 7))))
            floor = idle_floor(times, pp, phi)
            best = min(one_pipeline_1f1b([times[i] for i in order], pp, phi)
                       for order in itertools.permutations(range(len(times))))
            assert sum(times) + floor <= best + 1e-9, (pp, times)
        # equal micro-batches: the textbook (m + pp - 1) t
        assert idle_floor([2.0] * 6, pp, phi) == pytest.approx((pp - 1) * 2.0)
        assert one_pipeline_1f1b([2.0] * 6, pp, phi) == pytest.approx((6 + pp - 1) * 2.0)
        # one long micro-batch between short ones: the window's shorts are all it can hide behind
        times = [1.0] * (pp - 1) + [30.0] + [1.0] * (pp - 1)
        assert sum(times) + idle_floor(times, pp, phi) == pytest.approx(one_pipeline_1f1b(times, pp, phi))
        assert idle_floor(times, pp, phi) == pytest.approx((pp - 1) * (30.0 - 1.0))
    # unequal shorts: the best order puts the longer where its larger share (backward when
    # forwards are the smaller part) falls in the window, and the floor counts it so
    for pp, times in ((2, [3.0, 30.0, 1.0]), (3, [3.0, 2.0, 30.0, 1.0, 0.5])):
        best = min(one_pipeline_1f1b([times[i] for i in order], pp, phi)
                   for order in itertools.permutations(range(len(times))))
        assert sum(times) + idle_floor(times, pp, phi) == pytest.approx(best)
    assert idle_floor([30.0, 1.0], 1, phi) == 0.0 and idle_floor([], 4, phi) == 0.0


def test_the_pipeline_floor_by_hand_on_lists_longer_than_its_window():
    """Only the 2 (pp - 1) longest ops after the k longest count, backwards (the larger share)
    on the longest of them: [10, 3, 2, 1] at PP 2 hides 10 behind 3's larger and 2's smaller
    share, never 1, and no order does better where the floor is exact."""
    assert idle_floor([10.0, 3.0, 2.0, 1.0], 2, 1 / 3) == pytest.approx(10 - 3 * 2 / 3 - 2 / 3)
    assert idle_floor([1.0, 10.0, 2.0, 3.0], 2, 0.8) == pytest.approx(10 - 0.8 * 3 - 0.2 * 2)
    assert idle_floor([12.0, 4.0, 3.0, 2.0, 1.0, 1.0], 3, 1 / 3) == pytest.approx(
        2 * 12 - 2 / 3 * (4 + 3) - 1 / 3 * (2 + 1))
    times = [10.0, 3.0, 2.0, 1.0]
    best = min(one_pipeline_1f1b([times[i] for i in order], 2, 1 / 3)
               for order in itertools.permutations(range(4)))
    assert sum(times) + idle_floor(times, 2, 1 / 3) == pytest.approx(best)
    # the forward share may be anything in [0, 1]; one stage never idles
    assert idle_floor([4.0, 1.0], 2, 0.0) == idle_floor([4.0, 1.0], 2, 1.0) == pytest.approx(3.0)
    assert idle_floor([4.0, 1.0, 0.0], 1, 0.5) == 0.0


@pytest.mark.parametrize("args, match", [
    (([1.0], 0, 0.3), r"pp \(0\) must be >= 1"),
    (([1.0], 2, -1e-9), r"forward_fraction \(-1e-09\)"),
    (([1.0], 2, 1 + 1e-9), r"forward_fraction \(1.000000001\)"),
    (([1.0], 2, 1.5), r"forward_fraction \(1.5\)"),
    (([1.0, -2.0], 2, 0.3), r"stage times must be >= 0 \(got -2.0\)"),
])
def test_the_pipeline_floor_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        idle_floor(*args)


def best_plan_alone(micro_batches, pipelines: int, pp: int, phi: float) -> float:
    """min over every assignment (ring members distinct) and order of the slowest pipeline run
    alone: what no plan of these micro-batches beats (rendezvous only add waiting)."""
    choices = [list(itertools.combinations(range(pipelines), d)) for _, d in micro_batches]
    best = np.inf
    for members in itertools.product(*choices):
        lists = [[t for (t, _), ring in zip(micro_batches, members) if p in ring] for p in range(pipelines)]
        slowest = max(min(one_pipeline_1f1b([times[i] for i in order], pp, phi)
                          for order in itertools.permutations(range(len(times))))
                      if times else 0.0 for times in lists)
        best = min(best, slowest)
    return best


def test_no_plan_beats_the_assignment_floor_and_its_two_levels_see_past_pigeonhole():
    phi = CM.forward_fraction
    rng = np.random.default_rng(1)
    for trial in range(40):
        pipelines, pp = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        mbs = [(float(rng.choice([0.5, 2.0, 6.0, 10.0])), int(rng.integers(1, pipelines + 1)))
               for _ in range(int(rng.integers(1, 5)))]
        assert assignment_floor(mbs, pipelines, pp, phi) <= best_plan_alone(mbs, pipelines, pp, phi) + 1e-9, (mbs, pp)
    # a long ring on 2 of 3 pipelines and three medium micro-batches: either a ring member takes a
    # medium one (at least 2 x 10 + 6 / 3 = 22; 24 in fact) or the third pipeline takes all three
    # (4 x 6 = 24). Plain pigeonhole (no long level) sees only the ring: 2 x 10
    mbs = [(10.0, 2), (6.0, 1), (6.0, 1), (6.0, 1)]
    assert best_plan_alone(mbs, 3, 2, phi) == pytest.approx(24.0)
    assert assignment_floor(mbs, 3, 2, phi) == pytest.approx(22.0)
    assert assignment_floor(mbs, 3, 2, phi, longest=0) == pytest.approx(20.0)
    # equal micro-batches on one pipeline each: (m / P + pp - 1) t
    assert assignment_floor([(2.0, 1)] * 6, 3, 4, phi) == pytest.approx((2 + 3) * 2.0)
    assert assignment_floor([], 3, 2, phi) == 0.0


def test_the_assignment_floor_by_hand():
    """Each level pair by hand: the long-and-medium case weighs the medium one by the smaller
    share, and a full set of long ones leaves the medium ones no pipeline of their own."""
    mbs = [(10.0, 2), (6.0, 1), (6.0, 1), (6.0, 1)]
    assert assignment_floor(mbs, 3, 2, 0.3) == pytest.approx(2 * 10 + 0.3 * 6)
    assert assignment_floor(mbs, 3, 2, 0.8) == pytest.approx(2 * 10 + 0.2 * 6)
    # two long ones on two pipelines and a short one: someone runs a long and the short one,
    # 3 x 10 + 3 / 4; no plan does better
    mbs = [(10.0, 1), (10.0, 1), (3.0, 1)]
    assert assignment_floor(mbs, 2, 3, 0.25) == pytest.approx(30.75)
    assert best_plan_alone(mbs, 2, 3, 0.25) == pytest.approx(30.75)
    assert assignment_floor(mbs, 2, 3, 0.25, longest=0) == pytest.approx(30.0)  # pigeonhole alone
    # more long slots than pipelines: two long ones share one, (pp + 1) x the shorter of them
    assert assignment_floor([(10.0, 2), (8.0, 1)], 2, 2, 0.3) == pytest.approx(3 * 8.0)
    assert assignment_floor([(5.0, 1)], 1, 1, 0.0) == assignment_floor([(5.0, 1)], 1, 1, 1.0) == 5.0
    # under a second, and a micro-batch of no time at all (allowed)
    assert assignment_floor([(0.1, 1)], 1, 2, 0.3) == pytest.approx(0.2)
    assert assignment_floor([(0.0, 1), (1.0, 1)], 2, 2, 0.3) == pytest.approx(2.0)


@pytest.mark.parametrize("args, match", [
    (([(1.0, 1)], 0, 2, 0.3), r"pipelines \(0\) and pp \(2\)"),
    (([(1.0, 1)], 2, 0, 0.3), r"pipelines \(2\) and pp \(0\)"),
    (([(1.0, 1)], 2, 2, 1 + 1e-9), r"forward_fraction \(1.000000001\)"),
    (([(1.0, 0)], 2, 2, 0.3), r"ring sizes within 1..2 \(got 1.0 s, ring sizes 0..0\)"),
    (([(1.0, 1)], 2, 2, -0.1), r"forward_fraction \(-0.1\)"),
    (([(1.0, 3)], 2, 2, 0.3), r"ring sizes within 1..2"),
    (([(-1.0, 1)], 2, 2, 0.3), r"got -1.0 s"),
])
def test_the_assignment_floor_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        assignment_floor(*args)


PP_CASES = [
    # (dataset, ranks, pp, measured step / bound when it misses)
    ("github", 1024, 2, None),
    ("github", 1024, 4, None),
    ("byted", 1024, 2, None),
    ("byted", 1024, 4, None),
    ("byted", 256, 2, None),
    ("github", 256, 4, None),
    ("github", 64, 2, None),
    ("byted", 64, 4, None),
]


def _pp_case(dataset, ranks, pp, missed):
    marks = () if missed is None else pytest.mark.xfail(
        strict=True, reason=f"PP-Balance measures {missed:.3f}x the bound (its slowest pipelines sit above the mean floor)")
    return pytest.param(dataset, ranks, pp, marks=marks, id=f"{dataset}-{ranks}-pp{pp}")


@pytest.mark.parametrize("dataset, ranks, pp", [_pp_case(*c) for c in PP_CASES])
def test_pipeline_balance_is_within_ten_percent_of_the_lower_bounds(dataset, ranks, pp):
    plan = make_plan(lengths_of(dataset, 0), scheduler="balance", hdp_size=ranks, capacity=CAPACITY,
                     cost_model=CM, context_length=CONTEXT, offload=True, pp_size=pp)
    assert plan.meta["mode"] == "PP-Balance" and plan.layers_per_stage == CM.num_layers // pp
    per_pipeline: list[list[float]] = [[] for _ in range(ranks)]
    sized = []
    for ring, lengths, ratio in micro_batches(plan).values():
        seconds = member_seconds(plan, ring, lengths, ratio)
        sized.append((seconds, len(ring)))
        for member in ring:
            per_pipeline[member].append(seconds)
    work = sum(map(sum, per_pipeline)) / ranks
    floor = sum(sum(t) + idle_floor(t, pp, CM.forward_fraction) for t in per_pipeline) / ranks
    granular = assignment_floor(sized, ranks, pp, CM.forward_fraction)
    bound = max(work, pp * critical_path(plan), floor, granular)
    step = plan.estimate.step_time_s
    assert step >= bound * (1 - 1e-9), "the bound is not a lower bound"
    assert step <= BOUND * bound, (
        f"step {step:.2f} s = {step / bound:.3f} x max(work {work:.2f} s, critical path, 1F1B floor "
        f"{floor:.2f} s, assignment floor {granular:.2f} s)")
