#!/usr/bin/env python
"""Benchmark (simulator): PP-Balance with ``--seq-split`` on the Mistral-8x7B GitHub 1M and 2M cells.

The Fig. 17 setup of ``scripts/reproduce_paper.py`` (paper GPU count, C = 8K, ``paper-fit``,
seed-0 32M-token batch). Per cell: static, balance, balance with ``make_plan(seq_split=True)``
(splits kept only where the estimate shrinks and the kept prefix fits the capacity), and, for
reference, the split with memory not counted (``split_where_faster(..., fit_memory=False)``: a
plan that would not fit the devices). Step times are the simulator's (``simulate_step``:
micro-batch phase, gradient reduction, optimizer). The last column gives, for the 4 longest
rings, the token-equivalents a member would keep split into 2 chunks
(``planner.chunk_memory.split_resident_tokens``) against C.

Writes section ``seq_split_sim`` of docs/benchmarks.md.

    .venv/bin/python scripts/bench_seq_split_sim.py [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.chunk_estimate import split_where_faster  # noqa: E402
from megatron_bytescale.planner.chunk_memory import split_resident_tokens  # noqa: E402
from megatron_bytescale.planner.estimate import micro_batch_costs  # noqa: E402
from megatron_bytescale.sim import format_tokens, paper  # noqa: E402
from megatron_bytescale.sim.step import simulate_step  # noqa: E402
from megatron_bytescale.sim.variants import VARIANTS, plan_for  # noqa: E402

MODEL = "mistral-8x7b"
CELLS = (("github", 1 << 20), ("github", 2 << 20))


def _groups(plan) -> str:
    ks = sorted({(mb.order - mb.chunk[0], mb.chunk[1]) for rp in plan.ranks for mb in rp.micro_batches
                 if mb.chunk is not None})  # fmt: skip
    return ", ".join(f"k={k}" for _, k in ks) or "none"


def cell(dataset: str, context: int) -> list[object]:
    setup = paper.paper_setup(MODEL)
    cm = setup.cost_model
    lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)

    def step(plan) -> float:
        return simulate_step(plan, cm, overheads=setup.overheads,
                             tensor_parallel_size=setup.tensor_parallel_size).step_time_s

    static, _ = plan_for(lengths, VARIANTS["static"], setup, context_length=context)
    balance, _ = plan_for(lengths, VARIANTS["balance"], setup, context_length=context)
    start = time.process_time()
    split, _ = plan_for(lengths, VARIANTS["balance"], dataclasses.replace(setup, seq_split=True),
                        context_length=context)
    split_cpu = time.process_time() - start
    free = split_where_faster(balance, cm, fit_memory=False)
    s_static, s_bal, s_split, s_free = step(static), step(balance), step(split), step(free)
    costs = micro_batch_costs(balance, cm)
    rings = sorted([(float(costs.seconds[k]), int(o)) for k, o in enumerate(costs.orders.tolist())
                    if costs.ring_sizes[k] > 1], reverse=True)[:4]  # fmt: skip
    seq_len = balance.sequence_lengths()
    needs = []
    for _, order in rings:
        mb = next(mb for rp in balance.ranks for mb in rp.micro_batches if mb.order == order)
        need = split_resident_tokens([seq_len[s] for s in mb.seqs], mb.ring_size, 2, align=balance.align, cost_model=cm)
        needs.append(f"{need / 1e3:.1f}K")
    return [MODEL, dataset, format_tokens(context), f"{s_static:.1f}", f"{s_bal:.1f} ({s_static / s_bal:.2f}x)",
            f"{s_split:.1f} ({s_static / s_split:.2f}x)", _groups(split), f"{split_cpu:.1f}",
            f"{s_free:.1f} ({s_static / s_free:.2f}x)", _groups(free), " / ".join(needs) + f" vs C {setup.capacity // 1024}K"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = []
    for dataset, context in CELLS:
        rows.append(cell(dataset, context))
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    headers = ["model", "data", "context", "static step s", "balance s (over static)",
               "balance --seq-split s (over static)", "splits kept", "planning CPU s (balance + split)",
               "split, memory not counted s (over static)", "its splits",
               "2-chunk split of the 4 longest rings: kept token-equivalents per member"]
    table = markdown_table(headers, rows)
    print(table)
    if args.no_write:
        return
    setup = paper.paper_setup(MODEL)
    cm = setup.cost_model
    longest = setup.capacity * cm.alpha2 / (3 * cm.kv_bytes_per_token * 0.5)  # 2 chunks: half the sequence kept
    kept = "None fits here" if all(r[6] == "none" for r in rows) else "Some fit"
    intro = (
        "## PP-Balance with the sequence split, memory counted (`scripts/bench_seq_split_sim.py`)\n\n" + machine_line()
        + "\n\nSimulator, Fig. 17 setup (8,192 GPUs, C = 8K, `paper-fit`, seed-0 32M-token batch). `--seq-split` keeps "
        "a split only where the estimate shrinks and the chunks' kept prefix (every member's K/V of the earlier "
        f"chunks plus the float32 dK/dV owed: 3 x {cm.kv_bytes_per_token:,.0f} B per token per layer against "
        f"{cm.alpha2:,.0f} B of activations) fits C. {kept}: the kept prefix is the whole earlier chunks' K/V whatever "
        f"the ring width, so a 2-chunk split needs more than C for any sequence above {longest / 1e3:.0f}K tokens. "
        "The memory-not-counted columns are the "
        "estimate's gain if the prefix were free. Planning CPU time on this shared machine (noisy). "
        "See docs/pipeline.md.\n\n"
    )
    write_section("seq_split_sim", intro + table)


if __name__ == "__main__":
    main()
