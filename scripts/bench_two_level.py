#!/usr/bin/env python
"""The two-level ring in numbers: (a) flat ring, (b) intra-node all-gather + ring of nodes,
(c) head-split all-to-all + ring of nodes. Writes section ``two_level`` of docs/benchmarks.md
(the numbers docs/two_level_ring.md decides on).

1. One 2M-token sequence of LLaMA-7B (TP 1, H100 preset: 8 GPUs per node, NVLink 360 GB/s,
   network 40 GB/s) on D = 256, 512, 1,024 ranks (k = 32, 64, 128 whole nodes): per member and
   layer the bytes sent inside and between nodes, the busiest NIC's time, the K/V memory in
   flight, compute against transfer per ring step (the overlap), and the ring's time for 32
   layers. (a) and (c) are the planner's cost model (``CostModel.ring_time_from_sums`` with
   and without ``two_level_ring``); (b) is the same model with (b)'s traffic (formula below).
2. 32M-token GitHub-like and Byted-like batches at 2M context (seed 0) on 1,024, 4,096 and
   16,384 ranks, planned by ``balance`` with flat and with two-level rings, each simulated as a
   whole step (``sim.simulate_step``: micro-batches, gradient reduction, optimizer).

Usage: ``.venv/bin/python scripts/bench_two_level.py [--no-write]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.presets import model_spec, preset_cost_model  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402
from megatron_bytescale.sim import preset_overheads, simulate_step  # noqa: E402

SEQ = 2 * 2**20
CONTEXT = 2097152
TOKENS = 32 * 2**20
CAPACITY = 8192


def progress(msg: str) -> None:
    print(f"[bench_two_level] {msg}", file=sys.stderr, flush=True)


def per_member(cm, d: int, variant: str) -> dict:
    """Per member and layer, fwd + bwd, for one SEQ-token sequence on d ranks of whole nodes."""
    g = cm.ranks_per_node
    k = d // g
    p = float(cm.padded_lengths([SEQ], d)[0])
    t = p / d  # rows per member
    kv, dkv, q = cm.kv_bytes_per_token, cm.dkv_bytes, cm.q_bytes_per_token
    hop = t * (2 * kv + dkv)  # one block's K/V forward + K/V and dK/dV backward
    attn = cm.alpha1 * p * p / d  # attention seconds per member per layer
    if variant == "a":
        # every member sends D - 1 blocks over its link; the k at node boundaries over the
        # network (averaged over the members here), the others over NVLink
        intra, inter = (d - k) / d * (d - 1) * hop, k / d * (d - 1) * hop
        ring_inter = k * (d - 1) * hop
        nic_s = (d - 1) * hop / cm.p2p_bandwidth_inter
        memory = 2 * t * kv
        step_compute, step_comm = attn / d, t * kv / cm.p2p_bandwidth_inter
        seconds = cm.ring_time_from_sums(p, p * p, d, layers=cm.num_layers, intra_node=False)
    elif variant == "b":
        # all-gather of the node's K/V before every ring step, reduce-scatter of dK/dV after
        intra = k * (g - 1) * t * (2 * kv + dkv)
        inter = (k - 1) * hop
        ring_inter = d * inter
        nic_s = inter / cm.p2p_bandwidth_inter
        memory = 2 * g * t * kv + g * t * dkv  # G blocks double-buffered, G dK/dV accumulators
        step_compute = attn / k
        step_comm = t * kv / cm.p2p_bandwidth_inter + (g - 1) * t * kv / cm.p2p_bandwidth_intra
        m_f = cm.p2p_latency_s * 2 + step_comm
        m_b = cm.p2p_latency_s * 2 + t * (kv + dkv) / cm.p2p_bandwidth_inter + (g - 1) * t * (kv + dkv) / cm.p2p_bandwidth_intra
        phi = cm.attention_forward_fraction
        c_f, c_b = attn * phi / k, attn * (1 - phi) / k
        first = (g - 1) * t * kv / cm.p2p_bandwidth_intra * 2 + (g - 1) * t * dkv / cm.p2p_bandwidth_intra
        layer = cm.beta1 * t + cm.gamma + c_f + c_b + (k - 1) * (max(c_f, m_f) + max(c_b, m_b)) + first
        seconds = cm.num_layers * layer
    else:
        two = cm.with_(two_level_ring=True)
        intra = 2 * (g - 1) / g * t * (2 * q + kv)
        inter = (k - 1) * hop
        ring_inter = d * inter
        nic_s = inter / cm.p2p_bandwidth_inter
        memory = 2 * t * kv
        step_compute, step_comm = attn / k, t * kv / cm.p2p_bandwidth_inter
        seconds = two.ring_time_from_sums(p, p * p, d, layers=cm.num_layers, intra_node=False, node_group=g)
    return dict(intra=intra, inter=inter, ring_inter=ring_inter, nic_s=nic_s, memory=memory,
                overlap=step_comm / step_compute, seconds=float(seconds))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cm = preset_cost_model("llama-7b")
    names = {"a": "(a) flat ring", "b": "(b) all-gather + ring of nodes", "c": "(c) head-split + ring of nodes"}
    rows = []
    for d in (256, 512, 1024):
        for v in "abc":
            x = per_member(cm, d, v)
            rows.append([f"{d:,} ({d // cm.ranks_per_node})", names[v], f"{x['intra'] / 2**20:,.0f}",
                         f"{x['inter'] / 2**20:,.0f}", f"{x['ring_inter'] / 2**30:,.0f}", f"{x['nic_s'] * 1e3:,.0f}",
                         f"{x['memory'] / 2**20:,.0f}", f"{x['overlap']:.2f}", f"{x['seconds']:.2f}"])
    ring_table = markdown_table(
        ["ranks D (nodes k)", "variant", "intra-node MiB / member / layer (mean)", "inter-node MiB / member / layer (mean)",
         "inter-node GiB / ring / layer", "busiest NIC ms / layer", "K/V in flight MiB / member",
         "transfer / compute per step (fwd)", "ring time, 32 layers (s)"], rows)

    overheads = preset_overheads(model_spec("llama-7b"), tensor_parallel_size=1, pp_size=1)
    step_rows, decision = [], {}
    for ds in ("github", "byted"):
        lengths = synthetic_lengths(ds, TOKENS, seed=0, max_length=CONTEXT)
        for ranks in (1024, 4096, 16384):
            out = {}
            for name, model in (("flat", cm), ("two-level", cm.with_(two_level_ring=True))):
                progress(f"{ds} 2M, {ranks:,} ranks, {name} ...")
                plan = make_plan(lengths, scheduler="balance", hdp_size=ranks, capacity=CAPACITY, cost_model=model,
                                 context_length=CONTEXT)
                sim = simulate_step(plan, model, overheads=overheads)
                out[name] = (plan, sim)
            (fp, fs), (tp, ts) = out["flat"], out["two-level"]
            speedup = fs.step_time_s / ts.step_time_s
            if ranks == 1024:
                decision[ds] = speedup
            fx, tx = fp.estimate.extra, tp.estimate.extra
            step_rows.append([
                f"{ds} 2M", f"{ranks:,}", f"{fs.step_time_s:.2f}", f"{ts.step_time_s:.2f}", f"{speedup:.2f}x",
                f"{fx['lower_bound_s']:.2f} / {tx['lower_bound_s']:.2f}",
                f"{fx['critical_path_s']:.2f} / {tx['critical_path_s']:.2f}",
                f"{fx['max_ring_size']} / {tx['max_ring_size']}", tp.meta.get("ring_sizing", "-"),
                f"{fx['inter_node_p2p_bytes'] / 2**40:.0f} / {tx['inter_node_p2p_bytes'] / 2**40:.0f}",
                f"{fp.estimate.p2p_bytes / 2**40:.0f} / {tp.estimate.p2p_bytes / 2**40:.0f}",
            ])
    step_table = markdown_table(
        ["batch", "HDP ranks", "step flat (s)", "step two-level (s)", "speedup", "lower bound (s) flat / 2-lvl",
         "critical path (s) flat / 2-lvl", "largest ring flat / 2-lvl", "sizing kept", "inter-node TiB flat / 2-lvl",
         "P2P TiB flat / 2-lvl"], step_rows)
    body = f"""## Two-level ring: flat vs all-gather vs head-split

`scripts/bench_two_level.py` ({time.perf_counter() - t0:.0f} s). {machine_line()} Planner cost
model `{cm.name}` (8 GPUs per node, NVLink {cm.p2p_bandwidth_intra / 1e9:.0f} GB/s, network
{cm.p2p_bandwidth_inter / 1e9:.0f} GB/s per GPU, K/V {cm.kv_bytes_per_token:,.0f} B, dK/dV (fp32)
{cm.dkv_bytes:,.0f} B, q {cm.q_bytes_per_token:,.0f} B per token and layer). Design and decision:
[docs/two_level_ring.md](two_level_ring.md).

### One 2M-token sequence on D ranks of whole nodes (per member, per layer, forward + backward)

{ring_table}

### Whole steps: 32M-token batches at 2M context, balance, flat vs two-level (c)

Planned by `balance` with and without two-level rings (with them, long rings are sized in
whole nodes; the flat-sized plan is kept when it is faster) and simulated as a whole step
(`sim.simulate_step` with the LLaMA-7B ZeRO-1 gradient reduction and optimizer).

{step_table}

At 1,024 ranks: GitHub-like {decision['github']:.2f}x, Byted-like {decision['byted']:.2f}x.
"""
    print(body)
    if not args.no_write:
        write_section("two_level", body)
        progress("wrote section 'two_level' of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
