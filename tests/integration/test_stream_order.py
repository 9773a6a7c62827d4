"""HDP training under NCCL's stream order, emulated on 4 CPU ranks: see ``stream_order_cases.py``.

On NCCL every operation of one process group runs on that group's stream in issue order; gloo
has no such order, so the other CPU tests cannot see a ring send queued behind a gradient
bucket's all-reduce. ``testing.stream_order`` adds that order to gloo groups. One spawn:

* with the ring group (today's code), overlapped gradient reduction with small buckets never
  deadlocks, on plans where a rank's last micro-batch is a ring that a peer has not finished
  (HDP 4) and on every pipeline stress plan (PP 2 x HDP 2, pipeline group ordered too), and
  the gradients equal the run without the emulation;
* with the rings on the HDP group itself (the configuration before the ring group), the same
  training deadlocks, and the emulator reports it as an error in seconds.
"""

from __future__ import annotations

import math

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .parallel_cases import STRESS_PLANS
from .stream_order_cases import stream_order_body

TOLERANCE = 1e-5  # the project standard; gloo sums in another order when asynchronous


@pytest.fixture(scope="module")
def results():
    # hard exit: phase C leaves gloo operations pending, which a teardown would wait for
    return run_distributed(4, stream_order_body, timeout_s=600, hard_exit=True)


def test_ring_group_never_waits_behind_a_bucket_reduction(results):
    a = results[0]["A"]
    assert sum(a["hazards"]) >= 3, "plans with a rank whose last micro-batch is a live ring"
    for r in results:
        info = r["A"]
        assert max(info["errors"]) <= TOLERANCE, (r["rank"], info["errors"])
        # the emulation carried the traffic: collectives on one stream, rings on the other
        assert info["items"]["hdp"] > 0, info["items"]
    assert sum(r["A"]["items"]["ring"] for r in results) > 0


def test_pipeline_stress_plans_never_deadlock_under_stream_order(results):
    steps = [r["B"]["steps"] for r in results]
    assert all(len(s) == STRESS_PLANS for s in steps)
    assert sum(s["hazards"] for s in steps[0]) >= 1
    assert sum(s["rings"] for s in steps[0]) >= 10
    for r in results:
        assert all(r["B"]["items"][name] > 0 for name in ("hdp", "ring", "pipeline")), r["B"]
        for s in r["B"]["steps"]:
            if s["last_stage"]:
                assert math.isfinite(s["loss_sum"]) and s["loss_sum"] >= 0


def test_rings_on_the_hdp_group_deadlock_under_stream_order(results):
    reports = [r["C"]["deadlock"] for r in results]
    assert results[0]["C"]["hazards"] >= 1
    assert any(reports), "the shared-group configuration completed"
    stuck = [msg for msg in reports if msg and "did not complete" in msg]
    assert stuck, reports
    # a ring operation waited behind a collective, or for a peer held up by one
    assert any("batch_isend_irecv" in msg for msg in stuck), stuck
