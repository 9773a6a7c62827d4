"""Which HDP ranks an expert group ties together, checked against megatron-core's own rank
layout (its ``RankGenerator``, the code ``initialize_model_parallel`` builds every group with),
without any process: for every TP / ETP / EP / PP size on up to 32 ranks, the plan's
``ep_size`` (:func:`expert_lockstep_size`) is exactly the HDP ranks one expert group
(megatron-core's tensor-and-expert group) spans, and ``HDPRankMap.check_expert_groups`` accepts
megatron-core's groups; sizes that do not divide one another are refused, and they would indeed
cut a TP group in two."""

from __future__ import annotations

import itertools

import pytest

from megatron_bytescale.integration.expert_layout import (
    expert_lockstep_refusal,
    expert_lockstep_size,
)
from megatron_bytescale.integration.groups import HDPParallelLayout, HDPRankMap

ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default


def megatron_groups(world: int, tp: int, etp: int, ep: int, pp: int, order: str = ORDER):
    """(TP groups, HDP groups, PP groups, EP groups, tensor-and-expert groups), as
    ``initialize_model_parallel`` makes them with CP 1 (same generator, same names)."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    return (dense.get_ranks("tp"), dense.get_ranks("dp"), dense.get_ranks("pp"),
            expert.get_ranks("ep"), expert.get_ranks("tp-ep"))


def rank_maps(world: int, tp: int, etp: int, ep: int, pp: int, order: str = ORDER):
    """Every global rank's ``HDPRankMap`` and the (HDP rank, TP rank, stage) rows."""
    tps, hdps, pps, eps, tp_eps = megatron_groups(world, tp, etp, ep, pp, order)

    def of(groups, rank):
        return next(tuple(g) for g in groups if rank in g)

    maps = []
    for r in range(world):
        hdp, tpg, ppg = of(hdps, r), of(tps, r), of(pps, r)
        maps.append(HDPRankMap(global_rank=r, hdp_rank=hdp.index(r), tp_rank=tpg.index(r),
                               pp_rank=ppg.index(r), hdp_global_ranks=hdp, tp_global_ranks=tpg,
                               pp_global_ranks=ppg, ep_global_ranks=of(eps, r),
                               tp_ep_global_ranks=of(tp_eps, r)))
    rows = [(m.hdp_rank, m.tp_rank, m.pp_rank) for m in maps]
    return maps, rows


def layouts():
    """Every (world, TP, ETP, EP, PP) megatron-core accepts on up to 32 ranks, sizes <= 8."""
    for world, tp, etp, ep, pp in itertools.product((2, 4, 6, 8, 12, 16, 32), (1, 2, 4),
                                                    (1, 2, 3, 4), (1, 2, 3, 4, 8), (1, 2)):
        if world % (tp * pp) == 0 and world % (etp * ep * pp) == 0 and etp * ep > 1:
            yield world, tp, etp, ep, pp


def test_the_lockstep_block_is_the_hdp_ranks_megatron_core_puts_in_an_expert_group():
    checked = refused = 0
    for world, tp, etp, ep, pp in layouts():
        tps, hdps, _, _, tp_eps = megatron_groups(world, tp, etp, ep, pp)
        maps, rows = rank_maps(world, tp, etp, ep, pp)
        if expert_lockstep_refusal(tp, etp, ep):
            # refused: some expert group takes part of an HDP rank's TP group (its TP ranks run
            # one micro-batch, so the group would tie them to another HDP rank's slots)
            assert any(set(g) & set(t) and not set(t) <= set(g) and not set(g) <= set(t)
                       for g in tp_eps for t in tps), (world, tp, etp, ep, pp)
            with pytest.raises(ValueError, match="do not divide one another"):
                expert_lockstep_size(tp, etp, ep)
            with pytest.raises(RuntimeError, match="expert group"):
                for m in maps:
                    m.check_expert_groups(rows)
            refused += 1
            continue
        block = expert_lockstep_size(tp, etp, ep)
        for group in tp_eps:
            spanned = sorted({rows[r][0] for r in group})
            assert len({rows[r][2] for r in group}) == 1  # one stage
            assert spanned == list(range(spanned[0], spanned[0] + block))
            assert spanned[0] % block == 0, (world, tp, etp, ep, pp, group)
            # every TP rank of those HDP ranks (at this stage) is in the group, or the group
            # lies inside one TP group
            tp_of_group = {r for t in tps if set(t) & set(group) for r in t}
            assert tp_of_group == set(group) or set(group) < tp_of_group
        for m in maps:
            assert m.ep_size == block and m.expert_model_parallel_size == ep
            m.check_expert_groups(rows)
        assert HDPParallelLayout(world_size=world, tensor_model_parallel_size=tp,
                                 pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp).hdp_size % block == 0
        checked += 1
    assert checked > 200 and refused >= 10, (checked, refused)


@pytest.mark.parametrize("tp, etp, ep, block", [(2, 1, 2, 1), (2, 1, 4, 2), (1, 2, 2, 4),
                                                (4, 1, 2, 1), (2, 2, 2, 2), (2, 4, 2, 4)])
def test_the_block_of_the_layouts_the_gradient_test_runs(tp, etp, ep, block):
    """The TP / ETP / EP of test_moe_parallel_training's ETP runs, and TP = ETP (the block is
    EP, as before); the EP size alone (the rule before ETP) is wrong whenever ETP != TP."""
    assert expert_lockstep_size(tp, etp, ep) == block
    assert (block == ep) == (etp == tp)


def test_another_rank_order_is_refused_rather_than_kept_in_step_wrongly():
    """With the data-parallel dimension inside the expert one, an expert group is not a block
    of consecutive HDP ranks: the check names the group instead of letting a plan hang."""
    maps, rows = rank_maps(8, 1, 1, 2, 1, order="tp-cp-dp-ep-pp")
    with pytest.raises(RuntimeError, match="HDP keeps consecutive HDP ranks in step"):
        for m in maps:
            m.check_expert_groups(rows)
