"""Pipeline parallelism under HDP on 4 CPU ranks: PP 2 x HDP 2 through the 1F1B driver.

All checks share ONE 4-process spawn (module-scoped fixture); see ``parallel_cases.py``. A
deadlock anywhere (a random plan included) leaves ranks blocked in gloo; the spawn's time-out
(and gloo's own, the same number of seconds) then fails every test here naming the ranks that
did not finish.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .parallel_cases import STRESS_PLANS, pp_rank_body

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, pp_rank_body, timeout_s=480)


def _last_stage(results):
    return [r for r in results if r["map"]["pp"] == 1]


def test_rank_maps_come_from_megatrons_groups(results):
    maps = [r["map"] for r in results]
    for r in results:
        m = r["map"]
        assert m["pp"] == m["pp_ranks"].index(r["rank"]) and m["tp"] == 0
        # every stage of a pipeline has the same HDP rank (runs the same row of the plan) ...
        assert all(maps[g]["hdp"] == m["hdp"] for g in m["pp_ranks"])
        # ... and an HDP group (the ring peers) is one stage of every pipeline
        assert all(maps[g]["pp"] == m["pp"] for g in m["hdp_ranks"])
        assert len(m["hdp_ranks"]) == 2


@pytest.mark.parametrize("run", ["balance", "balance offload", "idle pipeline",
                                 "balance overlap", "idle pipeline overlap"])
def test_pp2_hdp2_gradients_equal_pp1(results, run):
    info = [r["runs"][run] for r in results]
    assert all(i["pp_size"] == 2 for i in info)
    counts = info[0]["micro_batch_counts"]
    if run == "balance offload":
        assert all(i["offloaded_bytes"] > 0 for i in info), "every stage offloads"
    if run.startswith("balance"):
        assert info[0]["ring_sizes"] == [1, 2], "rings span both pipelines"
        assert counts[0] != counts[1], "pipelines run different numbers of micro-batches"
        ref = results[0]["reference_loss"]
    else:
        assert counts == [5, 0]
        ref = results[0]["idle_reference_loss"]
    # the loss lives on the last stage of each pipeline
    last = [r["runs"][run] for r in _last_stage(results)]
    loss = sum(i["loss_sum"] for i in last) / last[0]["global_loss_tokens"]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r in results:
        errors = r["runs"][run]["grad_errors"]
        assert len(errors) >= 4
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"


def test_overlapped_reduction_issues_every_bucket_group_on_every_stage(results):
    """--overlap-grad-reduce with PP: each stage's bucket groups are all issued, in one order,
    by both pipelines, also by the one that ran no micro-batch (its gradients are checked
    against the reference above). Megatron's DDP buckets the first stage only (later stages'
    reductions are off the critical path): one bucket group there."""
    for r in results:
        for run in ("balance overlap", "idle pipeline overlap"):
            sync = r["runs"][run]["grad_sync"]
            assert sync["bucket_groups"] >= (2 if r["map"]["pp"] == 0 else 1), (r["rank"], sync)
            assert sync["issued"] == sync["bucket_groups"], (r["rank"], run, sync)
        assert r["runs"]["balance"]["grad_sync"] == {}  # without overlap nothing is installed


def test_tied_embedding_and_lm_head_are_reduced_across_stages(results):
    first = [r for r in results if r["map"]["pp"] == 0]
    assert all("embedding.word_embeddings.weight" in r["runs"]["balance"]["grad_errors"]
               for r in first)
    # the last stage's LM head is compared with the reference's (tied) word-embedding gradient
    assert all("output_layer.weight" in r["runs"]["balance"]["grad_errors"]
               for r in _last_stage(results))


def test_a_plan_for_another_pipeline_depth_is_refused(results):
    for r in results:
        message = r["pp_mismatch"]
        assert message is not None
        assert "made for 1 pipeline stage(s)" in message
        assert "--pipeline-model-parallel-size 2" in message


def test_random_pipeline_plans_complete_without_deadlock(results):
    stress = results[0]["stress"]
    assert len(stress) == STRESS_PLANS
    assert all([s["counts"] for s in r["stress"]] == [s["counts"] for s in stress]
               for r in results)
    counts = [s["counts"] for s in stress]
    assert any(c[0] != c[1] for c in counts), "pipelines ran different counts"
    assert any(0 in c for c in counts), "some pipeline ran no micro-batch in some step"
    assert sum(s["rings"] for s in stress) >= 10, "rings spanned the pipelines"
    assert {s["scheduler"] for s in stress} == {"balance", "manual"}
    # every step trained every token once, on every stage (run_hdp_step checks the count)
    for r in _last_stage(results):
        assert all(s["loss_sum"] > 0 for s in r["stress"] if s["counts"][r["map"]["hdp"]])


def test_tp2_pp2_with_sequence_parallelism_equals_tp1_pp1(results):
    info = [r["tp_pp"] for r in results]
    assert len(info[0]["micro_batch_counts"]) == 1  # HDP 1: one pipeline runs every sequence
    last = [i for i in info if i["stage"] == 1]
    loss = last[0]["loss_sum"] / last[0]["global_loss_tokens"]
    ref = results[0]["reference_loss"]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r, i in zip(results, info):
        worst = max(i["grad_errors"], key=i["grad_errors"].get)
        assert i["grad_errors"][worst] <= TOLERANCE, f"rank {r['rank']}: {worst}"


def _number(phase: str, i: int, stage: int, pp: int) -> int:
    """The number the driver's deadlock argument gives an op (pipeline_schedule docstring)."""
    return 2 * i + stage if phase == "F" else 2 * i + 2 * pp - 1 - stage


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_wait_of_the_1f1b_order_points_to_a_smaller_number(pp):
    """Ring ops of member pipelines share (phase, index, stage), so share a number; if every
    dependency rises in number, ops can run in order of their numbers: no cycle, no deadlock.
    """
    from megatron_bytescale.planner.order import pipeline_ops

    for m in range(0, 3 * pp):
        ops = {s: pipeline_ops(m, pp, s) for s in range(pp)}
        for s, seq in ops.items():
            numbers = [_number(p, i, s, pp) for p, i in seq]
            assert numbers == sorted(set(numbers)), (m, s, seq)  # rises along the stage
            for k, (phase, i) in enumerate(seq):
                after = _number(*seq[k + 1], s, pp) if k + 1 < len(seq) else None
                peer = s + 1 if phase == "F" else s - 1
                if not 0 <= peer < pp:
                    continue
                # the peer receives this op's output right before its own op of the same
                # micro-batch: a blocking send waits for the op before that, which must be
                # numbered below the op this stage runs next
                theirs = ops[peer].index((phase, i))
                before = _number(*ops[peer][theirs - 1], peer, pp) if theirs else -1
                assert after is None or before < after, (m, s, phase, i)
                assert _number(phase, i, peer, pp) > _number(phase, i, s, pp)
