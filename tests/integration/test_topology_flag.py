"""--bytescale-ranks-per-node and LOCAL_WORLD_SIZE -> the planner's node map (no processes)."""

from __future__ import annotations

import argparse

import pytest

from megatron_bytescale.integration.config import ByteScaleConfig, add_bytescale_args
from megatron_bytescale.integration.planning import check_two_level_heads, hdp_topology, make_step_planner
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.topology import Topology

CM = preset_cost_model("llama-7b")  # 8 ranks per node


def test_default_is_local_world_size_then_the_cost_model():
    cfg = ByteScaleConfig(hdp=True, capacity=1024)
    assert hdp_topology(cfg, hdp_size=16, cost_model=CM, environ={}) == Topology(ranks_per_node=8)
    assert hdp_topology(cfg, hdp_size=16, cost_model=CM, environ={"LOCAL_WORLD_SIZE": "4"}) == Topology(ranks_per_node=4)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x' must be an integer from 1"):
        hdp_topology(cfg, hdp_size=16, cost_model=CM, environ={"LOCAL_WORLD_SIZE": "x"})


def test_flag_wins_and_global_ranks_place_hdp_ranks():
    args = add_bytescale_args(argparse.ArgumentParser()).parse_args(
        ["--bytescale-hdp", "--bytescale-capacity", "1024", "--bytescale-ranks-per-node", "8"])
    cfg = ByteScaleConfig.from_args(args)
    assert cfg.ranks_per_node == 8
    env = {"LOCAL_WORLD_SIZE": "4"}
    assert hdp_topology(cfg, hdp_size=16, cost_model=CM, environ=env) == Topology(ranks_per_node=8)
    # TP = 2: the HDP group of TP rank 0 is global ranks 0, 2, 4, ...: 4 HDP ranks per 8-GPU node
    tp2 = hdp_topology(cfg, hdp_size=8, cost_model=CM, global_ranks=range(0, 16, 2), environ=env)
    assert tp2 == Topology(ranks_per_node=4)
    # ranks that do not follow node order get an explicit map
    odd = hdp_topology(cfg, hdp_size=4, cost_model=CM, global_ranks=[0, 8, 1, 9], environ=env)
    assert odd.node_of == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="--bytescale-ranks-per-node \\(0\\) must be >= 1"):
        ByteScaleConfig(ranks_per_node=0)


def test_step_planner_records_the_topology(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = make_step_planner(ByteScaleConfig(hdp=True, capacity=1024), hdp_size=4, cost_model=CM)(
        [3000, 500, 700, 200])
    assert plan.meta["topology"] == {"ranks_per_node": 2}
    assert plan.estimate.extra["ranks_per_node"] == 2


def test_two_level_flag_plans_two_level_and_checks_heads():
    args = add_bytescale_args(argparse.ArgumentParser()).parse_args(
        ["--bytescale-hdp", "--bytescale-capacity", "8192", "--bytescale-two-level-ring"])
    cfg = ByteScaleConfig.from_args(args)
    assert cfg.two_level_ring
    plan = make_step_planner(cfg, hdp_size=64, cost_model=CM, topology=Topology(ranks_per_node=8))(
        [200_000, 30_000, 5000] + [1000] * 200)
    assert plan.meta["ring_sizing"] in ("two-level", "flat")
    check_two_level_heads(8, Topology(ranks_per_node=8))
    check_two_level_heads(3, Topology(ranks_per_node=1))
    with pytest.raises(ValueError, match="splits the 4 key/value heads .* over the 8 HDP ranks of a node"):
        check_two_level_heads(4, Topology(ranks_per_node=8))
