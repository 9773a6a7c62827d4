"""MoE under HDP on 4 CPU ranks: every gradient equals megatron-core's single-process MoE.

All checks share ONE 4-process spawn (module-scoped fixture); see ``moe_cases.py``.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .moe_cases import moe_rank_body

TOLERANCE = 1e-5
RUNS = ["manual alltoall aux 0", "manual allgather aux", "balance alltoall aux"]


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, moe_rank_body, timeout_s=900)


def test_the_manual_plan_has_rings_packs_uneven_counts_and_an_idle_rank(results):
    info = results[0]["runs"]["manual alltoall aux 0"]
    assert info["ring_sizes"] == [1, 2]
    assert info["micro_batch_counts"] == [4, 3, 2, 0]
    assert results[0]["runs"]["balance alltoall aux"]["ring_sizes"][-1] >= 2


def test_the_aux_losses_change_the_router_gradient(results):
    assert results[0]["aux_effect"] > 1e-3


@pytest.mark.parametrize("run", RUNS)
def test_moe_gradients_equal_megatron_alone(results, run):
    case = "aux 0" if run.endswith("aux 0") else "aux"
    loss = sum(r["runs"][run]["loss_sum"] for r in results) / results[0]["runs"][run][
        "global_loss_tokens"]
    ref = results[0]["reference_loss"][case]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    for r in results:
        info = r["runs"][run]
        assert info["names_match"]
        errors = info["grad_errors"]
        assert any(".mlp.router." in n for n in errors)
        assert sum(".mlp.experts." in n for n in errors) >= 2 * 4 * 2  # layers x experts x fc
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"


@pytest.mark.parametrize("run", ["manual allgather aux", "balance alltoall aux"])
def test_the_logged_router_losses_are_the_documents_own_weighted_by_tokens(results, run):
    """Megatron-LM's ``load_balancing_loss`` / ``z_loss`` log values under HDP: the mean over
    the global batch's documents, weighted by their tokens, of what megatron-core logs for a
    document alone; the same on every rank, whatever the plan."""
    reference = results[0]["reference_log"]
    assert set(reference) == {"load_balancing_loss", "z_loss"}
    assert all(v > 0 for v in reference.values())
    for r in results:
        log = r["runs"][run]["log"]
        assert set(log) == set(reference), log
        for name, value in reference.items():
            assert abs(log[name] - value) / value <= TOLERANCE, (r["rank"], name, log[name], value)


@pytest.mark.parametrize("control", ["control: megatron's per-micro-batch aux",
                                     "control: ring counts not summed"])
def test_the_gradient_check_catches_plan_dependent_router_losses(results, control):
    """Megatron-core's per-micro-batch aux loss, or unsummed ring counts, change the router's
    gradient far beyond the tolerance, so the equality above is not luck."""
    errors = results[0]["runs"][control]["grad_errors"]
    assert max(v for n, v in errors.items() if ".mlp.router." in n) > 100 * TOLERANCE
