"""Interleaved (virtual) pipeline stages under HDP on 4 CPU ranks: PP 2 x VPP 2 x HDP 2 through
the interleaved driver, gradients equal a single-process reference (fp32, rel err <= 1e-5).

ONE 4-process spawn (module-scoped fixture, ``vpp_cases.py``): pipelines with different
micro-batch counts and rings across both, a pipeline with no micro-batch, and a balance plan
made with virtual stages. A deadlock leaves ranks blocked in gloo; the spawn's time-out then
fails every test here.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .vpp_cases import vpp_rank_body

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, vpp_rank_body, timeout_s=480)


def test_each_stage_holds_two_interleaved_chunks(results):
    for r in results:
        # chunk c of stage s is virtual stage 2c + s: layers 2c + s + 1 (1-based)
        s = r["stage"]
        assert r["runs"]["rings"]["layers"] == [[s + 1], [s + 3]]


@pytest.mark.parametrize("run", ["rings", "idle pipeline", "balance"])
def test_pp2_vpp2_hdp2_gradients_equal_the_reference(results, run):
    info = [r["runs"][run] for r in results]
    assert all(i["vpp"] == 2 for i in info)
    counts = info[0]["counts"]
    if run == "rings":
        assert counts == [7, 3] and info[0]["ring_sizes"] == [1, 2]
    elif run == "idle pipeline":
        assert counts == [5, 0]
    else:
        assert 2 in info[0]["ring_sizes"] and sum(counts) > 6, counts  # the scheduler's own rings
    last = [r["runs"][run] for r in results if r["stage"] == 1]
    loss = sum(i["loss_sum"] for i in last) / last[0]["global_loss_tokens"]
    ref = info[0]["reference_loss"]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r in results:
        errors = r["runs"][run]["grad_errors"]
        # both chunks' layers, the embedding on stage 0 and the tied LM head on stage 1
        assert sum(k.startswith("chunk1.decoder") for k in errors) >= 4
        assert any("word_embeddings" in k or "output_layer" in k for k in errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"


@pytest.mark.parametrize("run", ["rings", "idle pipeline", "balance"])
def test_forward_only_evaluation_matches_the_reference_forward(results, run):
    """Megatron-LM's evaluate() path (forward_only=True, under no_grad) over virtual stages:
    every planned micro-batch reports its loss sum once (ring members' shares summed), equal to
    the reference forward's sum over its sequences, and no gradient buffer moves."""
    runs = [r["runs"][run] for r in results]
    assert runs[0]["vpp"] == 2
    if run == "idle pipeline":
        assert sorted(runs[0]["counts"]) == [0, 5]
    per_order: dict[int, float] = {}
    seqs: dict[int, list[int]] = {}
    for r in results:
        ev = r["runs"][run]["eval"]
        assert ev["touched"] == [], f"rank {r['rank']}: gradient buffers changed by a forward-only pass"
        assert ev["reports"] >= 1  # a stage or pipeline without losses still gives Megatron one report
        seqs.update({int(k): v for k, v in ev["seqs"].items()})
        if r["stage"] == 1:
            for order, loss in ev["losses"].items():
                per_order[int(order)] = per_order.get(int(order), 0.0) + loss
        else:
            assert ev["losses"] == {}
    assert sorted(per_order) == sorted(seqs)  # every micro-batch of the plan evaluated
    ref = runs[0]["reference_seq_losses"]
    assert sorted(s for v in seqs.values() for s in v) == list(range(len(ref)))  # each sequence once
    for order, loss in per_order.items():
        expected = sum(ref[s] for s in seqs[order])
        assert abs(loss - expected) <= TOLERANCE * abs(expected), (run, order, loss, expected)
