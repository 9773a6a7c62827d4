#!/usr/bin/env python
"""Benchmark (simulated, planner only): how much of 1F1B's fill-and-drain floor interleaved
(virtual) pipeline stages and Seq1F1B-style sequence chunks remove on the Fig. 17 PP cells.

For every PP-Balance cell of Fig. 17 (LLaMA-70B and Mistral-8x7B on 8,192 GPUs, Mistral-8x22B
on 12,288; GitHub-like and Byted-like 32M-token batches, seed 0, 256K-2M context; the
``paper-fit`` hardware preset and the preset TP x PP of ``scripts/reproduce_paper.py``) the
script plans the batch with naive HDP (Alg. 1, no offload) and PP-Balance (Alg. 2, Eq. 3
offload) exactly as the reproduction does, then times the *same* PP-Balance plan under:

* 1F1B (today's estimate), interleaved 1F1B with 2 and 4 virtual stages per stage
  (:func:`megatron_bytescale.planner.pipeline_floor.time_plan`);
* ring micro-batches (all, those of at least half the longest stage time, or the longest) split into
  k = 2, 4, 8 causal chunks, costed ``ideal`` (the micro-batch's time divided in proportion
  to its work: an upper bound on the gain), ``cached`` and ``ring`` (the cost model's ring
  formula per chunk; see :mod:`megatron_bytescale.planner.pipeline_floor`).

Step time = micro-batch phase + the simulator's gradient reduction and optimizer terms (the
same for every schedule). The decision threshold of the sequence split is a 1.15x step
speedup on any cell. Writes section ``pipeline_floor`` of docs/benchmarks.md and section
``seq_split_numbers`` of docs/pipeline.md; raw numbers to out/bench_pipeline_floor.json.

    .venv/bin/python scripts/bench_pipeline_floor.py [--only llama-70b] [--no-write] [--from-json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.estimate import critical_path, micro_batch_costs  # noqa: E402
from megatron_bytescale.planner.pipeline_floor import time_plan  # noqa: E402
from megatron_bytescale.sim import format_tokens, paper  # noqa: E402
from megatron_bytescale.sim.step import simulate_step  # noqa: E402
from megatron_bytescale.sim.variants import VARIANTS, plan_for  # noqa: E402

PIPELINE_MD = Path(__file__).resolve().parent.parent / "docs" / "pipeline.md"
VPPS = (2, 4)
CHUNKS = (2, 4, 8)
COSTINGS = ("ideal", "cached", "ring", "cached-nowait")
"""``cached-nowait``: ``cached`` with the cost model's lockstep straggler wait per ring step set to
0, the unsplit plan re-timed the same way (speedups are against that): how much the decision
rests on that fitted term (0 already on the h100 preset)."""
#: which ring micro-batches are split: all of them, those of at least half the longest stage
#: time, or only the longest
POLICIES = {"all": 0.0, "long": 0.5, "top": 1.0}
THRESHOLD = 1.15


def progress(msg: str) -> None:
    print(f"[bench_pipeline_floor] {msg}", file=sys.stderr, flush=True)


def cell(model: str, dataset: str, context: int, hardware: str) -> dict:
    setup = paper.paper_setup(model, hardware=hardware)
    cm = setup.cost_model
    lengths = synthetic_lengths(dataset, paper.GLOBAL_TOKENS, seed=0, max_length=context)
    naive, _ = plan_for(lengths, VARIANTS["naive"], setup, context_length=context)
    naive_eq3, _ = plan_for(lengths, VARIANTS["naive+offload"], setup, context_length=context)
    plan, wall = plan_for(lengths, VARIANTS["balance"], setup, context_length=context)
    base = simulate_step(plan, cm, overheads=setup.overheads, tensor_parallel_size=setup.tensor_parallel_size)
    naive_step = simulate_step(naive, cm, overheads=setup.overheads, tensor_parallel_size=setup.tensor_parallel_size)
    fixed = base.step_time_s - base.micro_batch_phase_s  # gradient reduction + optimizer (+ data wait: 0)
    costs = micro_batch_costs(plan, cm)
    out = {
        "hardware": hardware, "model": model, "dataset": dataset, "context": context, "gpus": setup.num_gpus,
        "pipelines": setup.hdp_size, "pp": setup.pp_size, "fixed_s": fixed,
        "layers_per_stage": cm.layers_per_stage(setup.pp_size),
        "naive_phase_s": naive_step.micro_batch_phase_s,
        "naive_eq3_phase_s": simulate_step(naive_eq3, cm).micro_batch_phase_s, "phase_s": base.micro_batch_phase_s,
        "lower_bound_s": base.lower_bound_s,
        "pp_critical_s": critical_path(plan, cm, costs), "rings": int((costs.ring_sizes > 1).sum()),
        "max_stage_s": float(costs.seconds.max(initial=0.0)), "plan_wall_s": wall,
    }
    check = time_plan(plan, cm)
    if check is None or abs(check.step_s - base.micro_batch_phase_s) > 1e-6 * max(1.0, check.step_s):
        raise RuntimeError(f"{model}/{dataset}/{context}: the floor model's 1F1B differs from the estimate")
    for v in VPPS:
        if vpp_fits(out, v):
            r = time_plan(plan, cm, vpp=v)
            out[f"vpp{v}_s"] = None if r is None else r.step_s
    nowait = cm.with_(ring_straggler_s=0.0)
    nowait_max = float(micro_batch_costs(plan, nowait).seconds.max(initial=0.0))
    out["nowait_phase_s"] = time_plan(plan, nowait).step_s
    for costing in COSTINGS:
        model, top, name = (nowait, nowait_max, "cached") if costing == "cached-nowait" else (cm, out["max_stage_s"], costing)
        for k in CHUNKS:
            for policy, frac in POLICIES.items():
                r = time_plan(plan, model, split_chunks=k, split_costing=name, split_min_seconds=frac * top)
                out[f"split_{costing}_{policy}{k}_s"] = None if r is None else r.step_s
                out[f"split_{costing}_{policy}{k}_bound_s"] = None if r is None else r.lower_bound_s
    return out


def vpp_fits(row: dict, v: int) -> bool:
    """Whether Megatron can build ``v`` virtual stages: each stage's layers split into v chunks."""
    return row["layers_per_stage"] % v == 0


def vpp_best(row: dict) -> float:
    """The best step speedup of the virtual stages the cell admits (0.0 where none)."""
    return max((speedup(row, f"vpp{v}_s") or 0.0 for v in VPPS if vpp_fits(row, v)), default=0.0)


def vpp_cell(row: dict, v: int) -> str:
    return fmt(row[f"vpp{v}_s"]) if vpp_fits(row, v) else f"n/a ({row['layers_per_stage']} layers)"


def speedup(row: dict, key: str) -> float | None:
    v = row.get(key)
    if v is None:
        return None
    base = row["nowait_phase_s"] if "nowait" in key else row["phase_s"]
    return (base + row["fixed_s"]) / (v + row["fixed_s"])


def fmt(x: float | None, digits: int = 1) -> str:
    return "deadlock" if x is None else f"{x:.{digits}f}"


def best(row: dict, costing: str) -> tuple[float, str, float | None]:
    """(step speedup, "k=.., policy", phase s) of the best split of ``costing``."""
    vals = [(speedup(row, f"split_{costing}_{p}{k}_s") or 0.0, f"k={k} {p}", row[f"split_{costing}_{p}{k}_s"])
            for k in CHUNKS for p in POLICIES]
    return max(vals, key=lambda v: v[0])


def tables(rows: list[dict]) -> tuple[str, str]:
    head = ["model", "data", "context", "naive phase s", "naive + Eq. 3 phase s", "balance phase s (1F1B)", "work bound s",
            "PP x critical s", "VPP 2 s", "VPP 4 s", "VPP step speedup",
            *(f"split {c}: best phase s (step speedup, k, which)" for c in COSTINGS)]
    body = []
    for r in rows:
        cells = []
        for c in COSTINGS:
            sp, what, phase = best(r, c)
            cells.append("deadlock (every split)" if phase is None else f"{fmt(phase)} ({sp:.2f}x, {what})")
        body.append([
            r["model"], r["dataset"], format_tokens(r["context"]), fmt(r["naive_phase_s"]),
            fmt(r["naive_eq3_phase_s"]), fmt(r["phase_s"]),
            fmt(r["lower_bound_s"]), fmt(r["pp_critical_s"]), *(vpp_cell(r, v) for v in VPPS),
            f"{vpp_best(r):.2f}x" if any(vpp_fits(r, v) for v in VPPS) else "n/a", *cells,
        ])
    table = markdown_table(head, body)
    n_vpp = sum(vpp_best(r) >= THRESHOLD for r in rows)
    top_vpp = max(rows, key=vpp_best)
    n_fit = sum(any(vpp_fits(r, v) for v in VPPS) for r in rows)
    parts = [f"Cells at or above {THRESHOLD:.2f}x step speedup (of {len(rows)}): VPP {n_vpp} of the {n_fit} "
             f"that admit it (largest "
             f"{vpp_best(top_vpp):.2f}x, {top_vpp['model']} {top_vpp['dataset']} "
             f"{format_tokens(top_vpp['context'])})"]
    for c in COSTINGS:
        n = sum(best(r, c)[0] >= THRESHOLD for r in rows)
        top = max(rows, key=lambda r: best(r, c)[0])
        parts.append(f"{c} split {n} (largest {best(top, c)[0]:.2f}x, {top['model']} {top['dataset']} "
                     f"{format_tokens(top['context'])})")
    summary = "; ".join(parts) + "."
    return table, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated models (default: the three PP models)")
    ap.add_argument("--hardware", default="paper-fit,h100",
                    help="hardware presets, comma-separated (default: paper-fit, Fig. 17's, and h100)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--from-json", type=Path,
                    help="write the sections from the rows a run saved (out/bench_pipeline_floor.json)")
    args = ap.parse_args()
    models = args.only.split(",") if args.only else list(paper.PP_BALANCE_MODELS)
    rows = json.loads(args.from_json.read_text()) if args.from_json else []
    start = time.perf_counter()
    for hardware in args.hardware.split(",") if not args.from_json else ():
        for model in models:
            for dataset in ("github", "byted"):
                for ctx in paper.FIG17_CONTEXTS:
                    if ctx > paper.FIG17_MAX_CONTEXT.get(model, 1 << 40):
                        continue
                    rows.append(cell(model, dataset, ctx, hardware))
                    r = rows[-1]
                    progress(f"{hardware} {model} {dataset} {format_tokens(ctx)}: 1F1B {r['phase_s']:.1f} s, VPP4 "
                             f"{vpp_cell(r, 4)}, best ideal/cached/ring split "
                             f"{[round(best(r, c)[0], 3) for c in COSTINGS]} ({time.perf_counter() - start:.0f} s)")
    if not args.from_json:
        Path("out").mkdir(exist_ok=True)
        Path("out/bench_pipeline_floor.json").write_text(json.dumps(rows, indent=1))
    parts = []
    for hardware in args.hardware.split(","):
        table, summary = tables([r for r in rows if r["hardware"] == hardware])
        parts.append(f"Hardware preset `{hardware}`:\n\n{table}\n\n{summary}")
    text = "\n\n".join(parts)
    print(text)
    if args.no_write:
        return
    intro = (
        "## Pipeline floor: interleaved stages and sequence chunks on the Fig. 17 PP cells "
        "(`scripts/bench_pipeline_floor.py`)\n\n"
        + machine_line() + "\n\nSimulated, planner only (no timing on this machine). The PP-Balance plan of "
        "each Fig. 17 PP cell (seed 0, the reproduction's setup, on Fig. 17's `paper-fit` preset and on the `h100` datasheet preset) timed under 1F1B (the "
        "estimate), interleaved 1F1B with 2 and 4 virtual stages, and every ring micro-batch split into "
        "k = 2, 4, 8 causal chunks: all of them, those of at least half the longest stage time, or the longest only (`ideal`: "
        "work-proportional, an upper bound; `cached`: the cost model's ring formula per chunk, members keeping "
        "earlier chunks' K/V; `ring`: the same, each chunk's ring rotating its whole prefix's K/V; `cached-nowait`: `cached` "
        "with the fitted per-ring-step straggler wait set to 0 in both the split and the unsplit timing). Phase = micro-batch phase (slowest pipeline); the work bound is busy stage-seconds over "
        "pipelines; PP x critical = the slowest micro-batch's fastest ring crossing every stage. Step speedup "
        "= (phase + gradient reduction + optimizer) over the same with the new phase. Naive = Alg. 1 "
        "without offload, naive + Eq. 3 = with Eq. 3's offloaded rings; balance = PP-Balance's plain 1F1B plan, timed "
        "as it is under every schedule (planned for virtual stages, PP-Balance picks another plan: section "
        "`pipeline-vpp-pick`); 'deadlock (every split)': every split of that plan leaves a later ring at two local "
        "indices; 'n/a (L layers)': the stage's L layers do not split into that many virtual stages, so Megatron-LM "
        "refuses it (Mistral-8x22B: 56 layers over PP 8). The scheduler's own changes are reported with Fig. 17 in docs/reproduction.md. Decision in "
        "docs/pipeline.md.\n\n"
    )
    write_section("pipeline_floor", intro + text)
    write_section("seq_split_numbers", text, PIPELINE_MD)


if __name__ == "__main__":
    main()
