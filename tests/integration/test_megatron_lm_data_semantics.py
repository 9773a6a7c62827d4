"""Megatron's data semantics under HDP: shuffling by seed, weighted blends, ramp-up, .idx lengths.

Each rule is checked against Megatron's own code where it has one: the blend order against
megatron-core's ``build_blending_indices`` (BlendedDataset's C++ helper), the ramp-up against
megatron-core's micro-batch calculator driven the way Megatron-LM's training loop drives it.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from megatron_bytescale.data.document_order import document_visits, epoch_order
from megatron_bytescale.integration import document_index
from megatron_bytescale.integration.batch_schedule import GlobalBatchSchedule
from megatron_bytescale.integration.compat import batch_size_ramp_settings
from megatron_bytescale.integration.document_index import (
    clear_document_length_cache,
    document_lengths,
)
from megatron_bytescale.integration.megatron_lm_data import (
    MIN_TOKENS,
    budget_batches,
    indexed_document_source,
)

from .megatron_lm_cases import random_documents, write_indexed_dataset


# ----------------------------------------------------------------------------- shuffling


def test_every_document_exactly_once_per_epoch_in_a_new_order_over_three_epochs(tmp_path):
    """A small dataset over 3 epochs, through the global batches HDP trains on."""
    docs = random_documents(7, 13)
    write_indexed_dataset(tmp_path / "d", docs)
    whole = [np.concatenate(d).astype(np.int64) for d in docs]
    source = indexed_document_source([str(tmp_path / "d")], split=[1.0, 0.0, 0.0], split_index=0)
    context, budget = 10_000, 700  # no context cuts; batch cuts split documents across batches

    def pieces_by_epoch(seed):
        spans: dict[int, dict[int, list[tuple[int, int]]]] = {}
        order: dict[int, list[int]] = {}
        epochs_seen = []
        for batch in budget_batches(source, tokens_per_batch=budget, context_length=context,
                                    seed=(seed, 0)):
            for i, piece in enumerate(batch.tokens_by_seq.pieces):
                epochs_seen.append(piece.epoch)
                if piece.epoch == 3:
                    return spans, order, epochs_seen
                assert np.array_equal(batch.tokens_by_seq[i],
                                      whole[piece.doc][piece.start:piece.start + piece.length])
                spans.setdefault(piece.epoch, {}).setdefault(piece.doc, []).append(
                    (piece.start, piece.start + piece.length))
                if piece.start == 0:
                    order.setdefault(piece.epoch, []).append(piece.doc)
        raise AssertionError("unreachable: batches are endless")

    spans, order, epochs_seen = pieces_by_epoch(11)
    assert epochs_seen == sorted(epochs_seen)  # epoch e ends before e + 1 starts
    for epoch in range(3):
        assert sorted(order[epoch]) == list(range(len(docs)))  # each document exactly once
        for doc, cuts in spans[epoch].items():  # its tokens once: disjoint, in order, <=1 lost
            assert cuts == sorted(cuts) and all(a[1] <= b[0] for a, b in zip(cuts, cuts[1:]))
            covered = sum(e - s for s, e in cuts)
            assert len(whole[doc]) - len(cuts) <= covered <= len(whole[doc])
    assert len({tuple(order[e]) for e in range(3)}) == 3  # a new order every epoch
    assert order[0] != list(range(len(docs)))  # shuffled
    again, _, _ = pieces_by_epoch(11)
    assert again == spans  # reproducible from the seed
    other, other_order, _ = pieces_by_epoch(12)
    assert other_order != order


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(50, seed=(3, 0), epoch=2)
    assert sorted(a) == list(range(50))
    assert np.array_equal(a, epoch_order(50, seed=(3, 0), epoch=2))
    assert not np.array_equal(a, epoch_order(50, seed=(3, 0), epoch=1))
    assert not np.array_equal(a, epoch_order(50, seed=(3, 1), epoch=2))  # another split
    assert np.array_equal(epoch_order(5, seed=(3,), epoch=0, shuffle=False), np.arange(5))


# ----------------------------------------------------------------------------- blends


def test_blend_of_equal_length_documents_follows_megatron_blended_dataset():
    """With every document 1 token long, tokens are samples: the dataset chosen for each
    visit must be megatron-core's BlendedDataset index, sample for sample."""
    from megatron.core.datasets import helpers_cpp

    weights = [0.5, 0.2, 0.3]
    sizes = [7, 3, 11]
    lengths = np.ones(sum(sizes), dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    n = 997
    ours = [v.dataset for v in itertools.islice(
        document_visits(lengths, seed=(1,), datasets=bounds, weights=weights, min_tokens=1), n)]
    megatron_index = np.zeros(n, dtype=np.int16)
    megatron_sample = np.zeros(n, dtype=np.int64)
    normalized = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    helpers_cpp.build_blending_indices(megatron_index, megatron_sample, normalized, len(weights),
                                       n, False)
    assert ours == megatron_index.tolist()


def test_blend_weights_are_shares_of_tokens_and_each_dataset_runs_its_own_epochs():
    rng = np.random.default_rng(0)
    short = rng.integers(2, 30, 40)  # dataset 0: many short documents
    long = rng.integers(200, 400, 5)  # dataset 1: a few long ones
    lengths = np.concatenate([short, long])
    bounds = [0, 40, 45]
    visits = list(itertools.islice(
        document_visits(lengths, seed=(5,), datasets=bounds, weights=[3.0, 7.0]), 3000))
    tokens = np.zeros(2)
    for v in visits:
        tokens[v.dataset] += lengths[v.doc]
    assert abs(tokens[1] / tokens.sum() - 0.7) < lengths.max() / tokens.sum() + 1e-9
    counts = Counter(v.dataset for v in visits)
    assert counts[0] > 5 * counts[1]  # ~16 vs ~300 tokens a document: weights count tokens
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        mine = [v for v in visits if v.dataset == k]
        assert all(lo <= v.doc < hi for v in mine)
        full_epochs = max(v.epoch for v in mine)
        for epoch in range(full_epochs):  # every document once per epoch of its dataset
            assert sorted(v.doc for v in mine if v.epoch == epoch) == list(range(lo, hi))


def test_blend_through_budget_batches_of_two_indexed_datasets(tmp_path):
    write_indexed_dataset(tmp_path / "a", random_documents(1, 30))
    write_indexed_dataset(tmp_path / "b", random_documents(2, 10))
    source = indexed_document_source([str(tmp_path / "a"), str(tmp_path / "b")],
                                     split=[1.0, 0.0, 0.0], split_index=0)
    assert source.datasets == (0, 30, 40)
    batches = budget_batches(source, tokens_per_batch=1000, context_length=400, seed=(9, 0),
                             weights=[0.25, 0.75])
    tokens = np.zeros(2)
    for batch in itertools.islice(batches, 60):
        for piece in batch.tokens_by_seq.pieces:
            assert (piece.doc >= 30) == (piece.dataset == 1)
            tokens[piece.dataset] += piece.length
    assert abs(tokens[1] / tokens.sum() - 0.75) < 0.02


def test_a_weighted_dataset_without_usable_documents_is_left_out():
    lengths = np.array([1, 1, 0, 5, 6, 7])
    visits = itertools.islice(document_visits(lengths, seed=(0,), datasets=[0, 3, 6],
                                              weights=[0.9, 0.1], min_tokens=2), 20)
    assert {v.dataset for v in visits} == {1}
    with pytest.raises(ValueError, match="at least 2 tokens"):
        next(document_visits(np.array([1, 1]), seed=(0,), weights=[1.0], min_tokens=2))
    with pytest.raises(ValueError, match="weight -1.0 of dataset 0"):
        next(document_visits(lengths, seed=(0,), datasets=[0, 3, 6], weights=[-1, 2]))


# ----------------------------------------------------------------------------- ramp-up


def _megatron_loop_sizes(steps, **flags):
    """Global batch sizes as Megatron-LM's train loop gets them from the global calculator."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
        update_num_microbatches,
    )

    ramp = flags["ramp"]  # 0.16.1: rampup_batch_size; 0.19: step_batch_size_schedule
    init_num_microbatches_calculator(0, ramp.get("rampup_batch_size"), flags["gbs"], flags["mbs"],
                                     flags["dp"], False,
                                     **{k: v for k, v in ramp.items() if k != "rampup_batch_size"})
    try:
        consumed, sizes = 0, []
        for _ in range(steps):
            update_num_microbatches(consumed, consistency_check=True)
            sizes.append(flags["dp"] * flags["mbs"] * get_num_microbatches())
            consumed += sizes[-1]
        return sizes
    finally:
        destroy_num_microbatches_calculator()


@pytest.mark.parametrize("rampup", [None, [4, 4, 40], [8, 8, 100]])
def test_global_batch_schedule_matches_megatron_training_loop(rampup):
    ramp = batch_size_ramp_settings(rampup, global_batch_size=32) if rampup else {}
    flags = dict(ramp=ramp, gbs=32, mbs=1, dp=4)
    schedule = GlobalBatchSchedule(global_batch_size=32, micro_batch_size=1,
                                   data_parallel_size=4, **ramp)
    expected = _megatron_loop_sizes(30, **flags)
    assert [schedule.samples(i) for i in range(30)] == expected
    if rampup:
        assert expected[0] == rampup[0] and expected[-1] == 32 and len(set(expected)) > 2
    for step in (0, 1, 5, 17):
        assert schedule.steps_done(sum(expected[:step])) == step
    if rampup:
        with pytest.raises(ValueError, match="consumed 5 training samples.*"
                                             "(--rampup-batch-size|--step-batch-size-schedule)"):
            schedule.steps_done(5)


def test_ramp_up_grows_the_token_budget_and_resume_respects_it(tmp_path):
    write_indexed_dataset(tmp_path / "d", random_documents(3, 60))
    source = indexed_document_source([str(tmp_path / "d")], split=[1.0, 0.0, 0.0], split_index=0)
    schedule = GlobalBatchSchedule(global_batch_size=8, micro_batch_size=1, data_parallel_size=2,
                                   **batch_size_ramp_settings([2, 2, 12], global_batch_size=8))
    seq = 64

    def batches(skip=0):
        return budget_batches(source, tokens_per_batch=lambda i: schedule.samples(i) * seq,
                              context_length=seq, seed=(4, 0), skip_batches=skip)

    straight = list(itertools.islice(batches(), 10))
    sizes = [schedule.samples(i) for i in range(10)]
    assert sizes[0] == 2 and sizes[-1] == 8 and sizes != sorted(sizes)[::-1]
    for batch, size in zip(straight, sizes):
        assert size * seq - MIN_TOKENS < batch.total_tokens <= size * seq
    resume_at = schedule.steps_done(sum(sizes[:4]))  # a checkpoint mid ramp-up
    assert resume_at == 4
    resumed = list(itertools.islice(batches(skip=resume_at), 6))
    assert [b.tokens_by_seq.pieces for b in resumed] == [b.tokens_by_seq.pieces
                                                          for b in straight[4:]]


# ----------------------------------------------------------------------------- .idx lengths


def test_document_lengths_come_from_the_index_cached_per_dataset(tmp_path, monkeypatch):
    from megatron.core.datasets import indexed_dataset

    docs = random_documents(5, 20)
    docs[4] = [np.zeros(0, dtype=np.int32)]  # an empty document keeps its place
    prefix = str(tmp_path / "c")
    write_indexed_dataset(prefix, docs)
    expected = [sum(len(s) for s in d) for d in docs]
    opened = []
    real = indexed_dataset.IndexedDataset

    class Counting(real):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

        def get(self, *args, **kwargs):
            raise AssertionError("a token was read")

    monkeypatch.setattr(indexed_dataset, "IndexedDataset", Counting)
    clear_document_length_cache()
    splits = [indexed_document_source([prefix], split=[0.8, 0.1, 0.1], split_index=i)
              for i in range(3)]
    assert list(document_lengths(prefix)) == expected
    assert len(opened) == 1  # one index read for three splits
    assert not document_lengths(prefix).flags.writeable
    for batch in itertools.islice(budget_batches(splits[0], tokens_per_batch=400,
                                                 context_length=200, seed=(1, 0)), 40):
        assert batch.total_tokens > 0  # three epochs of planning from lengths, no token read

    cache = tmp_path / "cache"
    clear_document_length_cache()
    assert list(document_lengths(prefix, cache_dir=str(cache))) == expected
    files = list(cache.rglob("*.npy"))
    assert len(files) == 1 and len(opened) == 2
    clear_document_length_cache()  # a new process: the file answers, the index stays closed
    monkeypatch.setattr(document_index, "_from_index", lambda *a: pytest.fail("index re-read"))
    assert list(document_lengths(prefix, cache_dir=str(cache))) == expected
