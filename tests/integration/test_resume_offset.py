"""Resume offset without processes: ``build_hdp_data_iterators`` from a checkpoint's counters.

Megatron restores ``consumed_train_samples`` / ``consumed_valid_samples`` (SAMPLES: steps x
``--global-batch-size``) and rebuilds the data iterators. The iterator built after k steps must
give the step an uninterrupted run gives after k steps: same plan hash, same tokens. Skipping k x
global-batch-size global batches instead of k would pass every test that resumes from 0. The
4-rank version of this check runs in ``test_megatron_lm_hooks.py``; this one runs in the test
process (a one-rank HDP group stand-in), so the mutation check sees it.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from megatron_bytescale.integration import megatron_lm
from megatron_bytescale.integration.groups import HDPGroupManager, set_hdp_manager

from .megatron_lm_cases import random_documents, write_indexed_dataset
from .test_megatron_lm_hooks import GLOBAL_BATCH, SEQ, megatron_namespace, tiny_model_args


class _OneRank:
    """The parts of ``runtime.HDPGroup`` the data iterators touch, for one HDP rank."""

    rank, size, group = 0, 1, None
    device = torch.device("cpu")

    def global_rank(self, hdp_rank: int) -> int:
        return hdp_rank


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("resume") / "corpus_text_document"
    write_indexed_dataset(prefix, random_documents(7, 80))
    values = tiny_model_args(world_size=1)
    values.update(data_path=[str(prefix)], split="80,10,10")
    parsed = megatron_namespace("--bytescale-hdp", "--bytescale-capacity", str(SEQ), **values)
    megatron_lm.check_args(parsed)
    megatron_lm.validate_args(parsed)
    set_hdp_manager(HDPGroupManager(_OneRank()))
    yield parsed
    set_hdp_manager(None)


def _tokens(step) -> list[np.ndarray]:
    batch = step.global_batch
    return [np.asarray(batch.tokens_by_seq[i]) for i in range(len(batch.lengths))]


@pytest.mark.parametrize("split, counter, k", [(0, "consumed_train_samples", 3),
                                               (1, "consumed_valid_samples", 2)])
def test_resumed_iterator_continues_the_uninterrupted_run(args, split, counter, k):
    uninterrupted = megatron_lm.build_hdp_data_iterators(args)[split]
    steps = [next(uninterrupted) for _ in range(k + 1)]
    resumed_args = argparse.Namespace(**vars(args))
    setattr(resumed_args, counter, k * GLOBAL_BATCH)
    resumed = megatron_lm.build_hdp_data_iterators(resumed_args)[split]
    first, second = next(resumed), next(resumed)
    assert len({s.plan_hash for s in steps}) == k + 1  # every step differs: the check can fail
    assert first.global_batch.meta["batch"] == k  # the k-th global batch of the split (0-based)
    for mine, theirs in ((first, steps[k]), (second, None)):
        if theirs is None:
            theirs = next(uninterrupted)
        assert mine.plan_hash == theirs.plan_hash
        assert mine.global_batch.lengths == theirs.global_batch.lengths
        assert all(np.array_equal(a, b) for a, b in zip(_tokens(mine), _tokens(theirs)))
    uninterrupted.close()
    resumed.close()


def test_ramp_up_sizes_need_not_divide_the_hdp_ranks():
    """HDP plans tokens, not micro-batches per rank: a ramp-up step of 6 samples on 4 HDP ranks
    is fine (Megatron's consistency check would refuse it), and resuming counts such steps.
    --rampup-batch-size 4 2 8: +2 samples every 8 / 2 = 4 consumed samples: 4, 6, 8, 8, ..."""
    from megatron_bytescale.integration.batch_schedule import GlobalBatchSchedule

    from megatron_bytescale.integration.compat import batch_size_ramp_settings

    schedule = GlobalBatchSchedule(global_batch_size=8, micro_batch_size=1, data_parallel_size=4,
                                   **batch_size_ramp_settings([4, 2, 8], global_batch_size=8))
    assert [schedule.samples(i) for i in range(5)] == [4, 6, 8, 8, 8]
    assert [schedule.steps_done(c) for c in (0, 4, 10, 18, 26)] == [0, 1, 2, 3, 4]


def test_the_test_split_always_starts_at_its_first_batch(args):
    # Megatron counts no consumed test samples: however far training got, testing starts over
    resumed_args = argparse.Namespace(**vars(args))
    resumed_args.consumed_train_samples, resumed_args.consumed_valid_samples = 3 * GLOBAL_BATCH, GLOBAL_BATCH
    test_split = megatron_lm.build_hdp_data_iterators(resumed_args)[2]
    assert next(test_split).global_batch.meta["batch"] == 0
    test_split.close()


@pytest.mark.parametrize("counters", [None, 0])
def test_a_run_without_consumed_counters_starts_at_the_first_batch(args, counters):
    # an own loop's namespace may lack Megatron's counters (None: attribute missing) or hold 0;
    # with a global batch of one sample, any other default would skip a batch
    fresh = argparse.Namespace(**vars(args))
    fresh.global_batch_size = 1
    for name in ("consumed_train_samples", "consumed_valid_samples"):
        if counters is None:
            vars(fresh).pop(name, None)
        else:
            setattr(fresh, name, counters)
    iterators = megatron_lm.build_hdp_data_iterators(fresh)
    for split in (0, 1):
        assert next(iterators[split]).global_batch.meta["batch"] == 0
    for it in iterators:
        it.close()
