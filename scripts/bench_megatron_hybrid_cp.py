#!/usr/bin/env python
"""Megatron's own hybrid CP vs ByteScale; writes section ``megatron-hybrid-cp`` of
docs/benchmarks.md.

The "Megatron hybrid CP" row is megatron-core 0.19's own scheduler
(``hybrid_cp_schedule.BalancedCPScheduler``, what ``--hybrid-context-parallel`` runs), called
through ``integration.megatron_hybrid_cp`` on the same batches as the planner's schedulers, and
costed by the same estimator (LLaMA-7B on H100, C = 8K, offload on for balance). Also shown:
``pow2``, the planner's own re-implementation of Megatron's hybrid CP rules, and ``static``.
Needs megatron-core 0.19 (Python 3.12: ``.venv312``); on 0.16.1 it prints why not and writes
nothing.

Usage: ``.venv312/bin/python scripts/bench_megatron_hybrid_cp.py [--no-write]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.integration.megatron_hybrid_cp import (  # noqa: E402
    megatron_hybrid_cp_unavailable,
    plan_megatron_hybrid_cp,
)
from megatron_bytescale.planner.presets import preset_cost_model  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402

CASES = (("github", 8 * 2**20, 262_144, 64), ("byted", 8 * 2**20, 262_144, 64),
         ("github", 32 * 2**20, 2_097_152, 256), ("byted", 32 * 2**20, 2_097_152, 256))
CAPACITY = 8192
OURS = ("balance", "pow2", "static")


def progress(msg: str) -> None:
    print(f"[bench_megatron_hybrid_cp] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    why = megatron_hybrid_cp_unavailable()
    if why is not None:
        print(f"Megatron hybrid CP is unavailable here: {why}", file=sys.stderr)
        return 2
    cm = preset_cost_model("llama-7b")
    load_before = os.getloadavg()[0]
    rows = []
    for ds, tokens, context, ranks in CASES:
        lengths = synthetic_lengths(ds, tokens, seed=0, max_length=context)
        steps, ms = {}, {}
        for name in OURS:
            progress(f"{ds} {ranks} ranks {name} ...")
            t0 = time.perf_counter()
            plan = make_plan(lengths, scheduler=name, hdp_size=ranks, capacity=CAPACITY,
                             cost_model=cm, context_length=context)
            ms[name], steps[name] = (time.perf_counter() - t0) * 1e3, plan.estimate.step_time_s
        progress(f"{ds} {ranks} ranks megatron-hybrid-cp ...")
        t0 = time.perf_counter()
        plan = plan_megatron_hybrid_cp(lengths, hdp_size=ranks, capacity=CAPACITY,
                                       cost_model=cm, context_length=context)
        ms["megatron"] = (time.perf_counter() - t0) * 1e3
        e = plan.estimate
        rows.append([
            ds, f"{tokens // 2**20}M / {context // 1024}K", f"{ranks:,}", f"{len(lengths):,}",
            f"{steps['balance']:.2f}", f"{e.step_time_s:.2f}", f"{steps['pow2']:.2f}",
            f"{steps['static']:.2f}", f"{e.step_time_s / steps['balance']:.2f}x",
            f"{plan.meta['num_groups']}", f"{e.extra['balance_ratio']:.2f}",
            f"{ms['megatron']:.0f} / {ms['balance']:.0f}",
        ])
    load_after = os.getloadavg()[0]
    head = ["dataset", "tokens / context", "ranks", "sequences", "balance step (s)",
            "Megatron hybrid CP step (s)", "pow2 step (s)", "static step (s)",
            "Megatron / balance", "Megatron groups (barriers + 1)", "Megatron balance ratio",
            "plan ms (Megatron / balance)"]
    body = "\n".join([
        "## Megatron's own hybrid CP (megatron-core 0.19) as a baseline",
        "",
        "`scripts/bench_megatron_hybrid_cp.py`: megatron-core 0.19's own hybrid context-parallel "
        "scheduler (`BalancedCPScheduler.get_groups_and_subsamples`, what "
        "`--hybrid-context-parallel` runs), called on the same synthetic batches as ByteScale's "
        "schedulers and costed by the same estimator (LLaMA-7B on H100, capacity 8K; balance with "
        "offload). `pow2` is the planner's own re-implementation of Megatron's rules; `static` is "
        "DP x CP. The same row is in `bytescale plan --compare` (megatron-hybrid-cp) where "
        "megatron-core 0.19 is installed.",
        "",
        machine_line() + f" Load average {load_before:.1f} before, {load_after:.1f} after "
        "(a shared machine: the planning times are noisy, the step estimates are not).",
        "",
        markdown_table(head, rows),
    ])
    if args.no_write:
        print(body)
    else:
        write_section("megatron-hybrid-cp", body)
        print("wrote section megatron-hybrid-cp of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
