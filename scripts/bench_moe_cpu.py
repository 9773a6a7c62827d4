#!/usr/bin/env python
"""Benchmark: a small MoE model on 4 CPU ranks, HDP balance against static CP, measured.

4 gloo ranks, one thread each, HDP 4 (TP = PP = EP = 1): a 2-layer megatron-core GPT whose MLPs
are megatron-core's MoE layer (4 experts, top-2, the alltoall dispatcher, experts one by one:
``SequentialMLP``), trained on the Byted-like length mix scaled to the capacity (``bytescale
demo``'s ``synthetic-byted``), planned by ``static`` (static CP: every micro-batch on one ring
of the CP size the context needs) and ``balance`` (Alg. 2). The planner's cost model is
calibrated on this MoE model first (``calibrate_cost_model``, what ``bytescale profile
--num-experts`` runs). Per scheduler, median over the measured steps (one warm-up step
dropped): step wall time (slowest rank: micro-batches and gradient reduction), busy CPU time
(max / mean over ranks), the ring P2P bytes the runtime's counters saw, and the **all-to-all
bytes**: every ``torch.distributed.all_to_all_single`` call of the process is counted (bytes
sent to other ranks, ``(n - 1) / n`` of the input over a group of n). At EP 1 megatron-core's
dispatcher never calls it (its expert group is the rank itself), so the count is 0: that is the
measurement, not a default. The planner's prediction for the same steps at EP 2 (the cost
model's ``4 k h dtype (E - 1) / E`` bytes per token and layer) is printed next to it.

Caveat: 4 processes share 2 cores (and the machine is shared), so wall times include waiting
for a core; busy CPU time is the steadier measure.

Writes block ``moe_cpu`` of docs/benchmarks.md (section "moe").

    .venv/bin/python scripts/bench_moe_cpu.py [--steps 3] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

WORLD = 4
SCHEDULERS = ("static", "balance")
LABELS = {"static": "static CP", "balance": "HDP balance"}
EXPERTS, TOPK, HIDDEN, LAYERS = 4, 2, 64, 2


def settings(steps: int):
    from megatron_bytescale.tools.demo_settings import DemoSettings

    return DemoSettings(datasets=("synthetic-byted",), ranks=WORLD, steps=steps + 1, capacity=256,
                        context_length=1024, micro_batches_per_rank=4, num_layers=LAYERS,
                        hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=128)  # fmt: skip


class AllToAllCounter:
    """Counts the bytes every ``all_to_all_single`` call of this process sends to other ranks."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls = 0

    def install(self) -> None:
        import torch.distributed as dist

        original = dist.all_to_all_single

        def counted(output, input, *args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            n = dist.get_world_size(group)
            self.calls += 1
            self.bytes_sent += int(input.numel() * input.element_size() * (n - 1) / n)
            return original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted

    def take(self) -> tuple[int, int]:
        out = (self.bytes_sent, self.calls)
        self.bytes_sent = self.calls = 0
        return out


def worker(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration import (
        ByteScaleConfig,
        build_gpt_model,
        calibrate_cost_model,
        initialize_hdp_model_parallel,
        make_step_planner,
        make_transformer_config,
        run_hdp_step,
        seed_model_parallel,
        wrap_for_hdp,
    )
    from megatron_bytescale.runtime import CommCounters
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron
    from megatron_bytescale.tools.demo_data import demo_global_batches

    enable_cpu_megatron()
    counter = AllToAllCounter()
    counter.install()
    import torch

    probe = torch.ones(world_size * 16, dtype=torch.float32)  # the counter itself, checked once:
    dist.all_to_all_single(torch.empty_like(probe), probe)  # 3/4 of 256 bytes leave the rank
    counter_check = counter.take() == (world_size * 16 * 4 * (world_size - 1) // world_size, 1)
    s = settings(steps)
    batches, _ = demo_global_batches("synthetic-byted", s)

    def model():
        config = make_transformer_config(
            num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads,
            num_query_groups=s.num_query_groups, ffn_hidden_size=s.ffn_hidden_size,
            num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=s.ffn_hidden_size,
            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
            add_bias_linear=False,
        )  # fmt: skip
        return build_gpt_model(config, vocab_size=256, max_sequence_length=s.context_length)

    manager = initialize_hdp_model_parallel()
    seed_model_parallel(s.seed)
    head_dim = s.hidden_size // s.num_attention_heads
    cost_model = calibrate_cost_model(model(), manager, lengths=s.effective_calibration_lengths,
                                      kv_bytes_per_token=2 * s.num_query_groups * head_dim * 4,
                                      vocab_size=256).cost_model
    out: dict[str, Any] = {"rank": rank, "cost_model": cost_model.to_dict(), "runs": {},
                           "counter_check": counter_check}
    for scheduler in SCHEDULERS:
        seed_model_parallel(s.seed)
        ddp, optimizer = wrap_for_hdp(model(), lr=s.lr)
        config = ByteScaleConfig(hdp=True, capacity=s.capacity, context_length=s.context_length,
                                 scheduler=scheduler, offload=False)
        planner = make_step_planner(config, hdp_size=manager.size, cost_model=cost_model)
        records = []
        for index, step in enumerate(HDPDataIterator(batches, planner=planner, hdp=manager.hdp)):
            counters = CommCounters()
            dist.barrier()
            counter.take()
            record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager, counters=counters)
            a2a_bytes, a2a_calls = counter.take()
            if index == 0:
                continue  # warm-up
            records.append({
                "step_wall_s": record.micro_batches_done_at - record.started_at + record.reduce_wall_s,
                "busy_cpu_s": record.busy_s,
                "ring_bytes": counters.steps[-1].total.bytes_sent if counters.steps else 0,
                "a2a_bytes": a2a_bytes, "a2a_calls": a2a_calls,
                "tokens": step.total_tokens,
                "counts": step.plan.micro_batch_counts(),
                "rings": sorted(step.plan.ring_sizes()),
            })
        out["runs"][scheduler] = records
    return out


def section(results: list[dict[str, Any]], steps: int) -> str:
    from megatron_bytescale.planner.moe_cost import a2a_bytes_per_token

    per_token_ep2 = a2a_bytes_per_token(hidden_size=HIDDEN, topk=TOPK, element_size=4, expert_parallel_size=2)
    rows = []
    for scheduler in SCHEDULERS:
        per_rank = {r["rank"]: r["runs"][scheduler] for r in results}
        n = len(per_rank[0])
        wall = statistics.median(max(per_rank[rk][i]["step_wall_s"] for rk in per_rank) for i in range(n))
        busy = [statistics.median(x["busy_cpu_s"] for x in per_rank[rk]) for rk in per_rank]
        ring = statistics.median(sum(per_rank[rk][i]["ring_bytes"] for rk in per_rank) for i in range(n))
        a2a = sum(x["a2a_bytes"] for rk in per_rank for x in per_rank[rk])
        calls = sum(x["a2a_calls"] for rk in per_rank for x in per_rank[rk])
        tokens = statistics.median(per_rank[0][i]["tokens"] for i in range(n))
        first = per_rank[0][0]
        rows.append([
            LABELS[scheduler], "/".join(map(str, first["counts"])),
            ",".join(map(str, sorted(set(first["rings"])))), f"{wall:.3f}",
            f"{max(busy):.3f} / {statistics.mean(busy):.3f}", f"{ring / 1e6:.2f}",
            f"{a2a} ({calls} calls)", f"{LAYERS * per_token_ep2 * tokens / 1e6:.2f}",
        ])
    if not all(r["counter_check"] for r in results):
        raise RuntimeError("the all-to-all counter missed a known all_to_all_single call; its counts are void")
    static_wall = float(rows[0][3])
    balance_wall = float(rows[1][3])
    return "\n".join([
        "### MoE on 4 CPU ranks: HDP balance against static CP (`scripts/bench_moe_cpu.py`)",
        "",
        f"2-layer GPT, hidden {HIDDEN}, MoE MLP ({EXPERTS} experts, top-{TOPK}, alltoall dispatcher, "
        "SequentialMLP), fp32, HDP 4 with TP = PP = EP = 1, capacity 256, context 1K, Byted-like "
        f"lengths (bytescale demo's synthetic-byted), cost model calibrated on this MoE model; {steps} "
        "measured steps after one warm-up, medians. 'all-to-all bytes' counts every "
        "`all_to_all_single` call of the 4 processes over the measured steps (the counter is checked "
        "on one known call first): megatron-core's "
        "dispatcher makes none at EP 1 (each expert group is one rank). 'EP 2 prediction' is the "
        "cost model's all-to-all bytes per step for the same tokens at EP 2 (4 k h dtype (E-1)/E "
        "per token and layer, summed over ranks; zigzag padding left out): expert parallelism is another branch's runtime.",
        "",
        markdown_table(["scheduler", "micro-batches per rank (step 1)", "ring sizes", "step wall s",
                        "busy CPU s (max / mean)", "ring P2P MB / step", "all-to-all bytes (measured)",
                        "EP 2 prediction MB / step"], rows),
        "",
        f"Balance over static: {static_wall / balance_wall:.2f}x step wall time.",
        "",
        f"_{machine_line()} Shared 2-core machine, load average {os.getloadavg()[0]:.1f} at the end: "
        "wall times are noisy; CPU time is the steadier measure._",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per scheduler (default 3)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps ({args.steps}) must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_bytescale.testing.distributed import run_distributed

    results = run_distributed(WORLD, worker, args.steps, timeout_s=1800)
    body = section(results, args.steps)
    if args.no_write:
        print(body)
    else:
        write_section("moe_cpu", body)
        print("[bench_moe_cpu] wrote block 'moe_cpu' of docs/benchmarks.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
