#!/usr/bin/env python
"""Benchmark: Fig. 17's Mistral rows with the MoE cost model, before and after, and with EP.

Two tables, both from the simulator (no timing of this machine enters a number):

* the per-layer MoE terms of the two Mistral presets on ``paper-fit`` (:mod:`megatron_bytescale.
  planner.moe_cost`): the linear time per token before (top-k experts and router as FLOPs only)
  and after (plus the dispatcher's permute copies), the exposed dispatch time per token at
  EP 1, 2, 4, 8 and the all-to-all bytes it sends;
* Fig. 17's Mistral panels (``scripts/reproduce_paper.py``'s sweep, static and balance only):
  tokens/s of the whole cluster **before** (the cost model without the MoE dispatch, as Fig. 17
  was last generated), **after** at EP 1 (the paper's "HDP + TP + PP": only the dispatcher's TP
  collectives are added) and at EP 8 (the all-to-all across nodes, expert gradients over the
  expert-data-parallel groups). The EP 8 balance plans do not carry the planner's EP
  constraint (ranks of one expert group running the same micro-batch count): they show what
  the dispatch costs, not what the constraint costs.

Writes block ``moe_cost`` of docs/benchmarks.md (section "moe").

    .venv/bin/python scripts/bench_moe_cost.py [--json FILE | --from-json FILE] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402
from reproduce_paper import fig17_summaries  # noqa: E402

from megatron_bytescale.planner.moe_cost import moe_dispatch  # noqa: E402
from megatron_bytescale.planner.presets import hardware_spec, model_spec, preset_cost_model  # noqa: E402
from megatron_bytescale.sim import format_tokens, paper  # noqa: E402

MODELS = ("mistral-8x7b", "mistral-8x22b")
VARIANTS = ("static", "balance")
CONFIGS = ("before", "ep1", "ep8")


def before_changes(model: str) -> dict:
    """The cost-model fields that undo the MoE dispatch: Fig. 17's model before it."""
    cm = preset_cost_model(model, paper.PAPER_HARDWARE)
    permute = moe_dispatch(model_spec(model), hardware_spec(paper.PAPER_HARDWARE)).permute_s_per_token
    return dict(beta1=cm.beta1 - permute, moe_dispatch_s_per_token=0.0, moe_dispatch_s=0.0,
                moe_tp_bytes_per_token=0.0)


def terms_rows() -> list[list[str]]:
    rows = []
    hw = hardware_spec(paper.PAPER_HARDWARE)
    for model in MODELS:
        spec = model_spec(model)
        before = before_changes(model)["beta1"]
        after = preset_cost_model(model, paper.PAPER_HARDWARE)
        tp = spec.tensor_parallel_size
        for etp, ep in [(tp, 1), (tp, 2), (tp, 4), (tp, 8), (1, 8), (2, 8)]:  # ETP = TP, then two others
            d = moe_dispatch(spec, hw, expert_parallel_size=ep, expert_tensor_parallel_size=etp)
            rows.append([model, f"TP {tp}", f"ETP {etp}", f"EP {ep}", f"{before * 1e9:.1f}",
                         f"{after.beta1 * 1e9:.1f}", f"{d.seconds_per_token * 1e9:.1f}",
                         f"{d.seconds * 1e6:.0f}", f"{d.a2a_intra_bytes_per_token / 1e3:.1f}",
                         f"{d.a2a_inter_bytes_per_token / 1e3:.1f}", f"{d.tp_bytes_per_token / 1e3:.1f}"])
    return rows


def run() -> dict:
    out: dict = {}
    for model in MODELS:
        for config in CONFIGS:
            start = time.perf_counter()
            if config == "before":
                data = fig17_summaries([model], VARIANTS, **before_changes(model))
            else:
                data = fig17_summaries([model], VARIANTS, expert_parallel_size=1 if config == "ep1" else 8)
            for (m, dataset), summaries in data.items():
                for s in summaries:
                    key = f"{m}/{dataset}/{s.context_length}"
                    out.setdefault(key, {})[f"{config}/{s.variant.name}"] = s.tokens_per_s if s.ok else None
            print(f"[bench_moe_cost] {model} {config}: {time.perf_counter() - start:.0f} s", file=sys.stderr,
                  flush=True)
    return out


def section(results: dict, seconds: float) -> str:
    def k(x):
        return "n/a" if x is None else f"{x / 1e3:,.0f}k"

    rows = []
    for key, cell in results.items():
        model, dataset, ctx = key.split("/")
        row = [model, dataset, format_tokens(int(ctx))]
        for config in CONFIGS:
            row += [k(cell.get(f"{config}/static")), k(cell.get(f"{config}/balance"))]
        b, a = cell.get("before/balance"), cell.get("ep1/balance")
        row.append(f"{a / b - 1:+.1%}" if a and b else "n/a")
        sb, sa = cell.get("before/static"), cell.get("ep1/static")
        row.append(f"{b / sb:.2f}x -> {a / sa:.2f}x" if a and b and sa and sb else "n/a")
        rows.append(row)
    return "\n".join([
        "### MoE cost model: token dispatch in the Mistral presets (`scripts/bench_moe_cost.py`)",
        "",
        "Per layer, one rank, forward + backward, per token of the rank's sequence share (paper-fit "
        "hardware: NVLink 360 GB/s, network 57 GB/s, 10 us per collective, HBM 3.35 TB/s, 8 GPUs a "
        "node; an EP group's members sit ETP GPUs apart, i.e. E consecutive HDP ranks when ETP = TP, "
        "the presets' default; the last two rows of each model split experts over 1 and 2 GPUs "
        "instead). 'linear before' is "
        "beta1 of the model Fig. 17 was generated with (router + top-k experts as FLOPs), 'after' "
        "adds the dispatcher's permute copies (ETP does not change them); 'dispatch' is the exposed "
        "all-to-all and expert-TP all-gather/reduce-scatter time (`moe_dispatch_s_per_token`), "
        "'latency' its per-micro-batch constant; bytes are what one rank sends per token in the four "
        "all-to-alls (on the node / across nodes) and in the four expert-TP collectives. Formulas: "
        "`planner/moe_cost.py`; tests by hand: `tests/planner/test_moe_cost.py`.",
        "",
        markdown_table(["model", "TP", "ETP", "EP", "linear before (ns/token)", "linear after (ns/token)",
                        "dispatch (ns/token)", "latency (us)", "a2a on node (kB/token)",
                        "a2a across (kB/token)", "expert-TP collectives (kB/token)"], terms_rows()),
        "",
        "Fig. 17's Mistral panels rerun (32M-token batches, seed 0, C = 8K, preset TP x PP, "
        "paper-fit, no planning time; tokens/s of the whole cluster). 'before': the cost model "
        "without the MoE dispatch (as `docs/reproduction.md`'s Fig. 17 was generated); 'EP 1': "
        "with it, the paper's layout (HDP + TP + PP), which adds the dispatcher's TP collectives "
        "(no all-to-all); 'EP 8': the all-to-all over 8 HDP ranks (4 nodes at TP 4, 8 nodes at "
        "TP 8) and the expert gradients over the expert-data-parallel groups; its balance plans "
        "do not carry the EP constraint, so they price the dispatch, not the constraint.",
        "",
        "Reading: the dispatch adds 11 % (8x7B, TP 4) and 22 % (8x22B, TP 8) to a token's linear "
        "time at EP 1, which costs static and balance alike where compute dominates (short "
        "contexts: balance -1 to -6 %) and fades where attention and ring waits dominate (2M: "
        "-0.1 to -0.2 %); balance's gain over static barely moves (largest change 2.05x -> 1.99x), "
        "so Fig. 17's Mistral conclusions stand. EP 8 is sometimes faster than EP 1 although its "
        "micro-batches are slower: the expert weights (most of the parameters) then reduce over "
        "groups of N / 8 ranks holding 1 / 8 of the experts, which shortens the gradient "
        "reduction more than the all-to-all lengthens the micro-batches. Balance plans are "
        "heuristic, so a costlier model can yield a slightly better plan (8x22B GitHub 1M, +2.8 %).",
        "",
        markdown_table(["model", "dataset", "context", "before static", "before balance", "EP 1 static",
                        "EP 1 balance", "EP 8 static", "EP 8 balance", "balance EP 1 vs before",
                        "balance / static before -> EP 1"], rows),
        "",
        f"_Generated in {seconds:.0f} s. {machine_line()} Simulated numbers: no timing of this "
        f"machine enters them. Load average {os.getloadavg()[0]:.1f} (shared machine)._",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--from-json", default=None, help="render the section from a --json file instead of running")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    start = time.perf_counter()
    if args.from_json:
        payload = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        results, seconds = payload["results"], payload["seconds"]
    else:
        results = run()
        seconds = time.perf_counter() - start
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "seconds": seconds}, indent=1) + "\n",
                                       encoding="utf-8")
    body = section(results, seconds)
    if args.no_write:
        print(body)
    else:
        write_section("moe_cost", body)
        print("[bench_moe_cost] wrote block 'moe_cost' of docs/benchmarks.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
