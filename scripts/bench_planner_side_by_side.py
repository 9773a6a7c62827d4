#!/usr/bin/env python
"""Benchmark: planning time of two checkouts side by side, cell by cell, in turns.

This 2-core machine's speed drifts by a quarter or more over minutes (and more from day to
day), so two planning-time runs taken one after the other compare the machine as much as the
code. Here one worker process per checkout (``PYTHONPATH`` set to it; the planner is imported
once) plans each cell in turn: before, after, before, after (the second round in the other
order), each time ``--repeats`` runs; a cell's figure is the minimum thread CPU time. Cells:
DP-Balance on the 32M-token GitHub and Byted batches at 256K on 1,024 ranks (offload off,
``make_plan`` as training calls it: with its estimate and every document's pieces), and
every Fig. 17 PP cell (``paper_setup``'s default hardware, offload on), as
``scripts/bench_planner.py --only-time`` plans them.

    .venv/bin/python scripts/bench_planner_side_by_side.py --before /path/to/older/checkout \\
        [--after .] [--repeats 3] [--rounds 2] [--json FILE | --from-json FILE] [--no-write]

Writes section ``planner_time_side_by_side`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

# The worker: names the planner file it imported, then reads "kind dataset context repeats" lines, answers each with the CPU seconds of
# its runs (a JSON list). Only public APIs, so an older checkout runs it too.
WORKER = r"""
import json, sys, time
import megatron_bytescale
print(megatron_bytescale.__file__, flush=True)  # which checkout it runs: the driver checks
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.sim import paper
lengths = {}
for line in sys.stdin:
    kind, dataset, context, repeats = line.split()
    context, repeats = int(context), int(repeats)
    if (dataset, context) not in lengths:
        lengths[dataset, context] = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)
    if kind == "dp":  # as training calls it: with the estimate and every document's pieces
        kw = dict(hdp_size=1024, capacity=8192, cost_model=preset_cost_model("llama-7b"), offload=False)
    else:
        setup = paper.paper_setup(kind)
        kw = dict(hdp_size=setup.hdp_size, capacity=setup.capacity, cost_model=setup.cost_model,
                  pp_size=setup.pp_size, offload=True, pieces=False)
    seconds = []
    for _ in range(repeats):
        start = time.thread_time()
        make_plan(lengths[dataset, context], scheduler="balance", context_length=context, **kw)
        seconds.append(time.thread_time() - start)
    print(json.dumps(seconds), flush=True)
"""


def cells() -> list[tuple[str, str, int]]:
    from megatron_bytescale.sim import paper

    return [("dp", ds, 262144) for ds in ("github", "byted")] + [
        (m, ds, c) for m in paper.PP_BALANCE_MODELS for ds in ("github", "byted")
        for c in paper.FIG17_CONTEXTS if c <= paper.FIG17_MAX_CONTEXT.get(m, 1 << 40)]


def measure(before: Path, after: Path, repeats: int, rounds: int) -> dict:
    workers = {}
    for name, path in (("before", before), ("after", after)):
        env = dict(os.environ, PYTHONPATH=str(path.resolve()), PYTHONWARNINGS="ignore")
        # run in the checkout: ``python -c`` puts the working directory first on sys.path, so
        # from another checkout's root both workers would import that one's planner
        workers[name] = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env, cwd=str(path.resolve()))
        where = Path(workers[name].stdout.readline().strip() or ".").resolve()
        if path.resolve() not in where.parents:
            raise SystemExit(f"the {name} worker imported the planner from {where}, not from {path}")
    out: dict = {}
    try:
        for r in range(rounds):
            for cell in cells():
                key = " ".join(map(str, cell))
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    w = workers[name]
                    w.stdin.write(f"{cell[0]} {cell[1]} {cell[2]} {repeats}\n")
                    w.stdin.flush()
                    answer = w.stdout.readline()
                    if not answer:
                        raise SystemExit(f"the {name} worker ({workers[name].args}) stopped at {key}")
                    out.setdefault(key, {"before": [], "after": []})[name] += json.loads(answer)
                print(f"[side-by-side] round {r + 1}/{rounds} {key}: "
                      f"{min(out[key]['before']) * 1e3:.0f} / {min(out[key]['after']) * 1e3:.0f} ms",
                      file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait(timeout=60)
    return out


def _context(c: int) -> str:
    return f"{c // 1024}K" if c < 1 << 20 else f"{c >> 20}M"


def section(results: dict, label: str) -> str:
    rows, ratios, before_pp, after_pp = [], [], [], []
    for key, r in results.items():
        kind, dataset, context = key.split()
        b, a = min(r["before"]), min(r["after"])
        rows.append(["DP-Balance, 1,024 ranks" if kind == "dp" else kind, dataset, _context(int(context)),
                     f"{b * 1e3:.0f}", f"{a * 1e3:.0f}", f"{a / b:.2f}x", str(len(r["before"]))])
        if kind != "dp":
            ratios.append(a / b)
            before_pp.append(b)
            after_pp.append(a)
    summary = (f"PP-Balance: {min(after_pp):.2f}-{max(after_pp):.2f} s after against "
               f"{min(before_pp):.2f}-{max(before_pp):.2f} s before, {min(ratios):.2f}-{max(ratios):.2f}x "
               f"(median {statistics.median(ratios):.2f}x); under 0.5 s in {sum(x < 0.5 for x in after_pp)} "
               f"of {len(after_pp)} cells after, {sum(x < 0.5 for x in before_pp)} before.") if ratios else ""
    return "\n".join([
        "## Planner: planning time of two commits side by side (`scripts/bench_planner_side_by_side.py`)",
        "",
        machine_line() + " " + label + " Each cell planned by both commits in turns (one worker "
        "process each), minimum thread CPU time over all runs; the same cells as section "
        "`planner_time`.",
        "",
        summary,
        "",
        markdown_table(["planner / model", "dataset", "context", "before ms", "after ms", "after / before",
                        "runs each"], rows),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="checkout of the older commit (its repository root)")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell and turn (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="turns per cell (default 2)")
    ap.add_argument("--label", default="", help="what before and after are (commits)")
    ap.add_argument("--json", type=Path, help="also save the raw seconds here")
    ap.add_argument("--from-json", type=Path, help="write the section from seconds saved by --json")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    elif args.before is None:
        raise SystemExit("--before: the checkout of the older commit to compare with (or --from-json FILE)")
    else:
        results = measure(args.before, args.after, args.repeats, args.rounds)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    body = section(results, args.label)
    print(body) if args.no_write else write_section("planner_time_side_by_side", body)


if __name__ == "__main__":
    main()
