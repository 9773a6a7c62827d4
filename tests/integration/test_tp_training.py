"""Tensor parallelism under HDP on 4 CPU ranks: TP 2 x HDP 2, gradients equal TP 1.

All checks share ONE 4-process spawn (module-scoped fixture); see ``parallel_cases.py``.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .parallel_cases import tp_rank_body

TOLERANCE = 1e-5
RUNS = ["tp", "tp+sp", "tp+sp static"]


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, tp_rank_body, timeout_s=600)


def test_rank_maps_come_from_megatrons_groups(results):
    maps = [r["map"] for r in results]
    for m in maps:
        # a TP rank rings only with HDP peers of the same TP rank
        assert m["tp"] == m["tp_ranks"].index(results[maps.index(m)]["rank"])
        assert all(maps[g]["tp"] == m["tp"] for g in m["hdp_ranks"])
        # all TP ranks of a replica have the same HDP rank (the same row of the plan)
        assert all(maps[g]["hdp"] == m["hdp"] for g in m["tp_ranks"])
        assert m["pp"] == 0 and len(m["hdp_ranks"]) == 2 and len(m["tp_ranks"]) == 2


@pytest.mark.parametrize("run", RUNS)
def test_tp2_hdp2_gradients_equal_tp1(results, run):
    info = [r["runs"][run] for r in results]
    assert all(i["tp_size"] == 2 for i in info)
    assert info[0]["sequence_parallel"] == ("sp" in run)
    assert len({i["plan_hash"] for i in info}) == 1, "all TP ranks train on the same plan"
    if run == "tp+sp static":
        assert info[0]["ring_sizes"] == [2]
    else:
        assert info[0]["ring_sizes"] == [1, 2]
    # the loss of one TP rank's HDP group is the whole batch's loss
    tp0 = [r["runs"][run] for r in results if r["map"]["tp"] == 0]
    loss = sum(i["loss_sum"] for i in tp0) / tp0[0]["global_loss_tokens"]
    ref = results[0]["reference_loss"]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r in results:
        errors = r["runs"][run]["grad_errors"]
        assert len(errors) > 10
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"


def test_sequence_parallel_pads_odd_micro_batches(results):
    assert sum(r["runs"]["tp+sp"]["odd_micro_batches"] for r in results) > 0


def test_a_tp_rank_with_another_plan_is_caught_on_every_rank(results):
    for r in results:
        message = r["mismatch"]
        assert message is not None and "ranks [0, 2]" in message and "ranks [1, 3]" in message
