"""Topology in the planner: the node map, inter-node bytes on hand-built plans, the CLI columns."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_bytescale.planner.estimate import estimate_plan, micro_batch_costs
from megatron_bytescale.planner.plan import PlanBuilder
from megatron_bytescale.planner.topology import Topology, ring_bandwidth, ring_link_bytes

from planner_cases import small_cost_model


# --------------------------------------------------------------------------- the map
def test_regular_topology_nodes_and_links():
    t = Topology(ranks_per_node=4)
    assert [t.node(r) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert t.min_nodes(1) == 1 and t.min_nodes(4) == 1 and t.min_nodes(5) == 2 and t.min_nodes(9) == 3
    assert t.ring_is_intra_node((4, 7, 5)) and not t.ring_is_intra_node((3, 4))
    # a whole node is inside it; one rank more is not, wherever the extremes fall
    assert t.ring_is_intra_node((4, 5, 6, 7)) and not t.ring_is_intra_node((4, 5, 6, 7, 8))
    assert not t.ring_is_intra_node(tuple(range(12)))
    # the ring cycle wraps: (0, 1, 4, 5) crosses 1->4 and 5->0
    assert t.inter_node_links((0, 1, 4, 5)) == 2
    assert t.inter_node_links((0, 4, 1, 5)) == 4
    assert t.inter_node_links((0, 1, 2, 3)) == 0
    assert t.inter_node_links((7,)) == 0
    assert t.ring_nodes((0, 4, 8, 1)) == 3
    assert t.node_contiguous((5, 0, 4, 1)) == (0, 1, 4, 5)


def test_explicit_node_map():
    # TP = 2 on nodes of 4 GPUs: HDP ranks are global ranks 0, 2, 4, 6, ... -> 2 per node
    t = Topology.from_global_ranks([0, 2, 4, 6, 8, 10], 4)
    assert t == Topology(ranks_per_node=2)  # collapses to the regular form
    shuffled = Topology.from_node_map([1, 0, 1, 0, 2, 2])
    assert shuffled.ranks_per_node == 2 and shuffled.node_of == (1, 0, 1, 0, 2, 2)
    assert shuffled.ring_is_intra_node((0, 2)) and not shuffled.ring_is_intra_node((0, 1))
    assert shuffled.node_contiguous((0, 1, 2, 3)) == (1, 3, 0, 2)
    assert Topology.from_dict(shuffled.to_dict()) == shuffled
    with pytest.raises(ValueError, match="covers 6 HDP ranks but the plan has 8"):
        shuffled.check_size(8)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(ranks_per_node=0)
    with pytest.raises(ValueError, match="node ids must be integers >= 0"):
        Topology.from_node_map([0, -1])
    with pytest.raises(ValueError, match="build it with Topology.from_node_map"):
        Topology(ranks_per_node=4, node_of=(0, 0, 1, 1))


# --------------------------------------------------------------------------- bytes, by hand
def _hand_plan():
    """8 ranks, nodes {0..3} {4..7}; three rings of 4 over a 40-token sequence each, and a local pack.

    kv = 64 and dkv = 128 bytes per token per layer, so a hop moves 2*64 + 128 = 256 bytes per
    padded token per layer. D = 4, 40 tokens -> 8 parts of 5, no padding: sum P = 40. Every ring
    sends layers * (D-1) * 256 * 40 = 8 * 3 * 256 * 40 = 245,760 bytes, 61,440 per link.
    """
    b = PlanBuilder(hdp_size=8, capacity=100, lengths={0: 40, 1: 40, 2: 40, 3: 10})
    b.add((0, 1, 2, 3), (0,))  # one node: no link crosses
    b.add((0, 1, 4, 5), (1,))  # 1->4 and 5->0 cross: 2 links
    b.add((4, 0, 5, 1), (2,))  # every link crosses: 4 links
    b.add((6,), (3,))
    return b.build(scheduler="hand", layers_per_stage=8)


def test_inter_node_bytes_on_a_hand_built_plan():
    cm = small_cost_model(ranks_per_node=4)  # 8 layers, kv 64, dkv 128
    plan = _hand_plan()
    costs = micro_batch_costs(plan, cm)
    assert costs.p2p_bytes.tolist() == [245_760, 245_760, 245_760, 0]
    assert costs.inter_node_bytes.tolist() == [0, 2 * 61_440, 4 * 61_440, 0]
    e = estimate_plan(plan, cm)
    assert e.p2p_bytes == 3 * 245_760
    assert e.extra["inter_node_p2p_bytes"] == 6 * 61_440
    assert e.extra["rings_fitting_one_node"] == 3 and e.extra["rings_within_one_node"] == 1
    assert e.extra["rings_over_min_nodes"] == 2 and e.extra["max_extra_nodes"] == 1
    # the same plan on one 8-rank node: nothing crosses; on 8 nodes of 1: everything does
    assert estimate_plan(plan, cm, Topology(ranks_per_node=8)).extra["inter_node_p2p_bytes"] == 0
    assert estimate_plan(plan, cm, Topology(ranks_per_node=1)).extra["inter_node_p2p_bytes"] == 3 * 245_760
    # an explicit map that puts 0, 1, 4, 5 on one node turns the second ring intra-node
    mixed = Topology.from_node_map([0, 0, 1, 1, 0, 0, 1, 1])
    assert micro_batch_costs(plan, cm, mixed).inter_node_bytes.tolist() == [2 * 61_440, 0, 0, 0]


def test_ring_link_bytes_and_bandwidth():
    cm = small_cost_model(ranks_per_node=4)
    t = Topology(ranks_per_node=4)
    assert ring_link_bytes(cm, t, (0, 1, 4, 5), 40, layers=8) == (245_760, 2 * 61_440)
    assert ring_link_bytes(cm, t, (3,), 40, layers=8) == (0.0, 0.0)
    assert ring_bandwidth(cm, t, (0, 3)) == cm.p2p_bandwidth_intra
    assert ring_bandwidth(cm, t, (3, 4)) == cm.p2p_bandwidth_inter


def test_estimate_uses_the_topology_the_plan_was_made_for():
    """Time: the same ring is faster on NVLink; the plan's recorded topology is the default."""
    cm = small_cost_model(ranks_per_node=4)
    plan = _hand_plan()
    as_made = replace(plan, meta={"topology": {"ranks_per_node": 8}})
    t8 = estimate_plan(as_made, cm)
    t4 = estimate_plan(plan, cm)
    assert t8.extra["inter_node_p2p_bytes"] == 0 and t8.extra["ranks_per_node"] == 8
    assert t8.step_time_s < t4.step_time_s


# --------------------------------------------------------------------------- CLI
def test_plan_cli_reports_inter_node_bytes(tmp_path, capsys):
    from megatron_bytescale.tools.plan_cmd import main

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([20000, 9000, 3000] + [500] * 40))
    out = tmp_path / "plan.json"
    assert main([str(lengths), "--hdp-size", "16", "--capacity", "4096", "--ranks-per-node", "4",
                 "--compare", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 per node" in text and "inter-node P2P" in text and "in one node" in text
    plan = json.loads(out.read_text())
    assert plan["meta"]["topology"] == {"ranks_per_node": 4}
    node_map = tmp_path / "nodes.txt"
    node_map.write_text("\n".join(str(r % 4) for r in range(16)))
    assert main([str(lengths), "--hdp-size", "16", "--capacity", "4096", "--node-map", str(node_map),
                 "--quiet"]) == 0
    assert "(node map)" in capsys.readouterr().out
    assert main([str(lengths), "--hdp-size", "16", "--capacity", "2048", "--ranks-per-node", "4",
                 "--two-level-ring", "--quiet"]) == 0
    assert "two-level rings" in capsys.readouterr().out
    assert main([str(lengths), "--hdp-size", "8", "--node-map", str(node_map), "--quiet"]) == 2
    assert "names 16 HDP ranks but --hdp-size is 8" in capsys.readouterr().err
    assert main([str(lengths), "--ranks-per-node", "0", "--quiet"]) == 2
    assert "--ranks-per-node (0) must be >= 1" in capsys.readouterr().err
