"""The static baseline's first fit: the same bins as a plain scan, without its quadratic cost."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.schedulers.static import first_fit_bins
from megatron_bytescale.planner.zigzag import zigzag_chunk


def reference_first_fit(lengths, *, context, capacity, cp, align):
    """First fit as written in the paper's baseline: scan every bin from the first."""
    bins, tokens, slots = [], [], []
    for pos, n in enumerate(lengths):
        need = n if cp == 1 else 2 * zigzag_chunk(n, cp, align)
        for b in range(len(bins)):
            if tokens[b] + n <= context and slots[b] + need <= capacity:
                bins[b].append(pos)
                tokens[b] += n
                slots[b] += need
                break
        else:
            bins.append([pos])
            tokens.append(n)
            slots.append(need)
    return bins


@pytest.mark.parametrize("seed", range(12))
def test_first_fit_matches_the_plain_scan(seed):
    rng = np.random.default_rng(seed)
    cp = int(rng.choice([1, 2, 3, 4, 8]))
    capacity = int(rng.choice([64, 100, 256]))
    align = int(rng.choice([1, 2, 4, 8])) if cp > 1 else 1
    context = capacity * cp - int(rng.integers(0, capacity // 2)) * (cp > 1)
    n = int(rng.integers(50, 400))
    # a mix of tiny documents (the slot limit binds: padding) and long ones (tokens bind)
    lengths = np.where(rng.random(n) < 0.6, rng.integers(1, 12, n), rng.integers(1, context + 1, n))
    lengths = [int(x) for x in lengths]
    if cp > 1:  # keep documents whose own zigzag share fits C, as the planner does
        lengths = [x for x in lengths if 2 * zigzag_chunk(x, cp, align) <= capacity]
    got = first_fit_bins(lengths, context=context, capacity=capacity, cp=cp, align=align)
    want = reference_first_fit(lengths, context=context, capacity=capacity, cp=cp, align=align)
    assert got == want
    assert sorted(p for b in got for p in b) == list(range(len(lengths)))


def test_many_documents_that_each_fill_the_context_complete():
    """100k documents of exactly the context length: one bin each. A bin that is full when
    opened used to stay in the scanned list, making this quadratic (hours)."""
    lengths = [4096] * 100_000
    bins = first_fit_bins(lengths, context=4096, capacity=4096, cp=1)
    assert len(bins) == 100_000 and bins[-1] == [99_999]
    mixed = [4096, 1, 4095] * 30_000  # full, then two that share a bin
    bins = first_fit_bins(mixed, context=4096, capacity=4096, cp=1)
    assert len(bins) == 60_000 and bins[1] == [1, 2]


def test_static_plan_uses_those_bins():
    lengths = [3000, 500, 4096, 600, 100, 2000, 4096, 7]
    cm = preset_cost_model("llama-7b")
    plan = make_plan(lengths, scheduler="static", hdp_size=4, capacity=4096, cost_model=cm,
                     context_length=4096)
    want = reference_first_fit(lengths, context=4096, capacity=4096, cp=1, align=1)
    assert plan.meta["num_bins"] == len(want)
    got = sorted(sorted(mb.seqs) for r in plan.ranks for mb in r.micro_batches)
    assert got == sorted(sorted(b) for b in want)


def test_a_static_plan_of_100k_documents_is_bounded_work():
    """``plan --scheduler static`` / ``simulate --contexts 1`` on 100k documents that each fill
    the context: planning and estimating is linear work (one bin, one micro-batch per document;
    about 4 s of CPU on a loaded 2-core machine). The bound is this thread's CPU time, so other
    processes on the machine do not count; a first fit that scans the earlier bins does
    5 * 10**9 comparisons here (hours), far past it."""
    import time

    from megatron_bytescale.planner.estimate import estimate_plan

    cm = preset_cost_model("llama-7b")
    start = time.thread_time()
    plan = make_plan([1] * 100_000, scheduler="static", hdp_size=1024, capacity=8192, cost_model=cm,
                     context_length=1)
    estimate = estimate_plan(plan, cm)
    spent = time.thread_time() - start
    assert plan.meta["num_bins"] == 100_000 and estimate.step_time_s > 0
    assert sorted(mb.seqs[0] for r in plan.ranks for mb in r.micro_batches) == list(range(100_000))
    assert spent < 120, f"{spent:.0f} s of CPU for 100k documents"


def test_first_fit_pads_documents_to_no_alignment_unless_asked():
    """``align`` defaults to 1 (no padding beyond the zigzag split); the bench and the scan
    both call it so."""
    lengths = [3, 5, 2, 7, 1, 6, 4, 4, 9, 2]
    got = first_fit_bins(lengths, context=20, capacity=12, cp=2)
    assert got == reference_first_fit(lengths, context=20, capacity=12, cp=2, align=1)
    assert got != first_fit_bins(lengths, context=20, capacity=12, cp=2, align=2)
