#!/usr/bin/env python
"""Benchmark: what the expert-parallel (EP) constraint costs HDP balance, Mistral presets.

With ``--expert-model-parallel-size E`` the MoE all-to-all meets slot by slot inside every
expert group of E consecutive HDP ranks, so the planner must place every ring micro-batch at
the same local index on all its members and the members of a group run as many slots as the
busiest of them (``StepPlan.ep_size``; ``make_plan(..., ep_size=E)``, which balance plans
through PP-Balance's count groups). This script prices that rule in the simulator:

* **balance, EP rule**: ``make_plan(scheduler="balance", ep_size=E)``;
* **balance, no rule**: ``make_plan(scheduler="balance", ep_size=1)`` with the *same* cost model
  (E's all-to-all dispatch, E's expert-gradient reduction), so the ratio of the two is the
  constraint's own cost, not the dispatch's;
* **static**: the baseline (it satisfies the rule by construction);

for Mistral-8x7B (8,192 GPUs) and 8x22B (12,288 GPUs) at the paper's setups
(:func:`megatron_bytescale.sim.paper.paper_setup`: preset TP x PP, C = 8K, paper-fit
hardware), seed-0 32M-token synthetic GitHub-like and Byted-like batches (as Fig. 17 in
``scripts/reproduce_paper.py``), contexts 256K and 1M (and 2M for 8x7B), EP 1, 2 and 8.

The simulated step (:func:`megatron_bytescale.sim.step.simulate_step`) times rings, pipelines,
the dispatch per token, the gradient reduction and, with E > 1, the expert groups' lockstep
(:mod:`megatron_bytescale.planner.expert_lockstep`: every MoE layer's all-to-all makes an expert
group's members meet slot by slot, so a slot costs its slowest member, an empty slot too; with
PP inside the 1F1B schedule). Balance sees the same estimate when it picks its plan, and then
sorts or regroups each group's single-rank micro-batches so that similar ones share a slot
(:mod:`megatron_bytescale.planner.schedulers.ep_slots`); "unsorted" is the same balance with
that step off (``even_expert_slots=False``). "lockstep" is a plan's micro-batch phase over the
same plan's phase with its expert groups uncoupled (``ep_size`` 1: rings only).
Planning CPU time is this process's thread time for ``make_plan``.

Writes block ``moe_ep`` of docs/benchmarks.md (section "moe").

    .venv/bin/python scripts/bench_moe_ep.py [--json FILE | --from-json FILE] [--no-write] [--quick]
        [--cells MODEL/LAYOUT/DATASET/CONTEXT/EP,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402
from megatron_bytescale.planner.presets import model_spec  # noqa: E402
from megatron_bytescale.sim import format_tokens, paper  # noqa: E402
from megatron_bytescale.sim.overheads import preset_overheads  # noqa: E402
from megatron_bytescale.sim.step import simulate_step  # noqa: E402

K, M = 2**10, 2**20
MODELS = ("mistral-8x7b", "mistral-8x22b")
CONTEXTS = {"mistral-8x7b": (256 * K, 1 * M, 2 * M), "mistral-8x22b": (256 * K, 1 * M)}
DATASETS = ("github", "byted")
EP_SIZES = (1, 2, 8)
#: The reading of the last full run (scripts/bench_moe_ep.py --json), shown under the table.
READING = (
    "Reading: with E > 1 the simulated step now charges the expert groups' lockstep, and balance "
    "plans with it. Before, balance chose its plans blind to it; timed with it, those plans ran "
    "8x22B GitHub 1M EP 8 (preset layout) in 50.98 s, not the 21.76 s estimated (lockstep 2.35x; "
    "the script's earlier estimate on one stage's times said 1.92x), and 8x7B Byted 2M EP 8 at PP 1 "
    "in 61.93 s, not 36.62 (1.70x) (one-off: the previous planner's plans, commit 3328e1d, timed with "
    "this estimate; docs/moe.md). The same cells now take 22.15 s and 36.65 s. Charging does most of "
    "it: PP-Balance now keeps the candidate whose groups wait least (balance's lockstep before "
    "evening is at most 1.019 at the preset layouts and 1.294 at PP 1). Evening the slots (each "
    "group's single-rank micro-batches sorted, or pooled and dealt out again) is kept in 17 of 40 "
    "cells: the lockstep falls from 1.294 to 1.208 (8x22B Byted 1M, EP 8, PP 1), from 1.044 and "
    "1.028 to 1.000 (8x7B Byted 1M / 2M, EP 2, PP 1), and the step by up to 8.9 % (8x7B Byted 1M, "
    "EP 8, PP 1: 19.20 -> 17.63 s); on the blind plans alone it takes 2.35x to 1.67x and 1.70x to "
    "1.02x. Against balance without the rule (a plan an EP run could not train, with no lockstep) "
    "the rule and the lockstep together cost at most 6.2 % at the preset layouts and 20.5 % at PP 1 "
    "(8x22B Byted 1M, EP 8, lockstep 1.208 left), median about 1.00. "
    "Balance beats static by 1.75-3.71x (preset) and 1.96-3.68x (PP 1) with the lockstep charged "
    "(the earlier estimate with the lockstep added: 1.34-3.68x)."
)
LAYOUTS = ("preset", "pp1")
"""``preset``: the paper's TP x PP; ``pp1``: the same GPUs and TP without pipeline stages
(hypothetical: every HDP rank holds all layers), where balance without the rule is DP-Balance."""


def setup_for(model: str, ep: int, layout: str) -> Any:
    """The cluster of one row: the paper's setup, or the same GPUs at PP 1 (``layout="pp1"``)."""
    setup = paper.paper_setup(model, expert_parallel_size=ep)
    if layout == "preset":
        return setup
    spec = model_spec(model, expert_parallel_size=ep)
    tp = setup.tensor_parallel_size
    return dataclasses.replace(setup, hdp_size=setup.num_gpus // tp, pp_size=1,
                               overheads=preset_overheads(spec, tensor_parallel_size=tp, pp_size=1))


def progress(msg: str) -> None:
    print(f"[bench_moe_ep] {msg}", file=sys.stderr, flush=True)


def without_groups(plan: Any, setup: Any) -> float:
    """The micro-batch phase of ``plan`` timed as if its expert groups did not wait for each
    other (the same plan with ``ep_size`` 1: rings still couple their members)."""
    return simulate_step(dataclasses.replace(plan, ep_size=1), setup.cost_model, overheads=setup.overheads,
                         tensor_parallel_size=setup.tensor_parallel_size).micro_batch_phase_s


def one(lengths: Any, setup: Any, *, scheduler: str, ep_size: int, context: int, even: bool = True) -> dict:
    """Plan (timed in thread CPU seconds) and simulate one variant (``even``: balance's slot
    sorting with expert groups)."""
    start = time.thread_time()
    plan = make_plan(lengths, scheduler=scheduler, hdp_size=setup.hdp_size, capacity=setup.capacity,
                     cost_model=setup.cost_model, pp_size=setup.pp_size, context_length=context,
                     delta=setup.delta, num_buckets=setup.num_buckets, estimate=False, pieces=False,
                     ep_size=ep_size, even_expert_slots=even)
    cpu = time.thread_time() - start
    result = simulate_step(plan, setup.cost_model, overheads=setup.overheads,
                           tensor_parallel_size=setup.tensor_parallel_size, name=scheduler)
    counts = plan.micro_batch_counts()
    return {"step_s": result.step_time_s, "phase_s": result.micro_batch_phase_s, "plan_cpu_s": cpu,
            "lockstep": result.micro_batch_phase_s / without_groups(plan, setup) if ep_size > 1 else None,
            "slots": plan.meta.get("expert_slots"),
            "mb_min": int(min(counts)), "mb_max": int(max(counts)),
            "largest_ring": int(max(result.ring_sizes, default=1)), "mode": plan.meta.get("mode")}


def run(models: tuple[str, ...], datasets: tuple[str, ...], ep_sizes: tuple[int, ...], *,
        layouts: tuple[str, ...] = LAYOUTS, max_context: int | None = None, json_path: str | None = None,
        cells: set[str] | None = None) -> dict:
    out: dict = {}
    for model, layout in [(m, lay) for lay in layouts for m in models]:
        for ep in ep_sizes:
            setup = setup_for(model, ep, layout)
            for dataset in datasets:
                for ctx in CONTEXTS[model]:
                    if max_context is not None and ctx > max_context:
                        continue
                    if cells is not None and f"{model}/{layout}/{dataset}/{format_tokens(ctx)}/{ep}" not in cells:
                        continue
                    start = time.perf_counter()
                    lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=ctx)
                    cell = {"static": one(lengths, setup, scheduler="static", ep_size=ep, context=ctx),
                            "balance_ep": one(lengths, setup, scheduler="balance", ep_size=ep, context=ctx)}
                    if ep > 1:
                        cell["balance_free"] = one(lengths, setup, scheduler="balance", ep_size=1, context=ctx)
                        cell["balance_unsorted"] = one(lengths, setup, scheduler="balance", ep_size=ep, context=ctx,
                                                       even=False)
                    cell["pp"] = setup.pp_size
                    cell["hdp"] = setup.hdp_size
                    out[f"{model}/{layout}/{dataset}/{ctx}/{ep}"] = cell
                    progress(f"{model} {layout} {dataset} {format_tokens(ctx)} EP {ep}: {time.perf_counter() - start:.0f} s")
                    if json_path:
                        Path(json_path).write_text(json.dumps({"results": out}, indent=1) + "\n", encoding="utf-8")
    return out


def rows_of(results: dict) -> list[list[str]]:
    rows = []
    for key, cell in results.items():
        model, layout, dataset, ctx, ep = key.split("/")
        st, be = cell["static"], cell["balance_ep"]
        free, raw = cell.get("balance_free"), cell.get("balance_unsorted")
        tp = paper.FIG17_GPUS[model] // (cell["hdp"] * cell["pp"])
        rows.append([
            model, f"TP {tp} x PP {cell['pp']}" + (" (hyp.)" if layout == "pp1" else ""), cell["hdp"],
            dataset, format_tokens(int(ctx)), ep,
            f"{st['step_s']:.2f}", f"{free['step_s']:.2f}" if free else "(= EP rule)",
            f"{raw['step_s']:.2f}" if raw else "", f"{be['step_s']:.2f}",
            f"{be['step_s'] / free['step_s']:.4f}" if free else "1",
            f"{st['step_s'] / be['step_s']:.2f}x",
            f"{st['lockstep']:.3f} / {raw['lockstep']:.3f} / {be['lockstep']:.3f}" if raw else "",
            SLOT_NAMES.get(be["slots"], "") if raw else "",
            f"{be['mb_min']}-{be['mb_max']}",
            f"{free['plan_cpu_s']:.1f}" if free else "", f"{be['plan_cpu_s']:.1f}",
        ])
    return rows


SLOT_NAMES = {"as placed": "as placed", "longest-first": "sorted, long first",
              "shortest-first": "sorted, short first", "regrouped, longest-first": "regrouped, long first",
              "regrouped, shortest-first": "regrouped, short first"}


def section(results: dict, seconds: float, reading: str, load: str) -> str:
    return "\n".join([
        "### What the expert-parallel constraint costs balance (`scripts/bench_moe_ep.py`)",
        "",
        "Simulated steps (seconds) of Fig. 17's Mistral panels at the paper's GPU counts (8,192 for "
        "8x7B, 12,288 for 8x22B): 32M-token synthetic batches, seed 0, C = 8K, paper-fit hardware, "
        "no planning time in the step. Layout 'TP x PP': the presets' (8x7B TP 4 x PP 4, 8x22B "
        "TP 8 x PP 8), where balance is PP-Balance; '(hyp.)': the same GPUs and TP without "
        "pipeline stages, a hypothetical layout where balance without the rule is DP-Balance. "
        "Every variant of a row uses the same cost model: E's all-to-all dispatch per token and "
        "E's expert-gradient reduction. With E > 1 the simulated step charges the expert groups' "
        "lockstep (every MoE layer's all-to-all: each slot costs its group's slowest member, an "
        "empty slot too; rings join groups; with PP inside 1F1B), and balance plans with it. "
        "'balance, no rule' plans with `ep_size=1` (rings may sit at different local indices on "
        "their members, which an EP run cannot train; no expert groups, so no lockstep), "
        "'balance, EP rule' with `ep_size=E` (every ring micro-batch at one slot on all its members, "
        "PP-Balance's count groups, then each group's single-rank micro-batches sorted or regrouped "
        "so that similar ones share a slot where the estimate says it pays), 'unsorted' the same "
        "without that last step. 'lockstep': a plan's micro-batch phase over the same plan's "
        "with its expert groups uncoupled (rings only), for static, balance unsorted and balance. "
        "'slots': what balance kept. 'mb/rank': micro-batches per rank in the EP plan. Planning "
        "CPU: thread time of `make_plan` on this machine (shared, noisy; timing-only plans, "
        "`pieces=False`).",
        "",
        markdown_table(["model", "layout", "HDP ranks", "dataset", "context", "EP", "static s", "balance, no rule s",
                        "balance, EP rule, unsorted s", "balance, EP rule s", "EP rule / no rule",
                        "EP rule vs static", "lockstep static / unsorted / balance", "slots", "mb/rank",
                        "plan CPU no rule s", "plan CPU EP rule s"], rows_of(results)),
        "",
        reading,
        "",
        f"_Generated in {seconds:.0f} s. {machine_line()} Simulated steps: no timing of this machine "
        f"enters them; the planning CPU times are this machine's (shared with other jobs, load "
        f"average {load})._",
    ])


def summary(results: dict) -> str:
    """A short machine-made reading per layout: the range of the constraint's cost, of the
    lockstep before and after sorting the slots, and of balance's gain over static."""
    parts = []
    for layout, label in (("preset", "preset layouts"), ("pp1", "PP 1 layouts")):
        cells = [c for k, c in results.items() if k.split("/")[1] == layout]
        ep_cells = [c for c in cells if "balance_free" in c]
        if not ep_cells:
            continue
        ratios = sorted(c["balance_ep"]["step_s"] / c["balance_free"]["step_s"] for c in ep_cells)
        raw = [c["balance_unsorted"]["lockstep"] for c in ep_cells]
        locks = [c["balance_ep"]["lockstep"] for c in ep_cells]
        gains = [c["balance_unsorted"]["step_s"] / c["balance_ep"]["step_s"] for c in ep_cells]
        wins = [c["static"]["step_s"] / c["balance_ep"]["step_s"] for c in ep_cells]
        kept = sum(c["balance_ep"]["slots"] != "as placed" for c in ep_cells)
        parts.append(f"{label}, {len(ep_cells)} cells with EP > 1: EP rule / no rule {ratios[0]:.3f} to "
                     f"{ratios[-1]:.3f} (median {ratios[len(ratios) // 2]:.3f}); lockstep of balance unsorted "
                     f"{min(raw):.3f} to {max(raw):.3f}, sorted {min(locks):.3f} to {max(locks):.3f} (sorting "
                     f"kept in {kept}, step gain up to {max(gains):.3f}x); balance with the rule over static "
                     f"{min(wins):.2f}x to {max(wins):.2f}x.")
    return " ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the raw results here (rewritten after every cell)")
    ap.add_argument("--from-json", default=None, help="render the section from a --json file instead of running")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    ap.add_argument("--quick", action="store_true", help="8x7B, GitHub, 256K only (a smoke run; never written)")
    ap.add_argument("--cells", default=None, help="only these cells, comma-separated model/layout/dataset/"
                                                   "context/EP keys (e.g. mistral-8x7b/pp1/byted/2M/8); never written")
    ap.add_argument("--reading", default=READING, help="text of the reading paragraph under the table "
                                                          "(default: the last full run's)")
    args = ap.parse_args()
    start = time.perf_counter()
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        results, seconds = payload["results"], payload.get("seconds", 0.0)
        load = payload.get("load", "not recorded")
    elif args.cells:
        results = run(MODELS, DATASETS, EP_SIZES, json_path=args.json, cells=set(args.cells.split(",")))
        seconds = time.perf_counter() - start
        load = f"{os.getloadavg()[0]:.1f} at the end"
    elif args.quick:
        results = run(("mistral-8x7b",), ("github",), EP_SIZES, max_context=256 * K)
        seconds = time.perf_counter() - start
        load = f"{os.getloadavg()[0]:.1f} at the end"
    else:
        results = run(MODELS, DATASETS, EP_SIZES, json_path=args.json)
        seconds = time.perf_counter() - start
        load = f"{os.getloadavg()[0]:.1f} at the end"
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "seconds": seconds, "load": load}, indent=1)
                                       + "\n", encoding="utf-8")
    body = section(results, seconds, (args.reading + " " + summary(results)).strip(), load)
    if args.no_write or args.quick or args.cells:
        print(body)
    else:
        write_section("moe_ep", body)
        progress("wrote block 'moe_ep' of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
