"""HDP training inside megatron-core on 4 CPU ranks (gloo): gradients, training, scheduling.

All checks share ONE 4-process spawn (module-scoped fixture); see ``hdp_cases.py``.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .hdp_cases import CONTEXT, GRAD_LENGTHS, RESUME_AT, SLEEP_S, TRAIN_STEPS, hdp_rank_body

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, hdp_rank_body, timeout_s=600)


def test_megatron_sees_cp1_and_the_hdp_group_is_dp(results):
    assert all(r["hdp_size"] == 4 and r["megatron_cp"] == 1 for r in results)


def test_entry_point_refuses_cp_hybrid_and_virtual_pp(results):
    refusals = results[0]["refusals"]
    assert "--context-parallel-size 2" in refusals["cp"]
    assert "--hybrid-context-parallel" in refusals["hybrid"]
    assert "interleaved pipeline stages" in refusals["vpp"]


@pytest.mark.parametrize("scheduler", ["balance", "naive", "static", "balance-two-level"])
def test_one_step_matches_single_process_reference(results, scheduler):
    ref_loss = results[0]["reference"]
    info = [r["grad"][scheduler] for r in results]
    if scheduler == "static":
        assert info[0]["ring_sizes"] == [4]
    elif scheduler == "balance-two-level":  # 2 nodes of 2: the long sequence on a two-level ring
        assert 4 in info[0]["ring_sizes"] and all(i["two_level_rings"] >= 1 for i in info)
        assert all(i["bytes_by_level"][0] > 0 and i["bytes_by_level"][1] > 0 for i in info)
    else:
        assert {1, 2, 3} <= set(info[0]["ring_sizes"])
    if scheduler == "balance":
        assert len(set(info[0]["micro_batch_counts"])) > 1, "ranks should run different counts"
    loss = sum(i["loss_sum"] for i in info) / info[0]["global_loss_tokens"]
    assert abs(loss - ref_loss) / abs(ref_loss) <= TOLERANCE
    assert info[0]["grad_names_match"]
    worst = max(info[0]["grad_errors"].values())
    assert worst <= TOLERANCE, f"{scheduler}: max relative gradient error {worst:.2e}"


@pytest.mark.parametrize("scheduler", ["balance", "static"])
def test_step_record_carries_the_step_hdp_metrics(results, scheduler):
    """The same metrics on every rank: the plan's rings and counts, the measured extremes."""
    info = [r["grad"][scheduler] for r in results]
    metrics = [i["hdp"] for i in info]
    assert all(m == metrics[0] for m in metrics)
    m, counts = metrics[0], info[0]["micro_batch_counts"]
    sizes = {size for size, _ in m["rings_by_size"]}
    assert sizes == set(info[0]["ring_sizes"])
    assert m["rings"] == sum(n for size, n in m["rings_by_size"] if size > 1) > 0
    assert m["largest_ring"] == max(sizes)
    assert (m["micro_batches_min"], m["micro_batches_max"]) == (min(counts), max(counts))
    assert m["micro_batches_mean"] == pytest.approx(sum(counts) / len(counts))
    busy = [i["busy_s"] for i in info]
    assert m["busy_max_s"] == pytest.approx(max(busy), rel=1e-6)
    assert m["busy_min_s"] == pytest.approx(min(busy), rel=1e-6)
    assert m["idle_fraction"] == pytest.approx(1 - sum(busy) / len(busy) / max(busy), abs=1e-6)
    assert m["p2p_mb"] == pytest.approx(sum(i["p2p_bytes"] for i in info) / 1e6, rel=1e-6)
    assert m["plan_wait_ms"] == pytest.approx(1e3 * max(i["plan_wait_s"] for i in info),
                                              rel=1e-6, abs=1e-6)
    assert m["estimated_balance"] >= 1.0 and m["offloaded_micro_batches"] == 0


def test_loss_is_scaled_by_the_optimizer(results):
    """fp16 optimizers divide the gradients by their loss scale, so the backward must scale."""
    assert all(r["grad_scale_func"] for r in results)


def test_hdp_sends_less_than_static(results):
    sent = {s: sum(r["grad"][s]["p2p_bytes"] for r in results) for s in ("balance", "static")}
    assert 0 < sent["balance"] < sent["static"]


def _curve(results, scheduler):
    sums = [sum(r["train"][scheduler]["loss_sums"][i] for r in results) for i in range(TRAIN_STEPS)]
    tokens = results[0]["train"][scheduler]["loss_tokens"]
    return [s / n for s, n in zip(sums, tokens)]


def test_training_loss_falls_and_matches_static(results):
    hdp, static = _curve(results, "balance"), _curve(results, "static")
    assert len(hdp) == TRAIN_STEPS
    assert sum(hdp[-5:]) / 5 < sum(hdp[:5]) / 5 - 0.3
    assert max(abs(a - b) for a, b in zip(hdp, static)) <= 1e-4
    counts = [r["train"]["balance"]["micro_batch_counts"] for r in results]
    assert any(len({c[i] for c in counts}) > 1 for i in range(TRAIN_STEPS))


def test_own_loop_resume_trains_steps_6_to_10_as_the_uninterrupted_run(results):
    """Train 5 steps, save model + optimizer + ``iterator.state_dict()``, resume in a fresh
    model and iterator: steps 6-10 have the uninterrupted run's plans, tokens and losses."""
    for r in results:
        resume, train = r["resume"], r["train"]["balance"]
        assert resume["state"] == {"version": 1, "next_step": RESUME_AT}
        steps = resume["steps"]
        assert [s["index"] for s in steps] == list(range(RESUME_AT, RESUME_AT + 5))
        assert [s["plan_hash"] for s in steps] == train["plan_hashes"][RESUME_AT:RESUME_AT + 5]
        assert [s["tokens"] for s in steps] == r["resumed_reference_tokens"]
        for s, expected in zip(steps, train["loss_sums"][RESUME_AT:]):
            assert abs(s["loss_sum"] - expected) <= 1e-5 * max(1.0, abs(expected))
    # most steps are different plans (the stdlib text that feeds them differs between Python
    # versions: all 20 differ on 3.11, 17 on 3.12); the tokens above tell the steps apart
    assert len(set(results[0]["train"]["balance"]["plan_hashes"])) > TRAIN_STEPS // 2


def test_ranks_wait_only_in_the_gradient_reduction(results):
    t = [r["timeline"] for r in results]
    assert [x["micro_batches"] for x in t] == [3, 2, 2, 0]
    slow_done = t[0]["done_at"]
    for fast in t[1:]:
        # fast ranks (one without any micro-batch) finish their micro-batches long before the
        # slow rank, which sleeps SLEEP_S in each of its 3 ...
        assert fast["done_at"] < slow_done - 2 * SLEEP_S
        # ... and then block in the gradient reduction until it arrives
        assert fast["reduce_wall_s"] > 2 * SLEEP_S
        assert fast["reduced_at"] >= slow_done
    assert t[0]["reduce_wall_s"] < SLEEP_S


def test_a_step_that_lost_tokens_is_refused_on_every_rank(results):
    # the manual plan of the timeline test: 6 documents, 320 tokens, 314 loss tokens
    for r in results:
        assert r["guards"]["token_guard"] is not None
        assert "trained 314 loss tokens, the global batch has 315" in r["guards"]["token_guard"]


def test_an_overlong_document_is_truncated_on_its_way_to_the_ranks(results):
    guards = [r["guards"] for r in results]
    documents = guards[0]["documents"]
    assert guards[0]["truncated_meta"] == [{"id": 0, "from": CONTEXT + 44, "to": CONTEXT}]
    expected = {(i, p): t for i, d in enumerate(documents) for p, t in enumerate(d[:CONTEXT])}
    seen = [item for g in guards for item in g["truncated_tokens_seen"]]
    assert len(seen) == len(expected)  # every planned token once, the cut-off tail nowhere
    assert {(s, p): t for s, p, t in seen} == expected
    assert all(g["padding_is_zero"] for g in guards)
    loss_tokens = sum(min(len(d), CONTEXT) - 1 for d in documents)
    assert all(g["truncated_loss_tokens"] == loss_tokens for g in guards)
    loss = sum(g["truncated_loss_sum"] for g in guards) / loss_tokens
    ref = guards[0]["truncated_reference_loss"]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    assert guards[0]["truncated_grad_error"] <= TOLERANCE


def test_rank0_broadcast_gives_the_same_plan_and_mismatches_are_caught(results):
    assert len({r["broadcast_hash"] for r in results}) == 1
    assert results[0]["broadcast_hash"] == results[0]["every_rank_hash"]
    for r in results:
        message = r["mismatch"]
        assert message is not None
        assert "ranks [0, 2, 3]" in message and "ranks [1]" in message


def test_a_rank_that_cannot_plan_stops_every_rank_and_no_batch_is_skipped(results):
    for rank, r in enumerate(results):
        failures = r["planning_failures"]
        if rank == 2:
            assert failures["every_rank"] == "ValueError: rank 2 cannot plan"
        else:
            assert "PlanningError: step 0: ranks [2] could not plan" in failures["every_rank"]
        if rank == 0:
            assert failures["broadcast"] == "ValueError: rank 0 cannot plan"
        else:
            assert "rank 0 could not plan the global batch: ValueError: rank 0 cannot plan" in (
                failures["broadcast"])
        # step 0 again, with the whole failed batch (not the 3-sequence batch after it)
        assert failures["every_rank_retry"] == failures["broadcast_retry"] == f"0 {len(GRAD_LENGTHS)}"


def test_core_attention_refuses_what_the_ring_kernel_cannot_do(results):
    refusals = results[0]["attention_refusals"]
    assert "attention dropout (0.1)" in refusals["dropout"]
    assert "causal attention only" in refusals["mask"]
    assert "takes no PackedSeqParams" in refusals["packed"]
    assert "no micro-batch bound" in refusals["unbound"]


# -- selective activation offload (offload_cases.py) ----------------------------------------


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_offload_gives_the_gradients_of_the_run_without_it(results, ratio):
    """Rings of 3 and 2 and local packs, every micro-batch offloading ``ratio``."""
    info = [r["offload"]["manual"][ratio] for r in results]
    assert info[0]["vs_no_offload"] <= 1e-6
    assert info[0]["vs_reference"] <= TOLERANCE
    assert all(i["ratios"] == [ratio] for i in info)
    moved = sum(i["offloaded_bytes"] for i in info)
    assert (moved > 0) == (ratio > 0)
    assert all(i["offloaded_bytes"] == i["reloaded_bytes"] for i in info)
    assert all(i["on_demand_reloads"] == 0 for i in info), "reloads should start a layer ahead"
    # the step's HDP metrics (Megatron's log line): all ranks' bytes, the largest rank's peak
    peak = max(i["peak_resident_bytes"] for i in info)
    for i in info:
        assert i["hdp"][0] == pytest.approx(moved / 1e6, rel=1e-6)
        assert i["hdp"][1] == pytest.approx(peak / 1e6, rel=1e-6)


def test_offload_lowers_the_measured_peak_of_resident_saved_bytes(results):
    for r in results:
        peaks = [r["offload"]["manual"][ratio]["peak_resident_bytes"] for ratio in (0.0, 0.5, 1.0)]
        assert peaks[0] > peaks[1] > peaks[2] > 0, peaks


@pytest.mark.parametrize("scheduler", ["naive", "balance"])
def test_a_plan_with_offload_uses_fewer_ranks_and_trains_with_reference_gradients(results, scheduler):
    info = [r["offload"]["planned"][scheduler] for r in results]
    rings = info[0]["ring_of_longest"]
    assert rings[True] < rings[False], rings  # the 150-token sequence: 2 ranks instead of 3
    assert sum(i["offloaded_bytes"] for i in info) > 0
    assert info[0]["vs_reference"] <= TOLERANCE


def test_the_host_pool_stops_growing_in_training(results):
    for r in results:
        pools = r["offload"]["planned"]["balance"]["pools"]
        assert len(set(pools)) == 1, pools
