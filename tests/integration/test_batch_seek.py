"""Resuming the Megatron-LM document batches at step k by a seek gives the walk's batches.

``budget_batches(skip_batches=k)`` jumps to batch k (:mod:`megatron_bytescale.data.batch_seek`)
instead of walking k batches of documents; the batches from there must be exactly the ones an
uninterrupted walk yields: the same pieces (document, start, length, epoch, dataset) in the same
order. The cases make every branch of the cutting rule happen: sequences cut at the budget,
remainders of one token (dropped) and of more, batches closing with one token of room,
documents of 0, 1 and 2 tokens, batches larger than an epoch, a growing budget (ramp-up).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_bytescale.data.batch_seek import seek_pool_batches
from megatron_bytescale.integration.megatron_lm_data import DocumentSource, budget_batches


def _source(lengths, datasets=()) -> DocumentSource:
    lengths = np.asarray(lengths, dtype=np.int64)
    return DocumentSource(name="docs", lengths=lengths, datasets=tuple(datasets),
                          read=lambda doc, start, length: np.arange(start, start + length))


def _batches(source, skip, count, **kwargs) -> list[tuple]:
    batches = budget_batches(source, skip_batches=skip, **kwargs)
    return [(b.meta["batch"], b.tokens_by_seq.pieces) for b in itertools.islice(batches, count)]


def _walked(source, skip, count, **kwargs) -> list[tuple]:
    return _batches(source, 0, skip + count, **kwargs)[skip:]


def _cases():
    rng = np.random.default_rng(11)
    for case in range(24):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(0, 60, n)
        lengths[rng.random(n) < 0.15] = rng.choice([0, 1, 2, 3], size=1)
        lengths[0] = max(lengths[0], 2)
        context = int(rng.choice([2, 3, 7, 16, 64]))
        fixed = int(rng.choice([2, 3, 5, 17, 40, 101, 1000]))
        budget = fixed if case % 3 else (lambda i, f=fixed: f + 3 * min(i, 10))  # ramp-up
        yield pytest.param(lengths, context, budget, bool(case % 4), id=f"case{case}")


@pytest.mark.parametrize("lengths,context,budget,shuffle", list(_cases()))
def test_seeking_to_step_k_gives_the_walks_batches(lengths, context, budget, shuffle):
    source = _source(lengths)
    kwargs = dict(tokens_per_batch=budget, context_length=context, seed=(5, 0), shuffle=shuffle)
    walked = _walked(source, 0, 45, **kwargs)
    for skip in (1, 2, 3, 7, 20, 40):
        assert _batches(source, skip, 5, **kwargs) == walked[skip:skip + 5], skip


def test_the_seek_crosses_blocks_and_epochs_and_keeps_the_datasets():
    """Blocks of 3 documents (a batch spans several), an unweighted two-dataset pool."""
    lengths = np.random.default_rng(3).integers(1, 50, 23)
    source = _source(lengths, datasets=(0, 10, 23))
    kwargs = dict(tokens_per_batch=77, context_length=8, seed=1234, shuffle=True)
    walked = _walked(source, 0, 60, **kwargs)
    assert max(p.epoch for _, pieces in walked for p in pieces) >= 5  # batches span epochs
    assert {p.dataset for _, pieces in walked for p in pieces} == {0, 1}
    for skip in (5, 31, 55):
        assert _batches(source, skip, 5, **kwargs) == walked[skip:skip + 5]
    seed = (1234,)
    cursors = {block: seek_pool_batches(lengths, seed=seed, shuffle=True, budget_of=lambda i: 77,
                                        context=8, min_tokens=2, steps=31, block=block)
               for block in (1, 3, 1 << 20)}
    assert len(set(cursors.values())) == 1, cursors
    first = walked[31][1][0]
    order = np.random.default_rng([*seed, first.epoch]).permutation(len(lengths))
    cursor = cursors[3]
    assert (cursor.epoch, int(order[cursor.index]), cursor.token) == (
        first.epoch, first.doc, first.start)


def test_a_blend_still_resumes_by_walking():
    lengths = np.random.default_rng(4).integers(2, 40, 30)
    source = _source(lengths, datasets=(0, 12, 30))
    kwargs = dict(tokens_per_batch=50, context_length=16, seed=9, weights=[0.3, 0.7])
    assert _batches(source, 9, 4, **kwargs) == _walked(source, 9, 4, **kwargs)


def test_a_budget_too_small_is_refused_while_seeking():
    source = _source([10, 20, 30])
    with pytest.raises(ValueError, match="global batch 3 has a budget of 1 tokens"):
        next(budget_batches(source, tokens_per_batch=lambda i: 1 if i == 3 else 8,
                            context_length=8, seed=0, skip_batches=5))
