"""The per-rank body of the two-level ring and topology-order tests (module-level for spawn)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_bytescale.planner.topology import Topology
from runtime_cases import global_tensors, local_inputs, scatter_results


def two_level_body(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every case and every micro-batch of this rank: run ``two_level_ring_attention`` and
    the flat ``ring_attention`` on the same inputs; return the two-level rows (for the
    reference), the largest two-level/flat difference, and bytes per level against the formula."""
    from megatron_bytescale.runtime import (
        CommCounters,
        HDPGroup,
        layout_for,
        ring_attention,
        ring_attention_p2p_bytes,
        two_level_p2p_bytes,
        two_level_ring_attention,
    )
    from megatron_bytescale.runtime.two_level_ring import two_level_plan

    hdp = HDPGroup()
    out = []
    for case in cases:
        plan, topo = case["plan"], Topology.from_dict(case["topology"])
        n_q, n_kv, head_dim = case["n_q"], case["n_kv"], case["head_dim"]
        data = global_tensors(case["seed"], plan, n_q, n_kv, head_dim)
        rows, flat_rows, diff, levels, syncs = [], [], 0.0, [], []
        for index, mb in enumerate(plan.ranks[rank].micro_batches):
            layout = layout_for(plan, hdp, index)
            x = local_inputs(layout, data, fill=0.0)
            results = {}
            counters = CommCounters()
            for name, fn in (("two", two_level_ring_attention), ("flat", ring_attention)):
                q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
                kw = {"topology": topo, "counters": counters} if name == "two" else {}
                o = fn(q, k, v, layout, hdp, **kw)
                o.backward(x["dout"])
                results[name] = {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            for kind in ("out", "dq", "dk", "dv"):
                a, b = results["two"][kind], results["flat"][kind]
                diff = max(diff, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30))
            syncs.append(_guarded_two_level(plan, hdp, index, x, topo))
            rows.append(scatter_results(layout, results["two"]))
            flat_rows.append(scatter_results(layout, results["flat"]))
            g = two_level_plan(layout, topo, n_kv)
            stats = counters.end_step().total
            t = layout.num_tokens
            if g > 1:
                want = two_level_p2p_bytes(num_tokens=t, ring_size=len(mb.ring), group=g, num_q_heads=n_q,
                                           num_kv_heads=n_kv, head_dim=head_dim, element_size=4)
            else:
                flat = ring_attention_p2p_bytes(num_tokens=t, ring_size=len(mb.ring), num_kv_heads=n_kv,
                                                head_dim=head_dim, element_size=4)
                want = (0, 0)
                assert stats.bytes_sent == flat, (stats.bytes_sent, flat)
            levels.append({"ring": mb.ring, "group": g, "intra": stats.intra_node_bytes_sent,
                           "inter": stats.inter_node_bytes_sent, "total": stats.bytes_sent,
                           "want": want})
        out.append({"rows": rows, "flat_rows": flat_rows, "diff": diff, "levels": levels,
                    "host_syncs": syncs})
    return out


def _guarded_two_level(plan, hdp, index, x, topo) -> list[str]:
    """Forward and backward of a fresh micro-batch (its per-micro-batch index tensors are built
    inside) under ``testing.host_sync``: the host syncs a GPU would make (none expected)."""
    from megatron_bytescale.runtime import layout_for, two_level_ring_attention
    from megatron_bytescale.testing.host_sync import host_syncs

    layout = layout_for(plan, hdp, index)
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    with host_syncs("count") as seen:
        o = two_level_ring_attention(q, k, v, layout, hdp, topology=topo)
        o.backward(x["dout"])
    return seen.calls
