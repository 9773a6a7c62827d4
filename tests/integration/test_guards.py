"""Guards of the training path that need no processes: plan size, deadlock, model config.

The multi-rank guards (token count, truncation, a planner failing on some ranks) run inside the
4-rank spawn of ``test_hdp_training.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bytescale.data.hdp_iterator import HDPDataIterator
from megatron_bytescale.planner.plan import PlanError, RankPlan, Sequence, StepPlan, build_ring_micro_batches


class _StandIn:
    """The parts of ``runtime.HDPGroup`` the iterator touches (no collective is reached)."""

    group = None
    device = torch.device("cpu")

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def global_rank(self, hdp_rank: int) -> int:
        return hdp_rank


def _crossing_plan() -> StepPlan:
    """Rank 0 runs ring A then B, rank 1 runs B then A: a deadlock (orders decrease on rank 1)."""
    lengths = {0: 4, 1: 4}
    a = build_ring_micro_batches(order=0, ring=(0, 1), seqs=[0], lengths=lengths)
    b = build_ring_micro_batches(order=1, ring=(0, 1), seqs=[1], lengths=lengths)
    return StepPlan(hdp_size=2, capacity=100, scheduler="hand",
                    sequences=(Sequence(id=0, length=4), Sequence(id=1, length=4)),
                    ranks=(RankPlan(rank=0, micro_batches=(a[0], b[0])),
                           RankPlan(rank=1, micro_batches=(b[1], a[1]))))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_plan_for_another_hdp_size_is_refused(prefetch):
    def planner(lengths):
        from megatron_bytescale.planner.plan import PlanBuilder

        b = PlanBuilder(hdp_size=2, capacity=100, lengths=dict(enumerate(lengths)))
        for i in range(len(lengths)):
            b.add([i % 2], [i])
        return b.build(scheduler="t")

    iterator = HDPDataIterator([[[1, 2, 3], [4, 5]]], planner=planner, hdp=_StandIn(1),
                               prefetch=prefetch)
    with pytest.raises(ValueError, match="the planner made a plan for 2 HDP ranks, the HDP group has 1"):
        next(iterator)
    iterator.close()


def test_the_iterator_refuses_a_plan_that_deadlocks_even_if_validate_misses_it(monkeypatch):
    # defence in depth: with validate() broken (here: a no-op), the deadlock check still stops
    # the plan before any rank trains on it, naming the stuck ranks
    monkeypatch.setattr(StepPlan, "validate", lambda self: self)
    iterator = HDPDataIterator([[[1, 2, 3, 4], [5, 6, 7, 8]]], planner=lambda _: _crossing_plan(),
                               hdp=_StandIn(2), check_plan_hash=False, prefetch=0)
    with pytest.raises(PlanError, match=r"deadlock: ranks \[0, 1\]"):
        next(iterator)
    iterator.close()


def _stub_model(**config):
    values = dict(calculate_per_token_loss=True, finalize_model_grads_func=lambda *a: None,
                  pipeline_model_parallel_size=1)
    values.update(config)
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(**values)
    return model


@pytest.mark.parametrize("config, message", [
    (dict(calculate_per_token_loss=False), r"HDP needs calculate_per_token_loss=True \(--calculate-per-token-loss\)"),
    (dict(finalize_model_grads_func=None), r"finalize_model_grads_func is not set"),
    (dict(pipeline_model_parallel_size=2), r"pipeline_model_parallel_size"),
])
def test_run_hdp_step_refuses_model_configs_that_would_give_wrong_gradients(config, message):
    from megatron_bytescale.integration.schedule import run_hdp_step

    with pytest.raises(ValueError, match=message):
        # refused before the step, the optimizer or the manager are touched
        run_hdp_step(None, model=_stub_model(**config), optimizer=None,
                     manager=SimpleNamespace(pp_size=1))


def test_a_config_without_pipeline_fields_is_pipeline_size_one():
    from megatron_bytescale.integration.schedule import check_model_config

    config = SimpleNamespace(calculate_per_token_loss=True, finalize_model_grads_func=lambda *a: None)
    # no pipeline_model_parallel_size attribute: one stage, accepted where Megatron runs one
    check_model_config(config, SimpleNamespace(pp_size=1))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size 1, but Megatron runs 2"):
        check_model_config(config, SimpleNamespace(pp_size=2))
