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


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_planning_error_surfaces_at_its_own_step_and_the_batch_is_planned_again(prefetch):
    planner, threads = _slow_planner(0.0, fail_on_step=1)  # fails once, on the second call
    iterator = HDPDataIterator(_batches(3), planner=planner, hdp=_SingleRank(), prefetch=prefetch)
    assert next(iterator).index == 0
    with pytest.raises(ValueError, match="11 tokens cannot fit"):
        next(iterator)
    again = next(iterator)  # the same batch, not the one after it
    assert (again.index, again.plan.sequences[0].length) == (1, 11)
    assert [s.plan.sequences[0].length for s in iterator] == [12]
    iterator.close()


def test_a_planner_that_keeps_failing_never_skips_its_batch():
    def planner(lengths):
        raise ValueError(f"cannot plan {lengths[0]}")

    iterator = HDPDataIterator(_batches(3), planner=planner, hdp=_SingleRank(), prefetch=1)
    for _ in range(3):
        with pytest.raises(ValueError, match="cannot plan 10"):
            next(iterator)
    iterator.close()


def test_a_failed_source_is_not_mistaken_for_its_end():
    def source():
        yield [[1] * 10]
        raise OSError("disk gone")

    planner, _ = _slow_planner(0.0)
    for prefetch in (0, 1):
        iterator = HDPDataIterator(source(), planner=planner, hdp=_SingleRank(), prefetch=prefetch)
        assert next(iterator).index == 0
        for _ in range(2):  # a generator that raised cannot resume: the error stays
            with pytest.raises(OSError, match="disk gone"):
                next(iterator)
        iterator.close()


def test_a_planner_that_never_returns_times_out():
    release = threading.Event()

    def stuck(lengths):
        release.wait()
        raise AssertionError("released")

    iterator = HDPDataIterator(_batches(2), planner=stuck, hdp=_SingleRank(), prefetch=1,
                               plan_timeout_s=0.3)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="no plan after 0.3 s"):
        next(iterator)
    assert time.perf_counter() - start < 5
    with pytest.raises(TimeoutError):
        next(iterator)
    planner_threads = [t for t in threading.enumerate() if t.name == "bytescale-plan"]
    assert planner_threads and all(t.daemon for t in planner_threads)
    release.set()


STUCK_SCRIPT = """
import threading, torch
from megatron_bytescale.data.hdp_iterator import HDPDataIterator
class One:
    rank, size, group, device = 0, 1, None, torch.device("cpu")
it = HDPDataIterator([[[1, 2, 3]]], planner=lambda _: threading.Event().wait(), hdp=One(),
                     plan_timeout_s=0.2)
try:
    next(it)
except TimeoutError as exc:
    print("TIMEOUT", exc)
"""


def test_the_interpreter_exits_although_the_planner_never_returns():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", STUCK_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "TIMEOUT step 0" in run.stdout, run.stdout + run.stderr


def test_bad_prefetch_and_timeout_are_refused():
    with pytest.raises(ValueError, match="prefetch"):
        HDPDataIterator([], planner=lambda _: None, hdp=_SingleRank(), prefetch=-1)
    with pytest.raises(ValueError, match="plan_timeout_s"):
        HDPDataIterator([], planner=lambda _: None, hdp=_SingleRank(), plan_timeout_s=0)
