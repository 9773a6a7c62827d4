#!/usr/bin/env python
"""What checking a plan costs next to making it; writes section ``validation`` of docs/benchmarks.md.

The HDP data iterator validates every plan (``StepPlan.validate``) and also proves it
deadlock-free by simulation (``check_deadlock_free``) before any rank trains on it. This measures
both against planning itself (``make_plan`` with the estimate) on the 32M-token Byted-like and
GitHub-like batches (2M context, C = 8K, LLaMA-7B preset) at 1,024 and 16,384 HDP ranks, PP 1 and
PP 4 (median of ``--repeats`` runs, CPU time of this process), so the choice in docs/testing.md
rests on numbers.

Usage: ``.venv/bin/python scripts/bench_validation.py [--repeats 3] [--no-write]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.order import check_deadlock_free  # noqa: E402
from megatron_bytescale.planner.presets import preset_cost_model  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402

CASES = [(1024, 1), (16384, 1), (1024, 4)]


def cpu_ms(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.process_time()
        out = fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    cm = preset_cost_model("llama-7b")
    rows = []
    for dataset in ("byted", "github"):
        lengths = synthetic_lengths(dataset, 32 * 2**20, seed=0, max_length=2_097_152)
        for ranks, pp in CASES:
            print(f"[bench_validation] {dataset} {ranks} ranks PP {pp} ...", file=sys.stderr, flush=True)
            plan_ms, plan = cpu_ms(lambda: make_plan(lengths, scheduler="balance", hdp_size=ranks,
                                                     capacity=8192, cost_model=cm, pp_size=pp,
                                                     context_length=2_097_152), args.repeats)
            validate_ms, _ = cpu_ms(plan.validate, args.repeats)
            deadlock_ms, _ = cpu_ms(lambda: check_deadlock_free(plan), args.repeats)
            entries = sum(plan.micro_batch_counts())
            rows.append([dataset, f"{ranks:,}", pp, f"{entries:,}", f"{plan_ms:.0f}", f"{validate_ms:.0f}",
                         f"{deadlock_ms:.0f}", f"{deadlock_ms / (plan_ms + validate_ms):.0%}"])
    body = (
        "## validation: cost of validate() and of the deadlock check next to planning\n\n"
        f"`scripts/bench_validation.py`, CPU ms (median of {args.repeats}), balance scheduler, 32M tokens. "
        + machine_line() + "\n\n"
        + markdown_table(["dataset", "HDP ranks", "PP", "rank micro-batches", "make_plan ms", "validate ms",
                          "deadlock check ms", "check / (plan + validate)"], rows) + "\n"
    )
    if args.no_write:
        print(body)
    else:
        write_section("validation", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
