"""The HDP data iterator plans the next global batch in the background (no processes needed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_bytescale.data.hdp_iterator import HDPDataIterator
from megatron_bytescale.planner.plan import PlanBuilder


class _SingleRank:
    """The parts of ``runtime.HDPGroup`` the iterator touches, for a group of one rank."""

    rank, size, group = 0, 1, None
    device = torch.device("cpu")

    def global_rank(self, hdp_rank: int) -> int:
        return hdp_rank


def _slow_planner(delay_s: float, fail_on_step: int | None = None):
    threads: list[str] = []

    def plan(lengths: list[int]):
        threads.append(threading.current_thread().name)
        if fail_on_step is not None and len(threads) == fail_on_step + 1:
            raise ValueError(f"sequence of {lengths[0]} tokens cannot fit")
        time.sleep(delay_s)
        builder = PlanBuilder(hdp_size=1, capacity=max(lengths), lengths=dict(enumerate(lengths)))
        for i in range(len(lengths)):
            builder.add([0], [i])
        return builder.build(scheduler="test")

    return plan, threads


def _batches(n: int):
    return [[[1] * (10 + step), [2] * 3] for step in range(n)]


def test_prefetch_hides_planning_behind_training():
    planner, threads = _slow_planner(0.2)
    steps = []
    for step in HDPDataIterator(_batches(4), planner=planner, hdp=_SingleRank(), prefetch=1):
        steps.append(step)
        time.sleep(0.35)  # "training": longer than planning, so the next plan is ready
    assert [s.plan.sequences[0].length for s in steps] == [10, 11, 12, 13]  # in order
    assert all(name.startswith("bytescale-plan") for name in threads)
    assert steps[0].plan_wait_s >= 0.15  # nothing to hide the first plan behind
    assert all(s.plan_wait_s < 0.1 for s in steps[1:]), [s.plan_wait_s for s in steps]
    assert all(s.plan_s >= 0.2 for s in steps)


def test_without_prefetch_the_step_waits_for_its_plan():
    planner, threads = _slow_planner(0.1)
    steps = list(HDPDataIterator(_batches(2), planner=planner, hdp=_SingleRank(), prefetch=0))
    assert [s.index for s in steps] == [0, 1]
    assert threads == [threading.current_thread().name] * 2
    assert all(s.plan_wait_s >= 0.1 for s in steps)


def test_a_planning_error_surfaces_at_its_own_step():
    planner, _ = _slow_planner(0.0, fail_on_step=1)
    iterator = HDPDataIterator(_batches(3), planner=planner, hdp=_SingleRank(), prefetch=2)
    assert next(iterator).index == 0
    with pytest.raises(ValueError, match="11 tokens cannot fit"):
        next(iterator)
    iterator.close()


def test_bad_prefetch_is_refused():
    with pytest.raises(ValueError, match="prefetch"):
        HDPDataIterator([], planner=lambda _: None, hdp=_SingleRank(), prefetch=-1)
