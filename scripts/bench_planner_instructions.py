#!/usr/bin/env python
"""Benchmark: instructions one balance plan executes, two checkouts side by side (valgrind).

Planning CPU time on a shared 2-core machine drifts by a third within minutes, more than a
round of planner changes moves it, so a side-by-side CPU timing (``bench_planner_side_by_side``)
needs many runs and still shows single cells moving the wrong way. The instructions a plan
executes do not drift: ``valgrind --tool=callgrind`` counts them exactly, run to run. Each
checkout plans each cell once in a process of its own; a process that only imports the planner
and builds the batch is counted too and subtracted. The count is not a time (callgrind does not
model caches or numpy's vector units), but for the same Python code paths it moves with it.

    .venv/bin/python scripts/bench_planner_instructions.py --before /path/to/older/checkout \\
        [--after .] [--cells llama-70b:github:2M,dp:byted:256K,...] [--json FILE | --from-json FILE] [--no-write]

A cell is a Fig. 17 PP cell (``model:dataset:context``, planned as the simulator and
``bench_planner_side_by_side`` plan it) or ``dp:dataset:256K``: DP-Balance on the 32M-token
batch over 1,024 ranks with offload off, ``make_plan`` as training calls it (with its estimate
and every document's pieces).

Needs ``valgrind`` on the PATH; about 1-2 minutes per cell and checkout (two run at once).
Writes section ``planner_instructions`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

# Plans one cell: a Fig. 17 PP cell as bench_planner_side_by_side's worker does (model, dataset,
# context), or with model "dp" DP-Balance at 1,024 ranks, offload off, estimate and pieces on
# ("none" builds the batch and plans nothing).
WORKER = r"""
import sys
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.sim import paper
model, dataset, context, plan = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "plan"
lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)
if model == "dp":
    kw = dict(hdp_size=1024, capacity=8192, cost_model=preset_cost_model("llama-7b"), offload=False)
else:
    setup = paper.paper_setup(model)
    kw = dict(pieces=False, hdp_size=setup.hdp_size, capacity=setup.capacity, cost_model=setup.cost_model,
              pp_size=setup.pp_size, offload=True)
if plan:
    make_plan(lengths, scheduler="balance", context_length=context, **kw)
"""

DEFAULT_CELLS = "llama-70b:github:2M,mistral-8x7b:github:1M,mistral-8x22b:github:512K"


def _context(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KM])", text)
    if not match:
        raise SystemExit(f"--cells: a context like 512K or 2M, not {text!r}")
    return int(match[1]) << (10 if match[2] == "K" else 20)


def _env(checkout: Path, cache: Path) -> dict:
    """The worker's environment: the checkout first on the path, bytecode cached in ``cache``
    (where ``PYTHONDONTWRITEBYTECODE`` is set, every process would compile every module it
    imports, and a module one checkout imports only while planning would count as planning)."""
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONWARNINGS="ignore", PYTHONPYCACHEPREFIX=str(cache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def count(checkout: Path, cache: Path, model: str, dataset: str, context: int, plan: bool) -> int:
    """Instructions of one worker process (callgrind's total)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", WORKER,
         model, dataset, str(context), "plan" if plan else "none"],
        cwd=checkout, env=_env(checkout, cache), capture_output=True, text=True, timeout=1800)
    match = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or not match:
        raise SystemExit(f"valgrind in {checkout} ({model} {dataset} {context}) failed:\n{out.stderr[-2000:]}")
    return int(match[1])


def measure(before: Path, after: Path, cells: list[tuple[str, str, int]]) -> dict:
    checkouts = (("before", before), ("after", after))
    jobs = [(name, path, cell, True) for cell in cells for name, path in checkouts]
    # the baselines: no plan, one per kind of cell (DP builds its own cost model)
    firsts = {c[0] == "dp": c for c in reversed(cells)}
    jobs += [(name, path, cell, False) for cell in firsts.values() for name, path in checkouts]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-pycache-") as tmp:
        caches = {name: Path(tmp) / name for name, _ in checkouts}
        for name, path in checkouts:  # fill each checkout's bytecode cache: one plain plan per kind
            for cell in firsts.values():
                subprocess.run([sys.executable, "-c", WORKER, *map(str, cell), "plan"], cwd=path,
                               env=_env(path, caches[name]), check=True, timeout=600)
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {pool.submit(count, path, caches[name], *cell, plan): (name, cell, plan)
                       for name, path, cell, plan in jobs}
            for future, (name, cell, plan) in futures.items():
                key = " ".join(map(str, cell)) if plan else ("imports dp" if cell[0] == "dp" else "imports")
                out.setdefault(key, {})[name] = future.result()
                print(f"[instructions] {name} {key}: {out[key][name] / 1e9:.2f} G", file=sys.stderr, flush=True)
    return out


def section(results: dict, label: str) -> str:
    rows = []
    for key, r in results.items():
        if key.startswith("imports"):
            continue
        model, dataset, context = key.split()
        base = results["imports dp" if model == "dp" else "imports"]
        b, a = r["before"] - base["before"], r["after"] - base["after"]
        model = "DP-Balance, 1,024 ranks" if model == "dp" else model
        c = int(context)
        rows.append([model, dataset, f"{c >> 10}K" if c < 1 << 20 else f"{c >> 20}M", f"{b / 1e9:.2f}",
                     f"{a / 1e9:.2f}", f"{a / b:.2f}x"])
    return "\n".join([
        "## Planner: instructions per balance plan, two commits (`scripts/bench_planner_instructions.py`)",
        "",
        machine_line() + " " + label + " Instructions one `make_plan(scheduler='balance')` executes "
        "(valgrind callgrind, exact run to run), the process that only imports the planner and builds "
        "the batch subtracted. PP cells as the simulator plans them (no pieces); DP-Balance as "
        "training calls it (its estimate and every document's pieces), offload off.",
        "",
        markdown_table(["planner / model", "dataset", "context", "before G instr.", "after G instr.", "after / before"], rows),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="checkout of the older commit (its repository root)")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help=f"model:dataset:context,... (default {DEFAULT_CELLS})")
    ap.add_argument("--label", default="", help="what before and after are (commits)")
    ap.add_argument("--json", type=Path, help="also save the raw counts here")
    ap.add_argument("--from-json", type=Path, help="write the section from counts saved by --json")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        if args.before is None:
            raise SystemExit("--before: the checkout of the older commit to compare with (or --from-json FILE)")
        if shutil.which("valgrind") is None:
            raise SystemExit("valgrind is not on the PATH: install it (e.g. apt-get install valgrind)")
        cells = []
        for text in args.cells.split(","):
            parts = text.split(":")
            if len(parts) != 3:
                raise SystemExit(f"--cells: model:dataset:context, not {text!r}")
            cells.append((parts[0], parts[1], _context(parts[2])))
        results = measure(args.before.resolve(), args.after.resolve(), cells)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    body = section(results, args.label)
    print(body) if args.no_write else write_section("planner_instructions", body)


if __name__ == "__main__":
    main()
