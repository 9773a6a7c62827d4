"""Resuming the HDP data iterator: a resumed run plans and builds exactly the steps of an
uninterrupted one, whatever was prefetched or failed when the state was saved.

One process; the four HDP ranks' micro-batches are built from each step's plan directly, so
"same tokens" covers every rank. The own loop with a real model (train 5 steps, checkpoint,
resume, compare losses) runs in the 4-process spawn of ``test_hdp_training.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from megatron_bytescale.data.global_batches import global_batches
from megatron_bytescale.data.hdp_iterator import HDPDataIterator, PlannedTokens
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.runtime.layout import build_micro_batch

from .hdp_cases import CAPACITY, CONTEXT, cost_model

HDP = 4
STEPS = 10
SAVED_AT = 5  # "train 5 steps, save": steps 0-4 trained, the state says next_step 5


class _Rank:
    """The parts of ``runtime.HDPGroup`` the iterator touches, for HDP rank 1 of 4."""

    rank, size, group = 1, HDP, None
    device = torch.device("cpu")

    def global_rank(self, hdp_rank: int) -> int:
        return hdp_rank


def _documents():
    rng = np.random.default_rng(5)
    for _ in range(400):  # long-tailed: most documents pack, some need rings of 2-4
        n = int(min(CONTEXT, rng.lognormal(np.log(40), 1.0))) + 2
        yield rng.integers(0, 256, n)


def _batches():
    return global_batches(_documents(), tokens_per_batch=HDP * CAPACITY * 2,
                          context_length=CONTEXT, max_batches=STEPS)


_PLANNER = functools.partial(make_plan, scheduler="balance", hdp_size=HDP, capacity=CAPACITY,
                             cost_model=cost_model(), offload=False, context_length=CONTEXT)


def _source(kind: str, calls: list[int] | None = None):
    if kind == "list":
        return list(_batches())
    if kind == "generator":
        return _batches()

    def from_step(start: int):  # a source that can seek: it skips without planning
        if calls is not None:
            calls.append(start)
        return (b for i, b in enumerate(_batches()) if i >= start)

    return from_step


def _fingerprint(step) -> tuple:
    """The step's index, plan hash and the tokens, labels and positions of EVERY rank."""
    plan, batch = step.plan, step.global_batch
    tokens = PlannedTokens(batch.tokens_by_seq, plan.sequence_lengths())
    built = []
    for rank in range(plan.hdp_size):
        for i in range(len(plan.ranks[rank].micro_batches)):
            mb = build_micro_batch(plan, rank, i, tokens)
            built.append((rank, i, mb.tokens.tolist(), mb.labels.tolist(),
                          mb.position_ids.tolist()))
    return step.index, step.plan_hash, tuple(built)


@functools.lru_cache(maxsize=1)
def _uninterrupted() -> list[tuple]:
    steps = list(HDPDataIterator(_batches(), planner=_PLANNER, hdp=_Rank(), prefetch=0))
    assert len(steps) == STEPS
    assert any(max(s.plan.ring_sizes()) > 1 for s in steps)  # rings, not only local packs
    return [_fingerprint(s) for s in steps]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("kind", ["function", "list", "generator"])
def test_resumed_steps_equal_the_uninterrupted_run(kind, prefetch):
    expected = _uninterrupted()
    assert len({h for _, h, _ in expected}) == STEPS  # the steps differ: the check can fail
    first = HDPDataIterator(_source(kind), planner=_PLANNER, hdp=_Rank(), prefetch=prefetch)
    trained = [_fingerprint(next(first)) for _ in range(SAVED_AT)]
    assert trained == expected[:SAVED_AT]
    state = first.state_dict()  # with prefetch, steps 5.. are already read and planned
    assert state == {"version": 1, "next_step": SAVED_AT}
    first.close()

    calls: list[int] = []
    resumed = HDPDataIterator(_source(kind, calls), planner=_PLANNER, hdp=_Rank(),
                              prefetch=prefetch)
    resumed.load_state_dict(state)
    rest = [_fingerprint(s) for s in resumed]
    assert [fp[0] for fp in rest] == list(range(SAVED_AT, STEPS))  # global step indices
    assert rest == expected[SAVED_AT:]
    assert resumed.state_dict()["next_step"] == STEPS
    if kind == "function":
        assert calls == [SAVED_AT]  # asked to start at step 5, not replayed from 0


def test_start_step_is_load_state_dict():
    iterator = HDPDataIterator(_source("function"), planner=_PLANNER, hdp=_Rank(),
                               start_step=SAVED_AT + 2)
    assert [_fingerprint(s) for s in iterator] == _uninterrupted()[SAVED_AT + 2:]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_failed_plan_at_the_save_point_is_neither_lost_nor_doubled(prefetch):
    """The planner fails on step 5's batch; the state saved then still says step 5."""
    failures = [1]

    def flaky(lengths):
        plan = _PLANNER(lengths)
        if plan.content_hash() == _uninterrupted()[SAVED_AT][1] and failures:
            failures.pop()
            raise ValueError("transient planner failure")
        return plan

    first = HDPDataIterator(_source("list"), planner=flaky, hdp=_Rank(), prefetch=prefetch)
    for _ in range(SAVED_AT):
        next(first)
    with pytest.raises(ValueError, match="transient"):
        next(first)
    state = first.state_dict()
    assert state["next_step"] == SAVED_AT
    again = _fingerprint(next(first))  # the same iterator retries the same batch ...
    first.close()
    resumed = HDPDataIterator(_source("list"), planner=_PLANNER, hdp=_Rank(), prefetch=prefetch)
    resumed.load_state_dict(state)  # ... and so does a resumed one
    assert again == _fingerprint(next(resumed)) == _uninterrupted()[SAVED_AT]


def test_load_state_dict_rewinds_a_seekable_source_mid_run():
    iterator = HDPDataIterator(_source("function"), planner=_PLANNER, hdp=_Rank(), prefetch=2)
    for _ in range(7):
        next(iterator)
    iterator.load_state_dict({"version": 1, "next_step": 3})  # prefetched 7, 8 are dropped
    assert [_fingerprint(s) for s in iterator] == _uninterrupted()[3:]


def test_a_one_shot_source_that_was_read_cannot_rewind():
    iterator = HDPDataIterator(_source("generator"), planner=_PLANNER, hdp=_Rank(), prefetch=0)
    next(iterator)
    with pytest.raises(ValueError, match="one-shot iterator .* fresh source"):
        iterator.load_state_dict({"next_step": 0})


@pytest.mark.parametrize("state, match", [
    ({}, "expected the dict of HDPDataIterator.state_dict"),
    ([("next_step", 1)], "expected the dict"),
    ({"next_step": -1}, r"next_step \(-1\) must be an integer >= 0"),
    ({"next_step": 2.0}, r"next_step \(2.0\) must be an integer"),
    ({"version": 2, "next_step": 1}, "state version 2"),
])
def test_bad_states_are_refused(state, match):
    iterator = HDPDataIterator([], planner=_PLANNER, hdp=_Rank())
    with pytest.raises(ValueError, match=match):
        iterator.load_state_dict(state)


def test_bad_start_step_is_refused():
    with pytest.raises(ValueError, match=r"start_step \(True\) must be an integer >= 0"):
        HDPDataIterator([], planner=_PLANNER, hdp=_Rank(), start_step=True)


def test_the_megatron_lm_source_resumes_at_the_same_global_step():
    """``pretrain_gpt.py --load`` builds its iterator with ``start_step`` = the steps of
    ``consumed_train_samples``; an own-loop ``load_state_dict`` of the same step agrees."""
    from megatron_bytescale.integration.megatron_lm_data import DocumentSource, budget_batches_from

    rng = np.random.default_rng(3)
    lengths = np.minimum(rng.lognormal(np.log(50), 1.0, 300).astype(np.int64) + 2, 3 * CONTEXT)
    documents = [rng.integers(0, 256, n) for n in lengths]
    source = DocumentSource(name="memory", lengths=lengths,
                            read=lambda d, start, n: documents[d][start:start + n])
    batches = functools.partial(budget_batches_from, source=source,
                                tokens_per_batch=lambda i: HDP * CAPACITY * (2 + i % 3),
                                context_length=CONTEXT, seed=(1234, 0))
    uninterrupted = [_fingerprint(s) for s, _ in zip(
        HDPDataIterator(batches, planner=_PLANNER, hdp=_Rank()), range(8))]
    megatron_resume = HDPDataIterator(batches, planner=_PLANNER, hdp=_Rank(), start_step=SAVED_AT)
    own_loop = HDPDataIterator(batches, planner=_PLANNER, hdp=_Rank())
    own_loop.load_state_dict({"version": 1, "next_step": SAVED_AT})
    for iterator in (megatron_resume, own_loop):
        assert [_fingerprint(next(iterator)) for _ in range(3)] == uninterrupted[SAVED_AT:]
        assert iterator.state_dict()["next_step"] == SAVED_AT + 3
