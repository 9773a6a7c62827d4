"""The GPU-first training path, checked on 4 CPU ranks (gloo): see ``gpu_path_cases.py``.

* ``--overlap-grad-reduce``: gradients equal the non-overlapped run over three steps in which
  ranks run different numbers of micro-batches and a rank (0 or 3) runs none; every bucket
  group is issued on every rank (several groups: small buckets);
* recompute: full-layer recompute and Megatron's selective ``core_attn`` recompute give the
  same gradients; the latter reruns the ring forward (counted) and warns once;
* the micro-batch loop (forward, backward, ring P2P, overlapped bucket hooks) reads no tensor
  value back to the host and makes no blocking host-to-device copy; the iterator's step (plan,
  hash check) reads back exactly once: the gathered table of plan hashes.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .gpu_path_cases import gpu_path_body

TOLERANCE = 1e-5  # the project standard; gloo sums the 4 ranks in another order when async


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, gpu_path_body, timeout_s=600)


def test_overlapped_reduction_matches_and_issues_every_bucket(results):
    for r in results:
        info = r["overlap"]
        assert info["bucket_groups"] >= 3, info
        assert info["issued_last_step"] == info["bucket_groups"]
        assert max(info["errors"]) <= TOLERANCE, (r["rank"], info["errors"])


@pytest.mark.parametrize("mode", ["full", "selective_core_attn"])
def test_recompute_gives_the_same_gradients(results, mode):
    for r in results:
        assert max(r["recompute"][mode]) <= TOLERANCE, (r["rank"], mode, r["recompute"][mode])


def test_selective_core_attn_recompute_reruns_the_ring_and_says_so(results):
    calls = {name: sum(r["recompute_calls"][name]["calls"] for r in results)
             for name in ("none", "full", "selective_core_attn")}  # fmt: skip
    assert calls["selective_core_attn"] == 2 * calls["none"] == calls["full"], calls
    warned = [w for r in results for w in r["recompute_calls"]["selective_core_attn"]["warned"]]
    assert warned and "Drop core_attn from --recompute-modules" in warned[0]


def test_micro_batch_loop_makes_no_host_sync(results):
    # no read back, no blocking host-to-device copy (testing.host_sync), on every rank
    assert [r["host_reads"] for r in results] == [[]] * 4


def test_iterator_step_reads_the_hash_table_back_once(results):
    for r in results:
        calls = r["iterator_syncs"]
        assert len(calls) == 1 and calls[0].startswith("read Tensor.cpu"), calls
        assert "hdp_iterator.py" in calls[0], calls
