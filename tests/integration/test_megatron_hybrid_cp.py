"""Megatron's own hybrid CP scheduler (megatron-core 0.19) as the "Megatron hybrid CP" baseline
row: run through its public calls on the same batch, nothing of it re-implemented; on 0.16.1 the
row says why it is unavailable."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_bytescale.integration import compat
from megatron_bytescale.integration.megatron_hybrid_cp import (
    megatron_hybrid_cp_unavailable,
    plan_megatron_hybrid_cp,
)
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.tools import plan_cmd

HAS_SCHEDULER = compat.has_megatron_hybrid_cp_scheduler()  # 0.19.x: the 0.19 lane


def _batch(seed: int = 3, n: int = 40, capacity: int = 256, hdp: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.integers(8, capacity, size=n - 6)
    long = rng.integers(capacity + 1, capacity * hdp, size=6)  # rings of 2, 4 and 8
    return np.concatenate([short, long])


def _cost_model():
    return preset_cost_model("llama-7b")


def test_the_row_is_megatron_schedulers_own_output_on_the_same_batch():
    if not HAS_SCHEDULER:
        why = megatron_hybrid_cp_unavailable()
        assert why is not None and "needs megatron-core 0.19" in why
        with pytest.raises(ValueError, match="Megatron hybrid CP is unavailable: needs"):
            plan_megatron_hybrid_cp([10, 20], hdp_size=2, capacity=64, cost_model=_cost_model())
        return
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    assert megatron_hybrid_cp_unavailable() is None
    lengths, hdp, capacity = _batch(), 8, 256
    plan = plan_megatron_hybrid_cp(lengths, hdp_size=hdp, capacity=capacity,
                                   cost_model=_cost_model())
    plan.validate()

    class Group:  # the test's own stand-in for the DP x CP group
        def size(self):
            return hdp

    # Megatron's calls, made here independently: the plan must be exactly this schedule
    _, expected = BalancedCPScheduler(max_seq_len_per_rank=capacity, dp_cp_group=Group()) \
        .get_groups_and_subsamples([(i, int(n)) for i, n in enumerate(lengths)], None)
    barriers = [-1, *plan.meta["barrier_after_orders"], 10**9]
    assert plan.meta["num_groups"] == len(expected) >= 1
    for g, per_rank in enumerate(expected):
        lo, hi = barriers[g], barriers[g + 1]
        for rank, seqs in enumerate(per_rank):
            ran = [mb.seqs[0] for mb in plan.ranks[rank].micro_batches if lo < mb.order <= hi]
            assert ran == list(seqs), (g, rank)
    # every sequence once, on a ring of the ranks Megatron gave it, at least its power of two
    holders = {}
    for r in plan.ranks:
        for mb in r.micro_batches:
            assert len(mb.seqs) == 1  # Megatron runs every sub-sample on its own
            holders.setdefault(mb.seqs[0], set()).add(r.rank)
            assert mb.ring == tuple(sorted(mb.ring))
    assert sorted(holders) == list(range(len(lengths)))
    for seq, ranks in holders.items():
        need = 2 ** math.ceil(math.log2(lengths[seq] / capacity)) if lengths[seq] > capacity else 1
        assert len(ranks) >= need and len(ranks) & (len(ranks) - 1) == 0, (seq, ranks)
    assert sum(p.num_tokens for r in plan.ranks for mb in r.micro_batches
               for p in mb.pieces) == int(lengths.sum())
    assert plan.estimate.extra["num_barriers"] == len(expected) - 1
    # a sequence needing a larger power-of-two ring than there are ranks: refused, not hung
    with pytest.raises(ValueError, match="ring of 8 ranks .* more than the 6 DP x CP ranks"):
        plan_megatron_hybrid_cp([100, 1500], hdp_size=6, capacity=256, cost_model=_cost_model())


def test_plan_compare_shows_the_row_or_says_why_not(capsys):
    status = plan_cmd.main(["--compare", "--quiet", "--hdp-size", "16", "--capacity", "4096",
                            "--global-tokens", "262144", "--context-length", "65536",
                            "--synthetic", "github"])
    out = capsys.readouterr().out
    assert status == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert {"balance", "naive", "static", "pow2", "megatron-hybrid-cp"} <= set(rows)
    if HAS_SCHEDULER:
        step = float(rows["megatron-hybrid-cp"][1])
        assert step > 0 and step >= float(rows["balance"][1]) * 0.5
        assert rows["megatron-hybrid-cp"][1] != "n/a"
    else:
        assert rows["megatron-hybrid-cp"][1] == "n/a"
        assert "megatron-hybrid-cp: not applicable: needs megatron-core 0.19" in out
