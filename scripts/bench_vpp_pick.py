#!/usr/bin/env python
"""Benchmark (estimate only): PP-Balance planned for interleaved stages, on the Fig. 17 PP cells.

For every PP cell of Fig. 17 (LLaMA-70B and Mistral-8x7B on 8,192 GPUs, Mistral-8x22B on
12,288; GitHub-like and Byted-like 32M-token batches, seed 0; both hardware presets) and each
number of virtual stages: the plain 1F1B plan of ``balance`` (its estimate, and the same plan
timed with ``v`` virtual stages, which is what running the 1F1B plan interleaved gives), and
``make_plan(virtual_pipeline_size=v)``, which ranks the candidates by 1F1B and keeps the fastest
interleaved of the close ones (``planner/schedulers/pp_vpp.py``). Planning CPU of both, one run
each, with the estimate (on a machine doing other work: indicative).

Writes section ``pipeline-vpp-pick`` of docs/benchmarks.md.

    .venv/bin/python scripts/bench_vpp_pick.py [--vpp 2,4] [--hardware h100,paper-fit] [--only llama-70b] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.estimate import with_virtual_pipeline  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan, pp_vpp  # noqa: E402
from megatron_bytescale.planner.schedulers.pp_vpp import INTERLEAVED_SLACK  # noqa: E402
from megatron_bytescale.sim import format_tokens, paper  # noqa: E402


def cell(hardware: str, model: str, dataset: str, context: int, vpps: list[int]) -> list[dict]:
    """One row per ``v``: 1F1B step, the 1F1B plan interleaved, the interleaved pick, CPU."""
    setup = paper.paper_setup(model, hardware=hardware)
    lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)
    kw = dict(scheduler="balance", hdp_size=setup.hdp_size, capacity=setup.capacity, cost_model=setup.cost_model,
              pp_size=setup.pp_size, context_length=context, pieces=False, offload=True,
              topology=setup.topology, align=setup.align, overlong=setup.overlong, delta=setup.delta,
              num_buckets=setup.num_buckets)
    start = time.process_time()
    flat = make_plan(lengths, **kw)
    flat_cpu = time.process_time() - start
    rows = []
    for v in vpps:
        if setup.cost_model.layers_per_stage(setup.pp_size) % v:
            continue
        as_planned = with_virtual_pipeline(flat, v, setup.cost_model, setup.topology).estimate.step_time_s
        cpu, full_cpu = [], []
        for _ in range(2):  # side by side, the better of two runs each
            with every_candidate_timed_in_full():
                start = time.process_time()
                full = make_plan(lengths, virtual_pipeline_size=v, **kw)
                full_cpu.append(time.process_time() - start)
            start = time.process_time()
            picked = make_plan(lengths, virtual_pipeline_size=v, **kw)
            cpu.append(time.process_time() - start)
            if picked != full:
                raise RuntimeError(f"{hardware} {model} {dataset} v={v}: the early stop changed the pick")
        rows.append(dict(hardware=hardware, model=model, dataset=dataset, context=context, vpp=v,
                         flat=flat.estimate.step_time_s, flat_choice=_choice(flat), as_planned=as_planned,
                         picked=picked.estimate.step_time_s, picked_choice=_choice(picked),
                         picked_plain=with_virtual_pipeline(picked, 1, setup.cost_model,
                                                            setup.topology).estimate.step_time_s,
                         finalists=picked.meta["interleaved_timed"], rank=picked.meta["interleaved_rank"],
                         flat_cpu=flat_cpu, cpu=min(cpu), full_cpu=min(full_cpu)))
    return rows


@contextlib.contextmanager
def every_candidate_timed_in_full():
    """PP-Balance's interleaved pick without its early stop (``stop_above``), for what it saves."""
    full = pp_vpp.finish_times
    pp_vpp.finish_times = lambda *a, stop_above=None, **k: full(*a, **k)
    try:
        yield
    finally:
        pp_vpp.finish_times = full


def _choice(plan) -> str:
    return f"{plan.meta.get('offload_choice', 'eq3')}, {plan.meta['assignment']}"


def section(rows: list[dict], hardware: list[str]) -> str:
    parts = [
        "## Pipeline: PP-Balance planned for interleaved stages (`scripts/bench_vpp_pick.py`)",
        "",
        machine_line() + " Estimates only; planning CPU with virtual stages is the better of two runs, with and "
        "without the early stop taken in turn; 1F1B's is one run (a shared machine: indicative).",
        "",
        "Fig. 17 PP cells (32M-token batches, seed 0, C = 8K, the paper's GPU counts and TP x PP). "
        "'1F1B' is `balance`'s plain 1F1B plan and its estimated step; '1F1B plan, interleaved' is that "
        "plan run with v virtual stages per stage (the plan the planner gave before it planned for "
        "them); 'picked' is `make_plan(virtual_pipeline_size=v)`: the candidates ranked by 1F1B, those "
        f"within {INTERLEAVED_SLACK:.0%} of the best in 1F1B timed interleaved, the "
        "fastest kept. 'gain' is '1F1B plan, "
        "interleaved' over 'picked'; 'picked in plain 1F1B' is the pick's own plain 1F1B step over the 1F1B "
        "winner's; 'kept' is the pick's place among those timed, in their 1F1B order (0: the "
        "1F1B winner). 'no stop': every candidate timed in full, without the early stop of those "
        "that cannot beat the fastest so far (the same picks, checked). **bold**: slower interleaved than "
        "the 1F1B plan in plain 1F1B.",
    ]
    for hw in hardware:
        sub = [r for r in rows if r["hardware"] == hw]
        if not sub:
            continue
        table = []
        for r in sub:
            def mark(x: float, r=r) -> str:
                return f"**{x:.2f}**" if x > r["flat"] * (1 + 1e-9) else f"{x:.2f}"
            table.append([r["model"], r["dataset"], format_tokens(r["context"]), r["vpp"], f"{r['flat']:.2f}",
                          mark(r["as_planned"]), mark(r["picked"]), f"{r['as_planned'] / r['picked']:.3f}x",
                          f"{r['picked_plain'] / r['flat']:.3f}x",
                          r["picked_choice"] if r["picked_choice"] != r["flat_choice"] else "same as 1F1B",
                          f"{r['finalists']} / {r['rank']}", f"{r['flat_cpu']:.2f}", f"{r['cpu']:.2f}",
                          f"{r['full_cpu']:.2f}"])
        gains = [r["as_planned"] / r["picked"] for r in sub]
        slower_before = sum(r["as_planned"] > r["flat"] * (1 + 1e-9) for r in sub)
        slower_after = sum(r["picked"] > r["flat"] * (1 + 1e-9) for r in sub)
        changed = sum(r["picked_choice"] != r["flat_choice"] for r in sub)
        worst_plain = max(r["picked_plain"] / r["flat"] for r in sub)
        summary = (f"{len(sub)} cell x v rows: the pick differs from the 1F1B winner in {changed} (in plain 1F1B "
                   f"at most {worst_plain:.3f}x slower than it); gain "
                   f"{min(gains):.3f}-{max(gains):.3f}x (median {statistics.median(gains):.3f}x); slower "
                   f"interleaved than plain 1F1B in {slower_before} rows before, {slower_after} after. Planning "
                   f"CPU median {statistics.median(r['flat_cpu'] for r in sub):.2f} s in 1F1B, "
                   f"{statistics.median(r['cpu'] for r in sub):.2f} s with virtual stages (max "
                   f"{max(r['cpu'] for r in sub):.2f} s), {statistics.median(r['full_cpu'] for r in sub):.2f} s "
                   f"(max {max(r['full_cpu'] for r in sub):.2f} s) timing every candidate in full.")
        parts += ["", f"### Hardware preset `{hw}`", "", summary, "",
                  markdown_table(["model", "dataset", "context", "v", "1F1B s", "1F1B plan, interleaved s",
                                  "picked s", "gain", "picked in plain 1F1B / 1F1B", "picked (offload, assignment)",
                                  "timed interleaved / kept",
                                  "plan CPU s 1F1B", "plan CPU s picked", "plan CPU s picked, no stop"], table)]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vpp", default="2,4", help="comma-separated virtual stages per stage")
    ap.add_argument("--hardware", default="h100,paper-fit")
    ap.add_argument("--only", default=None, help="comma-separated models (default: the three PP models)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    vpps = [int(v) for v in args.vpp.split(",")]
    hardware = args.hardware.split(",")
    models = args.only.split(",") if args.only else list(paper.PP_BALANCE_MODELS)
    rows: list[dict] = []
    for hw in hardware:
        for model in models:
            for dataset in ("github", "byted"):
                for context in paper.FIG17_CONTEXTS:
                    if context > paper.FIG17_MAX_CONTEXT.get(model, 1 << 40):
                        continue
                    for r in cell(hw, model, dataset, context, vpps):
                        rows.append(r)
                        print(f"[bench_vpp_pick] {hw} {model} {dataset} {format_tokens(context)} v={r['vpp']}: "
                              f"1F1B {r['flat']:.2f} s, its plan interleaved {r['as_planned']:.2f} s, picked "
                              f"{r['picked']:.2f} s ({r['cpu']:.1f} s CPU)", file=sys.stderr, flush=True)
    body = section(rows, hardware)
    if args.no_write:
        print(body)
    else:
        write_section("pipeline-vpp-pick", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
