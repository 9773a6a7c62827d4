"""Ring attention on several gloo processes against a single-process reference.

Two spawns cover everything: 4 processes (random plans with rings of every size 1..4 on
random non-contiguous ranks, several sequences per micro-batch, uneven lengths with align 1
and > 1, GQA, both kernel backends, bf16) and 6 processes (rings of sizes 3, 5 and 6, plus
random plans). The byte, group-count and error checks run inside the 4-process spawn too
(see test_runtime_ring_checks.py).
"""

from __future__ import annotations

import random

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from runtime_cases import compare_with_reference, many_plans_body, random_plan, scheduler_plan

TOLERANCE = 1e-5


def _cases_4() -> list[dict]:
    rng = random.Random(1234)
    cases = []
    specs = [
        # (align, n_q, n_kv, head_dim, backend)
        (1, 4, 4, 16, None),
        (1, 4, 2, 16, "torch"),  # GQA
        (4, 6, 2, 8, "torch"),  # align > 1 + GQA
        (3, 2, 1, 8, "math"),  # the tiled fallback through the same ring
        (1, 8, 2, 8, None),
    ]
    for i, (align, n_q, n_kv, head_dim, backend) in enumerate(specs):
        plan = random_plan(
            rng, hdp_size=4, num_micro_batches=6, max_seqs=3, max_len=48, align=align
        )
        cases.append(
            dict(plan=plan, seed=i, n_q=n_q, n_kv=n_kv, head_dim=head_dim, backend=backend)
        )
    # every ring size in one step, in a fixed order, with a non-default softmax scale
    plan = random_plan(rng, hdp_size=4, num_micro_batches=4, ring_sizes=(4, 1, 3, 2), align=2)
    cases.append(dict(plan=plan, seed=99, n_q=4, n_kv=2, head_dim=8, scale=0.3))
    return cases


def _cases_6() -> list[dict]:
    rng = random.Random(777)
    cases = []
    plan = random_plan(rng, hdp_size=6, num_micro_batches=5, ring_sizes=(3, 5, 6, 1, 2), max_len=60)
    cases.append(dict(plan=plan, seed=5, n_q=4, n_kv=2, head_dim=8))
    plan = random_plan(rng, hdp_size=6, num_micro_batches=6, max_seqs=4, max_len=70, align=4)
    cases.append(dict(plan=plan, seed=6, n_q=2, n_kv=2, head_dim=8))
    # a sequence shorter than 2N on a 6-ring: most parts are pure padding
    plan = random_plan(rng, hdp_size=6, num_micro_batches=2, ring_sizes=(6, 5), max_len=9)
    cases.append(dict(plan=plan, seed=7, n_q=2, n_kv=1, head_dim=8))
    return cases


def _check(cases: list[dict], results: list[list]) -> list[dict[str, float]]:
    all_errors = []
    for ci, case in enumerate(cases):
        errors = compare_with_reference(
            case["plan"],
            [r[ci] for r in results],
            case["seed"],
            case["n_q"],
            case["n_kv"],
            case["head_dim"],
            case.get("scale"),
        )
        all_errors.append(errors)
        worst = max(errors.values())
        assert worst <= TOLERANCE, f"case {ci} rings {case['plan'].ring_sizes()}: errors {errors}"
    return all_errors


def test_matches_reference_on_4_ranks():
    cases = _cases_4()
    sizes = {n for case in cases for n in case["plan"].ring_sizes()}
    assert sizes == {1, 2, 3, 4}
    results = run_distributed(4, many_plans_body, cases, timeout_s=240)
    _check(cases, results)


def test_matches_reference_on_6_ranks_sizes_3_5_6():
    cases = _cases_6()
    sizes = {n for case in cases for n in case["plan"].ring_sizes()}
    assert {3, 5, 6} <= sizes
    results = run_distributed(6, many_plans_body, cases, timeout_s=240)
    _check(cases, results)


def test_matches_reference_with_scheduler_plans():
    lengths = [300, 40, 35, 30, 120, 20, 64, 9, 100, 3, 210, 17]
    cases = []
    for i, scheduler in enumerate(("naive", "balance", "static", "pow2")):
        plan = scheduler_plan(4, lengths, capacity=100, scheduler=scheduler, align=2)
        if plan is None:
            pytest.skip("megatron_bytescale.planner.schedulers.make_plan is not available")
        cases.append(dict(plan=plan, seed=40 + i, n_q=4, n_kv=2, head_dim=8))
    assert {n for case in cases for n in case["plan"].ring_sizes()} >= {1, 2, 3, 4}
    results = run_distributed(4, many_plans_body, cases, timeout_s=240)
    _check(cases, results)
