"""The Ray remote loader gives the local loader's plans and tokens, and fails clearly.

One local Ray instance (CPU, started once for the module: ~10 s) serves every test; the
multi-process test joins it from two gloo ranks. Ray is in the test extra, so CI runs these;
elsewhere they skip, saying how to install it, only when ``import ray`` fails.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from megatron_bytescale.data.hdp_iterator import HDPDataIterator, PlannedTokens, PlanningError
from megatron_bytescale.data.ray_loader import (
    RayLoader,
    RayLoaderError,
    RayLoaderOptions,
    RayUnavailableError,
    rank_token_ranges,
)
from megatron_bytescale.data.synthetic_batches import synthetic_global_batches
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.runtime.layout import build_micro_batch
from megatron_bytescale.testing.distributed import run_distributed

from .hdp_cases import CAPACITY, CONTEXT, cost_model

HDP = 4
STEPS = 8
SOURCE = functools.partial(synthetic_global_batches, dataset="github",
                           tokens_per_batch=HDP * CAPACITY * 3, max_length=CONTEXT, steps=STEPS,
                           seed=7, vocab_size=256)
PLANNER = functools.partial(make_plan, scheduler="balance", hdp_size=HDP, capacity=CAPACITY,
                            cost_model=cost_model(), offload=False, context_length=CONTEXT)
OPTIONS = RayLoaderOptions(num_readers=2, lookahead=2, close_timeout_s=5.0)
WAIT_S = 120  # every wait on Ray is bounded: a stuck actor fails its test, never hangs the suite


class _Rank:
    """The parts of ``runtime.HDPGroup`` the iterator touches, for HDP rank ``rank`` of 4."""

    size, group = HDP, None
    device = torch.device("cpu")

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def global_rank(self, hdp_rank: int) -> int:
        return hdp_rank

    def __int__(self) -> int:  # the micro-batch builder takes a plain HDP rank without a group
        return self.rank


def _require_ray():
    try:
        import ray
    except ImportError:
        if os.environ.get("BYTESCALE_REQUIRE_RAY"):
            raise
        pytest.skip("Ray is not installed: pip install 'megatron_bytescale[ray]' "
                    "(bash scripts/test.sh installs it)")
    return ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray = _require_ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # test-defined sources and planners travel to the actors by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _rank_view(step) -> tuple:
    """Index, plan hash, and this rank's micro-batches (tokens, labels, positions, mask)."""
    built = tuple((mb.tokens.tolist(), mb.labels.tolist(), mb.position_ids.tolist(),
                   mb.loss_mask.tolist()) for mb in step.micro_batch_tensors())
    return step.index, step.plan_hash, built


@functools.lru_cache(maxsize=None)
def _local(rank: int, start: int = 0) -> list[tuple]:
    iterator = HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(rank), start_step=start)
    return [_rank_view(s) for s in iterator]


def _named_actors(ray) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def test_the_iterator_gets_the_local_plans_and_tokens_and_shuts_down(ray_cluster):
    import ray

    iterator = HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(1), dataloader="ray",
                               ray_options=OPTIONS, prefetch=1, plan_timeout_s=WAIT_S)
    before = set(threading.enumerate())
    steps = list(iterator)  # ends with StopIteration, which closes the loader
    assert [_rank_view(s) for s in steps] == _local(1)
    assert len({h for _, h, _ in _local(1)}) == STEPS  # the steps differ: the check can fail
    for step in steps:  # the rank holds tokens of its own micro-batches' sequences only
        assert set(step.global_batch.tokens_by_seq) == {
            s for mb in step.micro_batches for s in mb.seqs}
    assert not any(name.startswith("bytescale-") for name in _named_actors(ray))
    assert not [t for t in set(threading.enumerate()) - before if t.name == "bytescale-plan"]


def test_rank_tokens_hold_exactly_the_ranges_the_micro_batches_read():
    step = next(HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(2)))
    plan, source = step.plan, step.global_batch.tokens_by_seq
    for rank in range(HDP):
        ranges = rank_token_ranges(plan, rank)
        from megatron_bytescale.data.ray_loader import RankTokens

        pieces = {seq: [(a, np.asarray(source[seq][a:b])) for a, b in spans]
                  for seq, spans in ranges.items()}
        sparse = PlannedTokens(RankTokens(plan.sequence_lengths(), pieces),
                               plan.sequence_lengths())
        full = PlannedTokens(source, plan.sequence_lengths())
        for i in range(len(plan.ranks[rank].micro_batches)):
            a, b = build_micro_batch(plan, rank, i, sparse), build_micro_batch(plan, rank, i, full)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    with pytest.raises(KeyError, match="holds none of its tokens"):
        RankTokens({0: 5}, {})[0]


def test_one_planner_serves_every_rank_each_its_own_tokens_within_its_bound(ray_cluster):
    """Four consumers (HDP ranks 0-3) of one set of actors: every step is planned once, every
    rank's micro-batches equal the local loader's, and the ranks together fetch each token
    once (plus the label token after each zigzag part)."""
    import ray

    payload: dict = {}
    max_held = OPTIONS.lookahead + 3

    def loader(consumer):
        share = (lambda p: payload.update(p) or p) if consumer == 0 else (lambda _: dict(payload))
        return RayLoader(SOURCE, PLANNER, options=OPTIONS, start_step=0, consumer=consumer,
                         consumers=HDP, max_held=max_held, broadcast=share)

    loaders = [loader(c) for c in range(HDP)]
    planner = ray.get_actor(loaders[0].names[0], namespace=OPTIONS.namespace)
    first = loaders[0].fetch(0, attempt=0, done_before=0, hdp_rank=0, timeout_s=WAIT_S)
    time.sleep(1.0)  # the planner plans ahead, but only `lookahead` steps
    stats = ray.get(planner.stats.remote(), timeout=WAIT_S)
    assert stats["planned"] == 1 + OPTIONS.lookahead, stats
    fetched, total = first[5].num_tokens, 0
    for step in range(STEPS):
        results = [first] if step == 0 else []
        results += [loaders[r].fetch(step, attempt=0, done_before=step, hdp_rank=r,
                                     timeout_s=WAIT_S)
                    for r in range(len(results), HDP)]
        for rank, (kind, plan, plan_hash, lengths, _, tokens) in enumerate(results):
            assert kind == "plan" and plan.content_hash() == plan_hash == _local(rank)[step][1]
            built = PlannedTokens(tokens, plan.sequence_lengths())
            view = tuple((mb.tokens.tolist(), mb.labels.tolist(), mb.position_ids.tolist(),
                          mb.loss_mask.tolist())
                         for mb in (build_micro_batch(plan, rank, i, built)
                                    for i in range(len(plan.ranks[rank].micro_batches))))
            assert view == _local(rank)[step][2]
            fetched += tokens.num_tokens if step or rank else 0
        total += plan.total_tokens
    assert total < fetched < 1.2 * total
    end = [loaders[r].fetch(STEPS, attempt=0, done_before=STEPS, hdp_rank=r, timeout_s=WAIT_S)
           for r in range(HDP)]
    assert end == [("end",)] * HDP
    stats = ray.get(planner.stats.remote(), timeout=WAIT_S)
    assert stats["planned"] == STEPS and stats["max_held_seen"] <= max_held
    for consumer in reversed(loaders):
        consumer.close()  # the first waits for the others' release, then stops the actors
    assert not set(loaders[0].names) & _named_actors(ray)


def test_resume_with_the_ray_loader(ray_cluster, prefetch=1):
    first = HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(1), dataloader="ray",
                            ray_options=OPTIONS, prefetch=prefetch,
                            plan_timeout_s=WAIT_S)
    assert [_rank_view(next(first)) for _ in range(3)] == _local(1)[:3]
    state = first.state_dict()
    first.close()
    resumed = HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(1), dataloader="ray",
                              ray_options=OPTIONS, prefetch=prefetch,
                            plan_timeout_s=WAIT_S)
    resumed.load_state_dict(state)
    assert [_rank_view(s) for s in resumed] == _local(1)[3:]


class _FailsOnce:
    """Fails planning the batch of ``lengths`` the first time (the state lives in the actor)."""

    def __init__(self, lengths: tuple) -> None:
        self.lengths, self.failed = tuple(lengths), False

    def __call__(self, lengths):
        if tuple(lengths) == self.lengths and not self.failed:
            self.failed = True
            raise ValueError("transient planner failure")
        return PLANNER(lengths)


def test_a_failed_plan_is_raised_at_its_step_and_planned_again(ray_cluster):
    failing = next(SOURCE(4)).lengths
    iterator = HDPDataIterator(SOURCE, planner=_FailsOnce(failing), hdp=_Rank(0),
                               dataloader="ray", ray_options=OPTIONS, prefetch=1,
                               plan_timeout_s=WAIT_S)
    got = [_rank_view(next(iterator)) for _ in range(4)]
    with pytest.raises(PlanningError, match="step 4: the Ray loader's planner could not plan "
                                            "the global batch: ValueError: transient"):
        next(iterator)
    assert iterator.state_dict()["next_step"] == 4
    got += [_rank_view(s) for s in iterator]  # step 4 again, then 5..
    assert got == _local(0)


def _source_that_breaks(start_step: int):
    for step, batch in enumerate(SOURCE(start_step), start=start_step):
        if step == 2:
            raise OSError("disk gone")
        yield batch


def test_a_failed_source_stops_the_job_with_its_error(ray_cluster):
    iterator = HDPDataIterator(_source_that_breaks, planner=PLANNER, hdp=_Rank(0),
                               dataloader="ray", ray_options=OPTIONS, plan_timeout_s=WAIT_S)
    next(iterator), next(iterator)
    for _ in range(2):  # it stays failed
        with pytest.raises(RayLoaderError, match="step 2: reading the global batch failed: "
                                                 "OSError: disk gone"):
            next(iterator)
    iterator.close()


@pytest.mark.parametrize("role", ["reader", "planner"])
def test_a_dead_actor_is_named_not_waited_for(ray_cluster, role):
    import ray

    iterator = HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(0), dataloader="ray",
                               ray_options=OPTIONS, prefetch=0, plan_timeout_s=WAIT_S)
    next(iterator)
    names = iterator._remote.names  # noqa: SLF001 - the test kills one actor
    victim = names[1] if role == "reader" else names[0]
    ray.kill(ray.get_actor(victim, namespace=OPTIONS.namespace))
    start = time.perf_counter()
    with pytest.raises(RayLoaderError, match="died|failed"):
        for _ in range(STEPS):
            next(iterator)
    assert time.perf_counter() - start < 30
    iterator.close()


def test_sources_that_cannot_travel_are_refused():
    with pytest.raises(ValueError, match="must be a function start_step -> iterable"):
        HDPDataIterator(SOURCE(0), planner=PLANNER, hdp=_Rank(0), dataloader="ray")
    with pytest.raises(ValueError, match="does not apply to the Ray loader"):
        HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(0), dataloader="ray",
                        plan_mode="rank0_broadcast")
    with pytest.raises(ValueError, match="'local' or 'ray'"):
        HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(0), dataloader="remote")
    with pytest.raises(ValueError, match="num_readers"):
        RayLoaderOptions(num_readers=0)


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    before = set(threading.enumerate())
    iterator = HDPDataIterator(SOURCE, planner=PLANNER, hdp=_Rank(0), dataloader="ray")
    with pytest.raises(RayUnavailableError, match=r"pip install 'megatron_bytescale\[ray\]'"):
        next(iterator)
    assert not [t for t in set(threading.enumerate()) - before if t.name == "bytescale-plan"]


# ----------------------------------------------------------------------------- two processes


def two_rank_body(rank: int, world_size: int, address: str, prefix: str) -> dict:
    """Two training processes share one set of actors (consumer 0 creates, 1 joins): through
    the own-loop iterator, and through the Megatron-LM data hook on an indexed dataset."""
    import torch.distributed as dist

    options = RayLoaderOptions(address=address, num_readers=2, lookahead=2, close_timeout_s=20)
    hdp = _Rank(rank + 1)  # HDP ranks 1 and 2 of the 4-rank plans
    iterator = HDPDataIterator(SOURCE, planner=PLANNER, hdp=hdp, dataloader="ray",
                               ray_options=options, prefetch=1,  # hash check over the world
                               plan_timeout_s=WAIT_S)
    views = [_rank_view(s) for s in iterator]
    local = [_rank_view(s) for s in HDPDataIterator(SOURCE, planner=PLANNER, hdp=hdp)]
    out = {"same": views == local, "steps": len(views), "megatron": _megatron_path(address, prefix)}
    dist.barrier()
    return out


def _megatron_path(address: str, prefix: str) -> dict:
    """``--bytescale-dataloader ray`` in ``build_hdp_data_iterators``: the local loader's steps,
    also when resuming from ``consumed_train_samples``."""
    import argparse

    from megatron.core import parallel_state

    from megatron_bytescale.integration import megatron_lm
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    from .test_megatron_lm_hooks import GLOBAL_BATCH, megatron_namespace, tiny_model_args

    enable_cpu_megatron()
    parallel_state.initialize_model_parallel()

    def iterators(*flags, consumed=0):
        args = megatron_namespace("--bytescale-hdp", "--bytescale-capacity", str(2 * CAPACITY),
                                  *flags, data_path=[prefix], split="80,10,10",
                                  consumed_train_samples=consumed,
                                  **tiny_model_args(world_size=2))
        megatron_lm.check_args(args)
        megatron_lm.validate_args(args)
        return megatron_lm.build_hdp_data_iterators(args)

    ray_flags = ("--bytescale-dataloader", "ray", "--bytescale-ray-address", address)
    facts = {}
    for consumed in (0, 2 * GLOBAL_BATCH):
        local, remote = iterators(consumed=consumed)[0], iterators(*ray_flags, consumed=consumed)[0]
        a = [_rank_view(next(local)) for _ in range(3)]
        b = [_rank_view(next(remote)) for _ in range(3)]
        remote.close()
        facts[consumed] = {"same": a == b, "indices": [x[0] for x in b]}
    return facts


def test_two_processes_share_the_planner_and_get_the_local_steps(ray_cluster, tmp_path):
    import ray

    from .megatron_lm_cases import random_documents, write_indexed_dataset

    prefix = tmp_path / "corpus_text_document"
    write_indexed_dataset(prefix, random_documents(2, 60))
    results = run_distributed(2, two_rank_body, ray_cluster, str(prefix), timeout_s=300)
    assert all(r["same"] and r["steps"] == STEPS for r in results)
    for r in results:  # the Megatron-LM path, fresh and resumed after 2 steps
        assert r["megatron"] == {0: {"same": True, "indices": [0, 1, 2]},
                                 8: {"same": True, "indices": [2, 3, 4]}}
    assert not any(name.startswith("bytescale-") for name in _named_actors(ray))


def test_megatron_lm_refuses_the_ray_loader_without_ray_before_training(monkeypatch):
    from megatron_bytescale.integration import megatron_lm

    from .test_megatron_lm_hooks import megatron_namespace, tiny_model_args

    monkeypatch.setitem(sys.modules, "ray", None)
    args = megatron_namespace("--bytescale-hdp", "--bytescale-dataloader", "ray",
                              mock_data=True, **tiny_model_args())
    reasons = megatron_lm.hdp_refusals(args)
    assert any("pip install 'megatron_bytescale[ray]'" in r for r in reasons), reasons
