#!/usr/bin/env python
"""Benchmark: dynamic HDP rings vs static context parallelism, ring attention only.

On 4 CPU ranks (gloo, one thread each), one long-tail global batch (mostly short sequences, a
few long ones) is planned three ways and run through ``ring_attention`` forward + backward with
the same kernels (aten CPU flash attention):

* ``hdp-balance`` / ``hdp-naive``: the planner's schedulers (paper Alg. 2 / Alg. 1) without
  offload: short sequences are packed on one rank and never communicate, long sequences get
  just enough ranks (ceil(length / C)).
* ``static-cp``: the planner's static baseline: every micro-batch packs sequences and is split
  over all 4 ranks (CP = 4, per-document zigzag).

Reported per scheme: measured P2P bytes (all ranks, one step) next to the runtime formula
(:func:`plan_p2p_bytes`), the step's attention time (fwd + bwd, barrier to barrier, median of
several runs), and per-rank time in kernels vs blocked on transfers; then HDP/static ratios.
Writes section ``attention`` of docs/benchmarks.md.

    .venv/bin/python scripts/bench_attention.py [--runs 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.planner import PlanBuilder, StepPlan  # noqa: E402
from megatron_bytescale.runtime import (  # noqa: E402
    CommCounters,
    HDPGroup,
    TorchBackend,
    layout_for,
    plan_p2p_bytes,
    ring_attention,
)
from megatron_bytescale.runtime.ring_schedule import attention_block, take_rows  # noqa: E402
from megatron_bytescale.testing.distributed import run_distributed  # noqa: E402

WORLD = 4
CAPACITY = 1024  # tokens per rank per micro-batch
N_Q, N_KV, HEAD_DIM = 4, 2, 64  # GQA
SEED = 7


def long_tail_lengths(seed: int = SEED) -> list[int]:
    """Mostly short documents (32..384 tokens) plus two long ones (3 and 1.5 contexts of C)."""
    rng = random.Random(seed)
    short = [int(min(384, max(32, rng.lognormvariate(4.8, 0.6)))) for _ in range(40)]
    return [3 * CAPACITY, 3 * CAPACITY // 2, *short]


# ---------------------------------------------------------------------- plans
def _plan_with_planner(lengths: list[int], scheduler: str) -> StepPlan | None:
    try:
        from megatron_bytescale.planner.presets import preset_cost_model
        from megatron_bytescale.planner.schedulers import make_plan
    except ImportError:
        return None
    return make_plan(
        lengths,
        scheduler=scheduler,
        hdp_size=WORLD,
        capacity=CAPACITY,
        cost_model=preset_cost_model(),
        offload=False,
    ).validate()


def _hdp_by_hand(lengths: list[int]) -> StepPlan:
    """Fallback without the planner: long sequences on ceil(len/C) ranks, shorts packed locally."""
    builder = PlanBuilder(hdp_size=WORLD, capacity=CAPACITY, lengths=dict(enumerate(lengths)))
    load = [0] * WORLD
    for sid, n in sorted(enumerate(lengths), key=lambda x: -x[1]):
        if n > CAPACITY:
            ranks = sorted(range(WORLD), key=lambda r: load[r])[: -(-n // CAPACITY)]
            builder.add(ranks, [sid])
            for r in ranks:
                load[r] += n / len(ranks)
    bins: list[list[int]] = [[] for _ in range(WORLD)]
    fill = [0] * WORLD
    for sid, n in sorted(enumerate(lengths), key=lambda x: -x[1]):
        if n <= CAPACITY:
            r = min(range(WORLD), key=lambda r: load[r])
            if fill[r] + n > CAPACITY:
                builder.add([r], bins[r])
                bins[r], fill[r] = [], 0
            bins[r].append(sid)
            fill[r] += n
            load[r] += n
    for r in range(WORLD):
        if bins[r]:
            builder.add([r], bins[r])
    return builder.build(scheduler="hdp-by-hand").validate()


def _static_by_hand(lengths: list[int]) -> StepPlan:
    """Fallback without the planner: first-fit packs of <= WORLD * C tokens, each over all ranks."""
    builder = PlanBuilder(hdp_size=WORLD, capacity=CAPACITY, lengths=dict(enumerate(lengths)))
    current, total = [], 0
    for sid, n in enumerate(lengths):
        if total + n > WORLD * CAPACITY and current:
            builder.add(range(WORLD), current)
            current, total = [], 0
        current.append(sid)
        total += n
    builder.add(range(WORLD), current)
    return builder.build(scheduler="static-by-hand").validate()


def build_plans(lengths: list[int]) -> dict[str, StepPlan]:
    plans = {}
    for scheme, scheduler in (
        ("hdp-balance", "balance"),
        ("hdp-naive", "naive"),
        ("static-cp", "static"),
    ):
        plan = _plan_with_planner(lengths, scheduler)
        if plan is None:
            plan = _static_by_hand(lengths) if scheduler == "static" else _hdp_by_hand(lengths)
            scheme += " (PlanBuilder)"
        plans[scheme] = plan
    return plans


# ---------------------------------------------------------------------- per-rank body
def _local_tensors(layout, seed: int):
    g = torch.Generator().manual_seed(seed)
    T = layout.num_tokens
    return (
        torch.randn(T, N_Q, HEAD_DIM, generator=g).requires_grad_(),
        torch.randn(T, N_KV, HEAD_DIM, generator=g).requires_grad_(),
        torch.randn(T, N_KV, HEAD_DIM, generator=g).requires_grad_(),
        torch.randn(T, N_Q, HEAD_DIM, generator=g),
    )


def _run_step(rank: int, plan: StepPlan, hdp: HDPGroup, counters: CommCounters) -> float:
    """This rank's micro-batches, fwd + bwd each; returns the rank's busy wall time."""
    inputs = []
    for index, mb in enumerate(plan.ranks[rank].micro_batches):
        layout = layout_for(plan, hdp, index)
        inputs.append((mb.order, layout, _local_tensors(layout, SEED + mb.order)))
    dist.barrier()
    start = time.perf_counter()
    for order, layout, (q, k, v, dout) in inputs:
        counters.start_micro_batch(order)
        out = ring_attention(q, k, v, layout, hdp, counters=counters, backend="torch")
        out.backward(dout)
    busy = time.perf_counter() - start
    dist.barrier()
    return busy


def bench_body(rank: int, world: int, plans: dict[str, StepPlan], runs: int) -> dict:
    hdp = HDPGroup()
    results = {}
    for scheme, plan in plans.items():
        _run_step(rank, plan, hdp, CommCounters())  # warm-up
        steps = []
        for _ in range(runs):
            counters = CommCounters()
            dist.barrier()
            t0 = time.perf_counter()
            busy = _run_step(rank, plan, hdp, counters)
            wall = time.perf_counter() - t0
            total = counters.end_step().total
            steps.append(
                dict(
                    wall=wall,
                    busy=busy,
                    sent=total.bytes_sent,
                    compute=total.compute_s,
                    wait=total.wait_s,
                    calls=total.p2p_calls,
                )
            )
        results[scheme] = steps
        if rank == 0:
            print(f"  {scheme}: {runs} runs done", flush=True)
    return results


def sequential_kernel_ms(plan: StepPlan, reps: int = 5) -> float:
    """Kernel work of a plan: every block of every rank, fwd + bwd, one after the other in this
    process (no communication, no competing ranks); the minimum total over ``reps`` (the
    least disturbed by other processes on the machine)."""
    torch.set_num_threads(1)
    backend = TorchBackend()
    blocks = []
    for rank in range(plan.hdp_size):
        for index in range(len(plan.ranks[rank].micro_batches)):
            layout = layout_for(plan, rank, index)
            q, k, v, dout = (t.detach() for t in _local_tensors(layout, SEED))
            for source in range(layout.ring.size):
                block = attention_block(layout, source)
                if block is not None:
                    blocks.append((block, q, k, v, dout))
    totals = []
    for _ in range(reps):
        start = time.perf_counter()
        for block, q, k, v, dout in blocks:
            qq, dd = take_rows(q, block.q_spans), take_rows(dout, block.q_spans)
            kk, vv = take_rows(k, block.k_spans), take_rows(v, block.k_spans)
            kw = dict(causal=block.causal, scale=HEAD_DIM**-0.5)
            out, lse = backend.forward(qq, kk, vv, block.segments, **kw)
            backend.backward(dd, qq, kk, vv, out, lse, block.segments, **kw)
        totals.append(time.perf_counter() - start)
    return min(totals)


# ---------------------------------------------------------------------- report
def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def summarise(
    plans: dict[str, StepPlan], per_rank: list[dict], runs: int, kernel: dict[str, float]
) -> tuple[str, dict]:
    rows, summary = [], {}
    for scheme, plan in plans.items():
        step_times = [
            max(per_rank[r][scheme][i]["wall"] for r in range(WORLD)) for i in range(runs)
        ]
        med = statistics.median(step_times)
        sent = [per_rank[r][scheme][0]["sent"] for r in range(WORLD)]
        formula = plan_p2p_bytes(plan, num_kv_heads=N_KV, head_dim=HEAD_DIM, element_size=4)
        compute = [
            statistics.median(s["compute"] for s in per_rank[r][scheme]) for r in range(WORLD)
        ]
        wait = [statistics.median(s["wait"] for s in per_rank[r][scheme]) for r in range(WORLD)]
        summary[scheme] = dict(
            time=med, bytes=sum(sent), compute=compute, wait=wait, kernel=kernel[scheme]
        )
        rows.append(
            [
                scheme,
                "/".join(str(n) for n in plan.micro_batch_counts()),
                " ".join(str(n) for n in plan.ring_sizes()),
                f"{sum(sent) / 1e6:.2f}",
                f"{formula / 1e6:.2f}",
                f"{_ms(med)} ({_ms(min(step_times))}-{_ms(max(step_times))})",
                " / ".join(_ms(c) for c in compute),
                " / ".join(_ms(w) for w in wait),
                _ms(kernel[scheme]),
            ]
        )
    table = markdown_table(
        [
            "scheme",
            "micro-batches per rank",
            "ring sizes",
            "P2P MB (measured)",
            "P2P MB (formula)",
            "attn fwd+bwd ms, median (min-max)",
            "compute ms per rank",
            "wait ms per rank",
            "kernel work ms (1 process)",
        ],
        rows,
    )
    static = summary.get("static-cp") or next(
        v for k, v in summary.items() if k.startswith("static")
    )
    ratio_rows = []
    for scheme, s in summary.items():
        if scheme.startswith("static"):
            continue
        ratio_rows.append(
            [
                scheme,
                f"{s['bytes'] / static['bytes']:.3f}" if static["bytes"] else "n/a",
                f"{s['time'] / static['time']:.2f}",
                f"{sum(s['wait']) / max(sum(static['wait']), 1e-9):.2f}",
                f"{sum(s['compute']) / sum(static['compute']):.2f}",
                f"{s['kernel'] / static['kernel']:.2f}",
            ]
        )
    ratios = markdown_table(
        [
            "HDP scheme / static CP",
            "P2P bytes",
            "attention time",
            "total wait",
            "total compute (4 ranks)",
            "kernel work (1 process)",
        ],
        ratio_rows,
    )
    return table, {"ratios": ratios, "summary": summary}


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def describe(
    lengths: list[int], runs: int, elapsed: float, table: str, ratios: str, load: str
) -> str:
    """The markdown section: setup, the per-scheme table, the ratios."""
    lens = sorted(lengths, reverse=True)
    setup = (
        f"`scripts/bench_attention.py --runs {runs}`: {WORLD} CPU processes (gloo, 1 thread "
        f"each; the 4 ranks share the machine's cores, so kernels of different ranks compete), "
        f"`ring_attention` forward + backward only, backend `torch` (aten CPU flash kernels), "
        f"fp32, q/k/v heads {N_Q}/{N_KV}/{N_KV} x {HEAD_DIM}. Batch: {len(lengths)} sequences, "
        f"{sum(lengths)} tokens, long tail (longest {lens[0]} and {lens[1]}; the other "
        f"{len(lens) - 2} have {min(lens)}-{lens[2]} tokens), capacity C = {CAPACITY} tokens per "
        f"rank. Plans from the planner's schedulers without offload (PlanBuilder if absent)."
    )
    legend = (
        "P2P MB: bytes sent by all ranks in one step, measured by `CommCounters` and predicted by "
        "`plan_p2p_bytes` (per member per ring call (N-1)*2*T*Nkv*H*(2e+4), e = 4 here). Time: "
        "barrier-to-barrier wall time of the step's attention (fwd+bwd of every micro-batch), "
        "median (min-max) over the runs. Compute: time in kernels and merges; wait: time blocked "
        "in a transfer's wait, which includes waiting for a ring peer that is still busy with "
        "earlier work (per rank, medians). Kernel work: every block of the plan, fwd + bwd, run "
        "one after the other in one process (no communication, no competing ranks; min of 5): "
        "the compute a scheme needs, free of the 4-ranks-on-few-cores contention."
    )
    return "\n\n".join(
        [
            "## Ring attention: dynamic HDP rings vs static CP",
            machine_line(),
            setup,
            legend,
            table,
            ratios,
            f"Total benchmark wall time {elapsed:.0f} s (spawn included). System load average "
            f"(1/5/15 min) before / after the run: {load}; other processes on the machine "
            f"compete with the 4 ranks for its cores, so compare schemes within this one run.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per scheme (median)")
    parser.add_argument(
        "--no-write", action="store_true", help="print only, do not touch docs/benchmarks.md"
    )
    args = parser.parse_args()

    lengths = long_tail_lengths()
    plans = build_plans(lengths)
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, C={CAPACITY}, {WORLD} ranks")
    for scheme, plan in plans.items():
        sizes, counts = plan.ring_sizes(), plan.micro_batch_counts()
        print(f"  {scheme}: ring sizes {sizes}, micro-batches per rank {counts}", flush=True)
    print("kernel work, one process, sequential ...", flush=True)
    kernel = {scheme: sequential_kernel_ms(plan) for scheme, plan in plans.items()}
    load_before = _load_average()
    started = time.perf_counter()
    per_rank = run_distributed(WORLD, bench_body, plans, args.runs, timeout_s=1800)
    elapsed = time.perf_counter() - started
    load = f"{load_before} / {_load_average()}"
    table, extra = summarise(plans, per_rank, args.runs, kernel)
    body = describe(lengths, args.runs, elapsed, table, extra["ratios"], load)
    print(body)
    if not args.no_write:
        write_section("attention", body)
        print("wrote section 'attention' of docs/benchmarks.md")


if __name__ == "__main__":
    main()
