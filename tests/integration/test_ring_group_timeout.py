"""A ring waits for a stopped peer as long as the HDP group does, not torch's 30 minutes.

``new_group`` does not inherit the default group's timeout: without an explicit one, a ring
group waits 30 minutes for a peer that stopped (SIGSTOP, a hung host), while every collective
on the HDP group gives up after ``--distributed-timeout-minutes``. Whether a job then ended or
hung depended on where the live ranks happened to be. Each ring group made here must give up
within the timeout it was given: by ``new_ring_groups``, by ``HDPGroup`` creating its own, and
by ``initialize_hdp_model_parallel`` from Megatron's ``distributed_timeout_minutes``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from megatron_bytescale.testing.distributed import run_distributed

TIMEOUT_S = 3.0
SILENT_S = 4 * TIMEOUT_S + 6.0  # how long rank 1 stays silent: longer than all three waits


def _wait_for_silent_peer(group) -> float:
    """Seconds until a receive from the silent rank 1 on ``group`` fails (inf: it never did)."""
    import torch
    import torch.distributed as dist

    start = time.monotonic()
    try:
        dist.recv(torch.zeros(1), src=1, group=group)
    except RuntimeError:
        return time.monotonic() - start
    return float("inf")


def _ring_groups_time_out(rank: int, world_size: int) -> dict:
    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel
    from megatron_bytescale.runtime import HDPGroup, new_ring_groups
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    given = timedelta(seconds=TIMEOUT_S)
    by_function = new_ring_groups([[0, 1]], timeout=given)
    by_hdp_group = HDPGroup(ring_timeout=given).ring_group
    manager = initialize_hdp_model_parallel(distributed_timeout_minutes=TIMEOUT_S / 60.0)
    by_megatron = manager.hdp.ring_group
    if rank == 1:
        time.sleep(SILENT_S)  # the stopped peer: it never sends
        return {}
    return {
        "new_ring_groups": _wait_for_silent_peer(by_function),
        "HDPGroup": _wait_for_silent_peer(by_hdp_group),
        "initialize_hdp_model_parallel": _wait_for_silent_peer(by_megatron),
    }


@pytest.fixture(scope="module")
def waits() -> dict:
    # the default group's own timeout is long (120 s): only the ring groups' can end the waits
    return run_distributed(2, _ring_groups_time_out, timeout_s=120, hard_exit=True)[0]


@pytest.mark.parametrize("made_by", ["new_ring_groups", "HDPGroup", "initialize_hdp_model_parallel"])
def test_a_ring_gives_up_on_a_silent_peer_after_the_timeout_it_was_given(waits, made_by):
    waited = waits[made_by]
    # at least the timeout (it did wait), and well below the next bound (the silent rank's
    # sleep, the default group's 120 s, torch's 30 minutes)
    assert TIMEOUT_S * 0.8 <= waited < TIMEOUT_S + 3.0, waited
