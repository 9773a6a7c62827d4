#!/usr/bin/env python
"""Benchmark (estimate only): splitting PP-Balance's long rings into causal chunks where it pays.

For every Fig. 17 PP cell (seed 0, the reproduction's setup, hardware preset ``paper-fit`` by
default): PP-Balance's plan, then ``planner.chunk_estimate.split_where_faster``, which splits
its longest ring micro-batches into 2, 4 or 8 chunks (the ``cached`` costing the runtime builds)
and keeps a split only where the estimated step shrinks. The table shows the micro-batch phase
before and after, the step speedup (gradient reduction and optimizer added to both sides),
the splits kept, and the CPU time of the decision. For comparison it also shows the best
after-the-fact split of ``scripts/bench_pipeline_floor.py``, which does not require valid plans
(rings may lose their common local index). This is an upper bound on what a scheduler that
plans with chunks could reach. Memory is not counted here (``fit_memory=False``): these are the
gains if the kept prefix were free; ``scripts/bench_seq_split_sim.py`` shows what the planner
keeps when it counts it against the capacity.

Writes section ``seq_split_planned`` of docs/benchmarks.md.

    .venv/bin/python scripts/bench_seq_split.py [--hardware paper-fit] [--only llama-70b] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.chunk_estimate import split_where_faster  # noqa: E402
from megatron_bytescale.planner.pipeline_floor import time_plan  # noqa: E402
from megatron_bytescale.sim import format_tokens, paper  # noqa: E402
from megatron_bytescale.sim.step import simulate_step  # noqa: E402
from megatron_bytescale.sim.variants import VARIANTS, plan_for  # noqa: E402


def cell(model: str, dataset: str, context: int, hardware: str) -> list[object]:
    setup = paper.paper_setup(model, hardware=hardware)
    cm = setup.cost_model
    lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)
    plan, _ = plan_for(lengths, VARIANTS["balance"], setup, context_length=context)
    base = simulate_step(plan, cm, overheads=setup.overheads, tensor_parallel_size=setup.tensor_parallel_size)
    fixed = base.step_time_s - base.micro_batch_phase_s
    start = time.process_time()
    split = split_where_faster(plan, cm, fit_memory=False)  # the gain if memory were free
    decide_s = time.process_time() - start
    after = split.estimate.step_time_s if split is not plan else base.micro_batch_phase_s
    groups = sorted({(mb.order - mb.chunk[0], mb.chunk[1]) for rp in split.ranks for mb in rp.micro_batches
                     if mb.chunk is not None})  # fmt: skip
    free = [time_plan(plan, cm, split_chunks=k, split_costing="cached", split_min_seconds=f * max_stage(plan, cm))
            for k in (2, 4, 8) for f in (0.0, 0.5, 1.0)]  # fmt: skip
    free_best = min((r.step_s for r in free if r is not None), default=None)
    speed = (base.micro_batch_phase_s + fixed) / (after + fixed)
    return [model, dataset, format_tokens(context), f"{base.micro_batch_phase_s:.1f}", f"{after:.1f}",
            f"{speed:.2f}x", ", ".join(f"k={k}" for _, k in groups) or "none", f"{decide_s:.1f}",
            "-" if free_best is None else f"{free_best:.1f} ({(base.micro_batch_phase_s + fixed) / (free_best + fixed):.2f}x)"]


def max_stage(plan, cm) -> float:
    from megatron_bytescale.planner.estimate import micro_batch_costs

    return float(micro_batch_costs(plan, cm).seconds.max(initial=0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated models (default: the three PP models)")
    ap.add_argument("--hardware", default="paper-fit")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    models = args.only.split(",") if args.only else list(paper.PP_BALANCE_MODELS)
    rows = []
    for model in models:
        for dataset in ("github", "byted"):
            for ctx in paper.FIG17_CONTEXTS:
                if ctx > paper.FIG17_MAX_CONTEXT.get(model, 1 << 40):
                    continue
                rows.append(cell(model, dataset, ctx, args.hardware))
                print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    headers = ["model", "data", "context", "balance phase s", "after split_where_faster s", "step speedup",
               "splits kept", "decision CPU s", "best after-the-fact cached split s (step speedup)"]
    table = markdown_table(headers, rows)
    print(table)
    if args.no_write:
        return
    intro = (
        "## Sequence split planned where it pays (`scripts/bench_seq_split.py`)\n\n" + machine_line()
        + f"\n\nEstimate only, hardware preset `{args.hardware}`, seed-0 batches of the Fig. 17 PP cells. "
        "PP-Balance's plan, then `split_where_faster`: its 4 longest rings, each split into 2, 4 or 8 causal chunks "
        "(the `cached` costing the runtime builds) only where the estimated step shrinks, and only where the plan "
        "stays valid (every later ring at one local index on its members); the kept prefix's memory is not counted "
        "(`bench_seq_split_sim.py`, section `seq_split_sim`, counts it). The last column is "
        "`bench_pipeline_floor`'s best split after the fact, which ignores that rule ('-': every such split of "
        "that plan deadlocks, the later rings of a split ring's members no longer meeting). Decision CPU time on this "
        "shared machine (noisy). See docs/pipeline.md.\n\n"
    )
    write_section("seq_split_planned", intro + table)


if __name__ == "__main__":
    main()
