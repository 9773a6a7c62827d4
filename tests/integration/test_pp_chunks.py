"""Split ring micro-batches (Seq1F1B-style causal chunks) through the PP driver on 4 CPU ranks
(PP 2 x HDP 2, one spawn): gradients equal Megatron's own TP 1 / PP 1 GPT on every sequence
alone, with a ring of 2 in 2 chunks, a pipeline without chunks next to one with, and a pipeline
with none, and the plan --bytescale-seq-split makes (a ring of 2 split in 2 by the planner);
then random plans with chunks complete (a deadlock fails on the spawn's time-out).
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .chunk_pp_cases import PLANNED_RUNS, RANDOM_PLANS, RUNS, chunk_rank_body

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, chunk_rank_body, timeout_s=480)


@pytest.mark.parametrize("run", list(RUNS) + list(PLANNED_RUNS))
def test_chunked_pipelines_give_reference_gradients(results, run):
    info = [r["runs"][run] for r in results]
    chunks = info[0]["chunks"]
    if run == "ring chunks":
        assert chunks[0][:2] == chunks[1][:2] == [(0, 2), (1, 2)], "a ring of 2 in 2 chunks"
        assert (0, 3) in chunks[1]
    if run == "one pipeline without chunks":
        assert any(chunks[0]) and not any(chunks[1])
    if run == "planner seq split":
        assert chunks[0][:2] == chunks[1][:2] == [(0, 2), (1, 2)], "the planner split the ring of 2 in 2"
    if run == "idle pipeline":
        assert info[0]["counts"][1] == 0 and (2, 3) in chunks[0]
    last = [r["runs"][run] for r in results if r["stage"] == 1]
    loss = sum(i["loss_sum"] for i in last) / last[0]["global_loss_tokens"]
    ref = info[0]["reference_loss"]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r in results:
        errors = r["runs"][run]["grad_errors"]
        assert len(errors) >= 4
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"


def test_random_plans_with_chunks_complete(results):
    stress = results[0]["stress"]
    assert len(stress) == RANDOM_PLANS
    assert sum(s["chunked"] for s in stress) >= 4
    assert any(0 in s["counts"] for s in stress) or any(s["counts"][0] != s["counts"][1] for s in stress)
    for r in (r for r in results if r["stage"] == 1):
        for s in r["stress"]:
            # every token trained once: all but each sequence's last carry a loss
            assert s["global_loss_tokens"] == s["tokens"] - s["sequences"]
