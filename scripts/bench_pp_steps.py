#!/usr/bin/env python
"""Benchmark: PP-Balance's level steps on the Fig. 17 PP cells, before and after, in the estimate.

For every PP cell of Fig. 17 (LLaMA-70B, Mistral-8x7B, Mistral-8x22B at the paper's GPU counts,
seed-0 GitHub-like and Byted-like 32M-token batches, C = 8K, the preset's TP x PP) and one
hardware preset: the estimated step of naive (offload off), naive + Eq. 3, and ``balance``
(offload on), which candidate won (``meta["assignment"]``: ``fill...`` is naive's fill, anything
else PP-Balance's own assignment) and the planning thread CPU time of ``balance``.

``--json FILE`` only measures and saves; run it with ``PYTHONPATH`` on an older checkout for
the 'before' columns (the script uses only the public ``make_plan``). Then

    .venv/bin/python scripts/bench_pp_steps.py --before h100=BEFORE.json --before paper-fit=B2.json \
        --after h100=AFTER.json --after paper-fit=A2.json

writes section ``pipeline-pp-steps`` of docs/benchmarks.md (``--change next-levels-first``:
section ``pipeline-next-levels``; ``--change window-and-singles``: ``pipeline-window-singles``;
``--change rings-of-their-own``: ``pipeline-rings-of-their-own``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402
from megatron_bytescale.sim import paper  # noqa: E402


def cells() -> list[tuple[str, str, int]]:
    return [(m, ds, c) for m in paper.PP_BALANCE_MODELS for ds in ("github", "byted")
            for c in paper.FIG17_CONTEXTS if c <= paper.FIG17_MAX_CONTEXT.get(m, 1 << 40)]


def measure(hardware: str) -> dict:
    out = {}
    for model, dataset, context in cells():
        setup = paper.paper_setup(model, hardware=hardware)
        lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)
        kw = dict(hdp_size=setup.hdp_size, capacity=setup.capacity, cost_model=setup.cost_model,
                  pp_size=setup.pp_size, context_length=context, pieces=False)
        row = {"naive": make_plan(lengths, scheduler="naive", offload=False, **kw).estimate.step_time_s,
               "naive+eq3": make_plan(lengths, scheduler="naive", offload=True, **kw).estimate.step_time_s}
        start = time.thread_time()
        plan = make_plan(lengths, scheduler="balance", offload=True, **kw)
        row.update(cpu_s=time.thread_time() - start, balance=plan.estimate.step_time_s,
                   assignment=plan.meta["assignment"], choice=plan.meta.get("offload_choice", "eq3"))
        out[f"{model}/{dataset}/{context}"] = row
        print(model, dataset, context, row, flush=True)
    return out


def _own(r: dict) -> bool:
    return not r["assignment"].startswith("fill")


# the changes this script has measured: --change NAME -> (section of docs/benchmarks.md, title, what before/after are)
CHANGES = {
    "level-steps": (
        "pipeline-pp-steps", "PP-Balance's level steps",
        "'before': the commit before the level steps (PP-Balance's runs, naive's fill as the "
        "safety net); 'after': with the level steps (`planner/schedulers/pp_steps.py`). "
        "'won' is the candidate kept; **bold**: naive's fill won, i.e. PP-Balance's own "
        "assignment lost to naive. Why, and what changed: docs/pipeline.md, \"Why naive's "
        "assignment won\"."),
    "next-levels-first": (
        "pipeline-next-levels", "the next levels first",
        "'before': the commit before the next-levels-first candidate; 'after': with it "
        "(`planner/schedulers/pp_balance.py: next_levels_first`, every candidate also tried with "
        "each pipeline's next PP - 1 micro-batches before its first, so their backwards fill "
        "the longest ring's 1F1B window). 'won' is the candidate kept; **bold**: naive's fill "
        "won. Why: docs/pipeline.md, \"The next levels first\"."),
    "window-and-singles": (
        "pipeline-window-singles", "the window load and singles first",
        "'before': the commit before them; 'after': with a third PP-Balance load (stage work "
        "plus the idle of each pipeline's longest micro-batch with its 1F1B window filled, "
        "`pp_balance(window=PP - 1)`) and every candidate also tried with PP - 1 single-rank "
        "micro-batches lifted before each ring pipeline's first "
        "(`planner/schedulers/pp_balance.py: singles_first`). 'won' is the candidate kept; "
        "**bold**: naive's fill won. Why: docs/pipeline.md, \"The window load and singles first\"."),
    "rings-of-their-own": (
        "pipeline-rings-of-their-own", "rings of their own",
        "'before': the commit before it; 'after': with one more PP-Balance candidate where "
        "they exist, the rings whose 1F1B floor exceeds the mean work of the other pipelines "
        "each on pipelines of their own, after one layer of shorter micro-batches "
        "(`planner/schedulers/pp_isolate.py`), and the planning time's cuts (a candidate's "
        "timing stops once it exceeds the best; unit sets skipped by the assignment floor). "
        "'won' is the candidate kept; **bold**: naive's fill won. Why: docs/pipeline.md, "
        "\"Rings of their own\"."),
}


def section(before: dict, after: dict, change: str = "level-steps") -> str:
    _, title, what = CHANGES[change]
    parts = [
        f"## Pipeline: {title} on the Fig. 17 PP cells (`scripts/bench_pp_steps.py --change {change}`)",
        "",
        machine_line() + " Planner estimates only, so step times are deterministic; planning "
        "CPU is the thread CPU time of one `make_plan(scheduler='balance')`, taken on a shared, "
        "loaded machine (noisy, up to ~2x).",
        "",
        "Seed-0 32M-token batches, C = 8K, the paper's GPU counts and the preset's TP x PP. " + what,
    ]
    for hw in sorted(after):
        a, b = after[hw], before.get(hw, {})
        rows = []
        for model, dataset, context in cells():
            k = f"{model}/{dataset}/{context}"
            if k not in a:
                continue
            ra, rb = a[k], b.get(k)

            def won(r: dict | None) -> str:
                if r is None:
                    return "-"
                return r["assignment"] if _own(r) else f"**{r['assignment']}**"
            rows.append([model, dataset, f"{context // 1024}K" if context < 1 << 20 else f"{context >> 20}M",
                         f"{ra['naive']:.2f}", f"{ra['naive+eq3']:.2f}",
                         f"{rb['balance']:.2f}" if rb else "-", won(rb), f"{ra['balance']:.2f}", won(ra),
                         f"{rb['balance'] / ra['balance']:.3f}x" if rb else "-",
                         f"{rb['cpu_s']:.2f}" if rb else "-", f"{ra['cpu_s']:.2f}"])
        own_b = sum(_own(r) for r in b.values())
        own_a = sum(_own(r) for r in a.values())
        gains = [b[k]["balance"] / a[k]["balance"] for k in a if k in b]
        summary = (f"PP-Balance's own assignment kept in {own_a} of {len(a)} cells (before: {own_b} of {len(b)}); "
                   f"step gain after / before {min(gains):.3f}-{max(gains):.3f}x (median {statistics.median(gains):.3f}x); "
                   f"planning CPU median {statistics.median(r['cpu_s'] for r in a.values()):.2f} s after, "
                   f"{statistics.median(r['cpu_s'] for r in b.values()):.2f} s before." if gains else "")
        parts += ["", f"### Hardware preset `{hw}`", "", summary, "",
                  markdown_table(["model", "dataset", "context", "naive s", "naive + Eq. 3 s", "balance before s",
                                  "won before", "balance after s", "won after", "gain", "plan CPU s before",
                                  "plan CPU s after"], rows)]
    return "\n".join(parts)


def _pairs(items: list[str]) -> dict:
    out = {}
    for item in items:
        hw, _, path = item.partition("=")
        out[hw] = json.loads(Path(path).read_text())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100", choices=("h100", "paper-fit"))
    ap.add_argument("--json", help="measure --hardware and save to this file (no docs written)")
    ap.add_argument("--before", action="append", default=[], help="HARDWARE=FILE measured on the older code")
    ap.add_argument("--after", action="append", default=[], help="HARDWARE=FILE measured now")
    ap.add_argument("--change", default="level-steps", choices=sorted(CHANGES),
                    help="which change the before/after files measure (section and wording)")
    args = ap.parse_args()
    if args.json:
        Path(args.json).write_text(json.dumps(measure(args.hardware), indent=1))
        return
    if not args.after:
        ap.error("pass --json to measure, or --after HARDWARE=FILE (and --before) to write the docs")
    write_section(CHANGES[args.change][0], section(_pairs(args.before), _pairs(args.after), args.change))


if __name__ == "__main__":
    main()
