"""Each scheduler's own behaviour, overlong handling and every bad input of make_plan."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.order import check_deadlock_free
from megatron_bytescale.planner.schedulers import SCHEDULERS, make_plan, static_cp_size
from megatron_bytescale.planner.schedulers._common import FastPlanBuilder
from megatron_bytescale.planner.plan import PlanBuilder
from megatron_bytescale.planner.zigzag import zigzag_chunk
from planner_cases import SCHEDULER_NAMES, small_cost_model

CM = small_cost_model()


def plan(lengths, scheduler, **kw):
    kw.setdefault("hdp_size", 8)
    kw.setdefault("capacity", 100)
    kw.setdefault("cost_model", CM)
    p = make_plan(lengths, scheduler=scheduler, **kw)
    p.validate()
    check_deadlock_free(p)
    return p


def rings(p):
    """{order: ring} of a plan."""
    return {mb.order: mb.ring for r in p.ranks for mb in r.micro_batches}


def test_registry():
    assert set(SCHEDULERS) == set(SCHEDULER_NAMES)


def test_fast_builder_matches_plan_builder():
    rng = np.random.default_rng(0)
    lengths = {i: int(rng.integers(1, 300)) for i in range(40)}
    a = FastPlanBuilder(hdp_size=16, capacity=10**6, lengths=lengths, align=4)
    b = PlanBuilder(hdp_size=16, capacity=10**6, lengths=lengths, align=4)
    for k in range(12):
        ring = rng.choice(16, size=int(rng.integers(1, 17)), replace=False).tolist()
        seqs = list(range(3 * k, 3 * k + 3))
        assert a.add(ring, seqs, 0.25) == b.add(ring, seqs, 0.25)
    assert a.build(scheduler="x").content_hash() == b.build(scheduler="x").content_hash()
    assert a.build(scheduler="x").ranks == b.build(scheduler="x").ranks  # equal objects, not only JSON


# --------------------------------------------------------------------------- naive
def test_naive_fills_steps():
    # 250 tokens need 3 ranks; 4 packs of short sequences; 4 ranks
    p = plan([250, 60, 60, 50, 50, 40, 30], "naive", hdp_size=4, offload=False)
    r = rings(p)
    assert r[0] == (0, 1, 2)  # the long sequence takes the lowest free ranks
    assert r[1] == (3,)       # the rest of the step is filled with a pack
    assert p.meta["steps"] == 2
    assert p.estimate.extra["num_rings"] == 1


def test_naive_and_balance_offload_long_sequences():
    cm = small_cost_model(num_layers=32, alpha1=1e-6)  # attention-heavy: offload is free
    for name in ("naive", "balance"):
        p = plan([3000], name, hdp_size=64, capacity=100, cost_model=cm)
        mb = p.ranks[0].micro_batches[0]
        if name == "naive":  # Eq. 3: 2 * 3000 / (32 * 100) -> 2 ranks instead of 30
            assert mb.ring_size == 2 and mb.offload_ratio > 0
        assert p.meta["offload"] is True
    p = plan([3000], "naive", hdp_size=64, capacity=100, cost_model=cm, offload=False)
    assert p.ranks[0].micro_batches[0].ring_size == 30


# --------------------------------------------------------------------------- balance
def test_balance_widens_a_dominating_sequence_and_varies_micro_batch_counts():
    lengths = [1500] + [90] * 40
    cm = small_cost_model(p2p_bandwidth_inter=1e10)  # fast links: the ring is compute-bound
    naive = plan(lengths, "naive", hdp_size=64, offload=False, cost_model=cm)
    bal = plan(lengths, "balance", hdp_size=64, offload=False, cost_model=cm)
    assert bal.meta["mode"] == "DP-Balance" and bal.meta["widened_units"] >= 1
    widest = max(len(r) for r in rings(bal).values())
    assert widest > max(len(r) for r in rings(naive).values())
    counts = bal.micro_batch_counts()
    assert max(counts) > min(counts)
    assert bal.estimate.step_time_s < naive.estimate.step_time_s


def test_balance_backfills_ranks_that_wait_for_a_ring():
    # 3 ranks, two long sequences on rings of 2, short packs. The second ring has to wait for
    # a member of the first; its other member would idle until then. Balance runs a local pack
    # in that gap (before the ring, in time and in order) instead of after everything.
    cm = small_cost_model(ring_step_overhead_s=0.0)
    lengths = [190, 180] + [90] * 6
    plan = make_plan(lengths, scheduler="balance", hdp_size=3, capacity=100, cost_model=cm, offload=False)
    plan.validate()
    check_deadlock_free(plan)
    first_ring_rank = [r.rank for r in plan.ranks if r.micro_batches[0].ring_size == 2]
    backfilled = [
        r.rank for r in plan.ranks
        if r.micro_batches[0].ring_size == 1 and any(mb.ring_size == 2 for mb in r.micro_batches[1:])
    ]
    assert first_ring_rank and backfilled, [[mb.ring for mb in r.micro_batches] for r in plan.ranks]
    naive = make_plan(lengths, scheduler="naive", hdp_size=3, capacity=100, cost_model=cm, offload=False)
    assert plan.estimate.step_time_s <= naive.estimate.step_time_s * (1 + 1e-9)
    # and the step is close to level: every rank ends near the mean
    lower = sum(plan.estimate.rank_time_s) / 3
    assert plan.estimate.step_time_s <= 1.2 * lower


def test_pp_balance_keeps_rings_at_one_local_index():
    lengths = [700, 500, 450, 300, 260, 120] + [80, 60, 40, 30, 20, 10] * 5
    p = plan(lengths, "balance", hdp_size=12, pp_size=4)
    assert p.meta["mode"] == "PP-Balance"
    for order, ring in rings(p).items():
        idx = {[mb.order for mb in p.ranks[m].micro_batches].index(order) for m in ring}
        assert len(idx) == 1


# --------------------------------------------------------------------------- static
def test_static_cp_size():
    assert static_cp_size(12, 250, 100) == 3
    assert static_cp_size(16, 250, 100) == 4  # 3 does not divide 16
    assert static_cp_size(8, 100, 100) == 1
    # 24573 tokens on 3 ranks of 8191 needs parts of 4096: 8192 > 8191, so CP grows
    assert static_cp_size(12, 24573, 8191) == 4
    with pytest.raises(ValueError, match="no context-parallel size fits.*hdp_size 4"):
        static_cp_size(4, 500, 100)


def test_static_bins_round_robin_over_dp_groups():
    lengths = [250, 100, 120, 90, 80, 30, 200, 10]
    p = plan(lengths, "static", hdp_size=6, capacity=100)
    assert (p.meta["cp_size"], p.meta["dp_size"], p.meta["context_length"]) == (3, 2, 250)
    r = rings(p)
    groups = [r[o] for o in sorted(r)]
    assert groups[0] == (0, 1, 2) and groups[1] == (3, 4, 5) and groups[2] == (0, 1, 2)
    assert p.meta["offload"] is False
    for mb in (mb for rp in p.ranks for mb in rp.micro_batches):
        ls = [p.sequence_lengths()[s] for s in mb.seqs]
        assert sum(ls) <= 250
        assert sum(2 * zigzag_chunk(n, 3) for n in ls) <= 100  # padded per-rank slots


def test_static_closes_bins_on_padded_slots():
    # 60 one-token documents, CP 4: each takes 2 padded slots per rank, so 50 fit in C = 100
    p = plan([400] + [1] * 60, "static", hdp_size=4, capacity=100)
    assert p.meta["cp_size"] == 4
    assert p.meta["num_bins"] >= 3


# --------------------------------------------------------------------------- pow2
def test_pow2_rings_are_aligned_power_of_two_blocks_with_barriers():
    lengths = [700, 300, 250, 120, 90, 80, 50, 40, 30, 20] * 2
    p = plan(lengths, "pow2", hdp_size=12, capacity=100)
    for ring in rings(p).values():
        d = len(ring)
        assert d & (d - 1) == 0
        assert ring == tuple(range(ring[0], ring[0] + d)) and ring[0] % d == 0
    bars = p.meta["barrier_after_orders"]
    assert len(bars) == p.meta["num_groups"] - 1
    assert p.estimate.extra["num_barriers"] == len(bars)
    # 700 tokens need ceil(700/100) = 7 -> 8 ranks
    seq0 = next(mb for rp in p.ranks for mb in rp.micro_batches if 0 in mb.seqs)
    assert seq0.ring_size >= 8


def test_pow2_refuses_pipeline_parallelism():
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        plan([10], "pow2", pp_size=2)


# --------------------------------------------------------------------------- overlong
def test_overlong_error_drop_truncate():
    # 8 ranks x 100 tokens, no offload: at most 800 tokens per sequence
    with pytest.raises(ValueError, match=r"sequence 1 has 900 tokens but at most 800 fit.*overlong"):
        plan([50, 900, 20], "naive", offload=False)
    p = plan([50, 900, 20], "balance", offload=False, overlong="drop")
    assert p.meta["dropped"] == [1] and p.meta["dropped_tokens"] == 900
    assert sorted(s.id for s in p.sequences) == [0, 2]
    p = plan([50, 900, 20], "balance", offload=False, overlong="truncate")
    assert p.meta["truncated"] == [{"id": 1, "from": 900, "to": 800}]
    assert p.sequence_lengths()[1] == 800
    # with offload the same sequence fits whole: 900 tokens need 9 ranks of C = 100 without it
    # (at most 8 here), so its ring offloads; Eq. 3 with l = 8 keeps 2 + (1 - r) * 6 of 8
    # layers resident, which must hold the fullest member's zigzag share
    p = plan([50, 900, 20], "balance", cost_model=small_cost_model(alpha1=1e-5))
    assert p.sequence_lengths() == {0: 50, 1: 900, 2: 20} and "truncated" not in p.meta
    assert p.layers_per_stage == 8
    mb = next(m for rp in p.ranks for m in rp.micro_batches if 1 in m.seqs)
    assert mb.seqs == (1,) and 2 <= mb.ring_size <= 8 and 0 < mb.offload_ratio <= 1
    d = mb.ring_size
    chunk = -(-900 // (2 * d))  # align 1
    fullest = max(min(chunk, max(0, 900 - k * chunk)) + min(chunk, max(0, 900 - (2 * d - 1 - k) * chunk))
                  for k in range(d))
    assert fullest > 100  # it would not fit without offload...
    assert fullest * (2 + (1 - mb.offload_ratio) * 6) / 8 <= 100 + 1e-9  # ...and fits with it


def test_context_length_caps_every_scheduler():
    for name in SCHEDULER_NAMES:
        p = plan([50, 300, 20], name, context_length=200, overlong="truncate")
        assert p.sequence_lengths()[1] == 200
        assert p.meta["context_length"] == 200


def test_empty_batch_is_an_empty_plan():
    for name in SCHEDULER_NAMES:
        p = plan([], name)
        assert p.sequences == () and all(not r.micro_batches for r in p.ranks)
        assert p.estimate.step_time_s == 0.0


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("lengths, match", [
    ([5, 0, 3], r"index 1 is 0; every length must be >= 1"),
    ([5, -2], r"index 1 is -2"),
    ([5, 3.5], r"index 1 \(3.5\) is not an integer"),
    ([5, "7"], r"index 1 \('7'\) is not an integer"),
    ([True], r"index 0 \(True\) is not an integer"),
    (np.array([1.0, 2.5]), r"must be integers, got dtype float64 \(index 1: 2.5\)"),
])
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        make_plan(lengths, scheduler="balance", hdp_size=4, capacity=100, cost_model=CM)


@pytest.mark.parametrize("kw, match", [
    (dict(hdp_size=0), r"hdp_size \(0\) must be an integer >= 1"),
    (dict(capacity=0), r"capacity \(0\) must be an integer >= 1"),
    (dict(capacity=-5), r"capacity \(-5\)"),
    (dict(pp_size=0), r"pp_size \(0\) must be an integer >= 1"),
    (dict(pp_size=3), r"pp_size \(3\) must divide the model's 8 layers"),
    (dict(scheduler="magic"), r"unknown scheduler 'magic'; choose one of \['balance', 'naive', 'pow2', 'static'\]"),
    (dict(overlong="ignore"), r"overlong \('ignore'\) must be one of"),
    (dict(align=0), r"align \(0\) must be an integer >= 1"),
    (dict(delta=1.5), r"delta \(1.5\)"),
    (dict(num_buckets=0), r"num_buckets \(0\)"),
    (dict(context_length=0), r"context_length \(0\)"),
    (dict(cost_model="llama"), r"cost_model must be a CostModel"),
])
def test_bad_arguments(kw, match):
    args = dict(scheduler="balance", hdp_size=4, capacity=100, cost_model=CM)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        make_plan([10, 20], **args)


def test_static_without_valid_cp_is_a_clear_error():
    with pytest.raises(ValueError, match="static: no context-parallel size fits"):
        make_plan([50, 700], scheduler="static", hdp_size=5, capacity=100, cost_model=CM)
