"""Ring P2P bytes, two-level and flat, with pipeline parallelism (PP 1, 2 and 4).

Every pipeline stage runs the ring attention of its own layers on the same ring, so the bytes
one ring micro-batch sends over the whole model do not depend on how its layers are split over
stages: ``layers_per_stage * pp_size`` layers in all. The other two-level tests use PP = 1,
where "the stage's layers" and "all layers" are the same number. Expected bytes are written
from the paper's formulas with hand-padded lengths:

* flat ring of D: ``L * (D - 1) * (2 kv + dkv) * P``, each of its D links carrying 1/D; the
  inter-node part is that times the node-crossing links of the cycle;
* two-level ring of D = k nodes x G: all-to-alls ``L * P * 2 (G - 1) / G * (2 q + kv)`` inside
  the nodes, and ``L * (k - 1) * (2 kv + dkv) * P`` on the ring between nodes.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.estimate import estimate_plan, micro_batch_costs
from megatron_bytescale.planner.plan import PlanBuilder
from planner_cases import small_cost_model

LAYERS = 8  # the whole model; a stage holds LAYERS / pp
KV, DKV, Q = 64.0, 128.0, 100.0
# (ring, length): 2 nodes x 4 (G = 4), 2 nodes x 2 (G = 2), 4 nodes x 2 (G = 2), one node
# (flat, NVLink), 2 nodes x 1 (flat over the network), and a ring that is not node-contiguous
RINGS = [((0, 1, 2, 3, 4, 5, 6, 7), 1000), ((8, 9, 12, 13), 777),
         ((16, 17, 20, 21, 24, 25, 28, 29), 4099), ((32, 33, 34, 35), 301), ((38, 42), 123),
         ((44, 48, 45, 49), 555)]  # disjoint: the plan's pipeline schedule never waits


def padded(length: int, ring: int, align: int) -> int:
    """sum of the 2D zigzag parts, each padded up to ``align`` (counting up)."""
    if ring == 1:
        return length
    part = -(-length // (2 * ring))
    while part % align:
        part += 1
    return 2 * ring * part


def expected(ring: tuple[int, ...], length: int, align: int, two_level: bool) -> tuple[float, float]:
    """(all bytes, inter-node bytes) of one micro-batch, all LAYERS layers."""
    d, p = len(ring), padded(length, len(ring), align)
    nodes = [r // 4 for r in ring]
    g = nodes.count(nodes[0])
    contiguous = all(nodes[i] == nodes[(i // g) * g] for i in range(d)) and len(set(nodes)) == d // g
    if two_level and g >= 2 and d // g >= 2 and contiguous:
        intra = LAYERS * p * 2 * (g - 1) / g * (2 * Q + KV)
        inter = LAYERS * (d // g - 1) * (2 * KV + DKV) * p
        return intra + inter, inter
    total = LAYERS * (d - 1) * (2 * KV + DKV) * p
    crossings = sum(nodes[i] != nodes[(i + 1) % d] for i in range(d))
    return total, total / d * crossings


@pytest.mark.parametrize("two_level", [True, False])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_ring_bytes_count_every_stage_layers(pp, align, two_level):
    cm = small_cost_model(num_layers=LAYERS, ranks_per_node=4, kv_bytes_per_token=KV,
                          dkv_bytes_per_token=DKV, q_bytes_per_token=Q, two_level_ring=two_level)
    lengths = {i: n for i, (_, n) in enumerate(RINGS)}
    builder = PlanBuilder(hdp_size=52, capacity=10**6, lengths=lengths, align=align)
    for i, (ring, _) in enumerate(RINGS):
        builder.add(ring, [i])
    plan = builder.build(scheduler="manual", pp_size=pp, layers_per_stage=LAYERS // pp)
    costs = micro_batch_costs(plan, cm)
    for k, (ring, length) in enumerate(RINGS):
        want_all, want_inter = expected(ring, length, align, two_level)
        assert costs.p2p_bytes[k] == pytest.approx(want_all, rel=1e-12), (ring, pp)
        assert costs.inter_node_bytes[k] == pytest.approx(want_inter, rel=1e-12, abs=1e-9), (ring, pp)
    summary = estimate_plan(plan, cm).extra
    assert summary["inter_node_p2p_bytes"] == round(sum(expected(r, n, align, two_level)[1]
                                                        for r, n in RINGS))
