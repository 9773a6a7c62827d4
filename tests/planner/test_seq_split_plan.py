"""make_plan(seq_split=True): PP-Balance's plan with its long rings split along the pipeline
where the estimate says it pays and the kept prefix fits the capacity."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.chunk_estimate import split_where_faster
from megatron_bytescale.planner.chunk_memory import check_split_memory, split_fits, split_resident_tokens
from megatron_bytescale.planner.estimate import estimate_plan
from megatron_bytescale.planner.plan import PlanBuilder
from megatron_bytescale.planner.schedulers import make_plan

from planner_cases import small_cost_model


def _groups(plan):
    """{first order: (ring, chunks, sequences)} of every split group."""
    out = {}
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            if mb.chunk is not None:
                ring, k, seqs = out.setdefault(mb.order - mb.chunk[0], (mb.ring, mb.chunk[1], set()))
                seqs.update(mb.seqs)
    return out


def _batch(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    short = rng.integers(10, 300, int(rng.integers(10, 40)))
    long = rng.integers(600, 3000, int(rng.integers(1, 4)))
    return np.concatenate([short, long]).tolist()


def test_seq_split_plans_validate_are_never_slower_and_every_split_fits():
    cm = small_cost_model(num_layers=16)
    split_plans = 0
    for seed in range(8):
        lengths = _batch(seed)
        for pp, capacity, offload in ((4, 512, seed % 2 == 1), (4, 1024, False), (2, 512, True)):
            kw = dict(scheduler="balance", hdp_size=8, capacity=capacity, cost_model=cm, pp_size=pp, offload=offload)
            base = make_plan(lengths, **kw)
            out = make_plan(lengths, **kw, seq_split=True).validate()
            where = f"seed {seed} pp {pp} capacity {capacity} offload {offload}"
            assert out.estimate.step_time_s <= base.estimate.step_time_s, where
            assert out.estimate.step_time_s == pytest.approx(estimate_plan(out, cm).step_time_s, rel=1e-12)
            assert sorted(s.length for s in out.sequences) == sorted(lengths)
            groups = _groups(out)
            assert bool(groups) == (out.estimate.step_time_s < base.estimate.step_time_s), where
            check_split_memory(out, cm)
            for ring, k, seqs in groups.values():  # recomputed here from the lengths, not the module's loop
                need = split_resident_tokens([out.sequence_lengths()[s] for s in seqs], len(ring), k,
                                             align=out.align, cost_model=cm)
                assert need <= capacity, where
                # chunks never offload, and every token of a split sequence is in exactly one chunk
                for rp in out.ranks:
                    for mb in rp.micro_batches:
                        if mb.chunk is not None and mb.ring == ring:
                            assert mb.offload_ratio == 0.0
            split_plans += bool(groups)
    assert split_plans >= 8  # the property is exercised on plans that do split


def test_the_kept_prefix_is_counted_by_hand():
    cm = small_cost_model(num_layers=16)  # alpha2 1000 B, K+V 64 B per token per layer
    assert (cm.alpha2, cm.kv_bytes_per_token) == (1000.0, 64.0)
    # 1600 tokens over 2 members in 2 chunks: each chunk zigzags 800 tokens, 400 per member.
    # Own share 400; kept: both members' chunk-0 blocks, 800 tokens x 3 x 64 / 1000 = 153.6
    assert split_resident_tokens([1600], 2, 2, align=1, cost_model=cm) == pytest.approx(553.6)
    # align 16 pads each of the 2 zigzag parts of 200 to 208: share 416, kept 832 x 0.192
    assert split_resident_tokens([1600], 2, 2, align=16, cost_model=cm) == pytest.approx(416 + 832 * 0.192)
    # 4 chunks: share 200 each, kept chunks 0..2 of both members = 1200 tokens
    assert split_resident_tokens([1600], 2, 4, align=1, cost_model=cm) == pytest.approx(200 + 1200 * 0.192)
    for capacity, fits in ((553, False), (554, True)):
        b = PlanBuilder(hdp_size=2, capacity=capacity, lengths={0: 1600, 1: 100})
        b.add((0, 1), (0,))
        b.add((0,), (1,))
        plan = b.build(scheduler="manual", pp_size=4, layers_per_stage=4)
        assert split_fits(plan, 0, 2, cm) is fits
        assert split_fits(plan, 0, 4, cm) is True  # 430.4
        assert split_fits(plan, 0, 8, cm) is True


def test_a_split_that_would_pay_is_refused_when_its_prefix_does_not_fit():
    cm = small_cost_model(num_layers=16)
    lengths = {0: 4000, 1: 100, 2: 120}
    plans = {}
    for capacity in (2000, 8192):
        b = PlanBuilder(hdp_size=2, capacity=capacity, lengths=lengths)
        b.add((0, 1), (0,))
        b.add((0,), (1,))
        b.add((1,), (2,))
        plans[capacity] = b.build(scheduler="manual", pp_size=4, layers_per_stage=4).validate()
    roomy = split_where_faster(plans[8192], cm)
    assert {k for _, k, _ in _groups(roomy).values()} == {8}
    # at capacity 2000 (the ring's own 2000 tokens per member, nothing spare) 8 chunks keep
    # 250 + 3500 x 0.192 = 922 and fit; 2 keep 1000 + 2000 x 0.192 = 1384 and fit too: all fit
    tight = split_where_faster(plans[2000], cm)
    assert _groups(tight)
    check_split_memory(tight, cm)
    # a cost model whose K/V is as big as its activations: 8 chunks keep 250 + 3 x 3500 > 2000
    fat = cm.with_(kv_bytes_per_token=1000.0)
    assert not split_fits(plans[2000], 0, 8, fat)
    assert not any(split_fits(plans[2000], 0, k, fat) for k in (2, 4, 8))  # 2 chunks: 1000 + 3 x 2000
    assert split_where_faster(plans[2000], fat) is plans[2000]
    assert _groups(split_where_faster(plans[2000], fat, fit_memory=False))  # it would pay if memory were free
    assert _groups(split_where_faster(plans[8192], fat))  # 2 chunks keep 7000 <= 8192: still split
    with pytest.raises(ValueError, match="over capacity 2000"):
        check_split_memory(roomy.__class__(**{**{f: getattr(roomy, f) for f in roomy.__dataclass_fields__},
                                              "capacity": 2000}), fat)


def test_timing_only_plans_split_too():
    cm = small_cost_model(num_layers=16)
    lengths = _batch(3)
    kw = dict(scheduler="balance", hdp_size=8, capacity=512, cost_model=cm, pp_size=4, offload=False)
    out = make_plan(lengths, **kw, seq_split=True, pieces=False)
    full = make_plan(lengths, **kw, seq_split=True)
    assert _groups(out).keys() == _groups(full).keys()
    assert out.estimate.step_time_s == pytest.approx(full.estimate.step_time_s, rel=1e-9)
    assert out.meta["seq_split"] is True


@pytest.mark.parametrize("kw, needle", [
    (dict(scheduler="naive", pp_size=4), "scheduler 'naive' (use balance)"),
    (dict(scheduler="balance", pp_size=1), "pipeline size 1"),
    (dict(scheduler="balance", pp_size=4, ep_size=2), "expert groups of 2 HDP ranks"),
])
def test_seq_split_is_refused_in_one_line_where_it_cannot_apply(kw, needle):
    cm = small_cost_model(num_layers=16)
    with pytest.raises(ValueError, match="seq_split cannot apply with") as exc:
        make_plan([100] * 16, hdp_size=8, capacity=512, cost_model=cm, seq_split=True, **kw)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
