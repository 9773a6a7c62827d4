"""``bytescale plan``: plan a global batch over HDP ranks, compare schedulers, plot, export JSON.

With no arguments it plans a synthetic Byted-like 32M-token batch (2M context) for LLaMA-7B
(TP 1) on 1,024 HDP ranks of capacity 8K with the ``balance`` scheduler. Typical use::

    bytescale plan --compare --plot out/plan.png
    bytescale plan lengths.txt --hdp-size 256 --model llama-13b --json plan.json
    bytescale plan /data/my_corpus_text_document.idx --scheduler naive --no-offload

Errors exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DEFAULT_GLOBAL_TOKENS = 32 * 2**20
DEFAULT_CONTEXT = 2_097_152
SCHEDULER_ORDER = ("balance", "naive", "static", "pow2")


class _UsageError(Exception):
    """Bad command line, reported like every other error (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise _UsageError(message)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a size, a count, a number of tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bytescale plan",
        description="Plan one global batch over HDP ranks with ByteScale's schedulers and show "
                    "what each would cost (estimated with the analytic or a saved cost model).",
    )
    data = p.add_argument_group("data")
    data.add_argument("lengths", nargs="?", help="lengths file: text (one int per line), JSON list, "
                      "or a Megatron indexed dataset (.idx, .bin or prefix); default: --synthetic")
    data.add_argument("--synthetic", choices=["github", "byted", "lognormal", "uniform"], default=None,
                      help="synthetic dataset when no file is given (default byted)")
    data.add_argument("--global-tokens", type=positive_int, default=DEFAULT_GLOBAL_TOKENS,
                      help=f"tokens of the synthetic batch (default {DEFAULT_GLOBAL_TOKENS:,})")
    data.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch (default 0)")
    data.add_argument("--context-length", type=positive_int, default=None,
                      help="longest allowed sequence and the static baseline's context; also the "
                           f"synthetic max length (default {DEFAULT_CONTEXT:,} for synthetic data, "
                           "the longest sequence for files)")

    cluster = p.add_argument_group("cluster and model")
    cluster.add_argument("--hdp-size", type=positive_int, default=1024, help="HDP ranks (DP x CP of Megatron; default 1024)")
    cluster.add_argument("--capacity", type=positive_int, default=8192, help="tokens per rank per micro-batch, C (default 8192)")
    cluster.add_argument("--pp-size", type=positive_int, default=None, help="pipeline stages (default: the model preset's)")
    cluster.add_argument("--tensor-model-parallel-size", type=positive_int, default=None,
                         help="TP degree (default: the model preset's)")
    cluster.add_argument("--model", default="llama-7b",
                         help="model preset: llama-7b, llama-13b, llama-30b, llama-70b, mistral-8x7b, "
                              "mistral-8x22b (default llama-7b)")
    cluster.add_argument("--cost-model", default=None, metavar="FILE",
                         help="cost model JSON (CostModel.save, e.g. from calibration) instead of --model")
    cluster.add_argument("--ranks-per-node", type=int, default=None,
                         help="HDP ranks per node: HDP rank r is on node r // N (default: the cost "
                              "model's, GPUs per node / TP for the presets)")
    cluster.add_argument("--two-level-ring", action="store_true",
                         help="cost rings over several whole nodes as two-level (head-split all-to-all "
                              "in the node, ring between nodes), as --bytescale-two-level-ring runs them")
    cluster.add_argument("--node-map", default=None, metavar="FILE",
                         help="node of every HDP rank instead of --ranks-per-node: a JSON list or one "
                              "integer per line, HDP rank order")

    sched = p.add_argument_group("scheduling")
    sched.add_argument("--scheduler", default="balance", choices=list(SCHEDULER_ORDER),
                       help="scheduler whose plan --json/--plot use (default balance)")
    sched.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                       help="Eq. 3 selective offload for naive/balance (default on)")
    sched.add_argument("--host-memory-gb", type=float, default=None,
                       help="host memory per HDP rank (GB) offloaded activations may fill (default: "
                            "the cost model's, unlimited unless it sets one)")
    sched.add_argument("--overlong", choices=["error", "drop", "truncate"], default="error",
                       help="what to do with a sequence that cannot fit (default error)")
    sched.add_argument("--align", type=positive_int, default=1, help="zigzag padding alignment per part (default 1)")
    sched.add_argument("--delta", type=float, default=0.05, help="Alg. 2 threshold, fraction of max time (default 0.05)")
    sched.add_argument("--num-buckets", type=positive_int, default=4, help="Alg. 2 equal-work buckets (default 4)")

    out = p.add_argument_group("output")
    out.add_argument("--compare", action="store_true", help="run every scheduler and print them side by side")
    out.add_argument("--json", default=None, metavar="FILE", help="write the chosen scheduler's StepPlan JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="write a Gantt chart (all schedulers with --compare)")
    out.add_argument("--validate", action="store_true",
                     help="check the chosen plan's invariants and deadlock freedom (slow for rings of "
                          "hundreds of ranks)")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


# --------------------------------------------------------------------------- inputs
def _progress(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(f"[bytescale plan] {msg}", file=sys.stderr, flush=True)


def _load_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    if args.lengths is not None:
        if args.synthetic is not None:
            raise ValueError("give either a lengths file or --synthetic, not both")
        path = Path(args.lengths)
        if path.suffix in (".idx", ".bin") or (not path.exists() and Path(str(path) + ".idx").exists()):
            from ..integration.indexed_lengths import read_indexed_lengths

            return read_indexed_lengths(path), f"Megatron index {path}"
        from ..data.lengths import read_lengths

        return read_lengths(path), f"file {path}"
    from ..data.synthetic import synthetic_lengths

    name = args.synthetic or "byted"
    max_len = args.context_length or DEFAULT_CONTEXT
    lengths = synthetic_lengths(name, args.global_tokens, seed=args.seed, max_length=max_len)
    return lengths, f"synthetic {name} ({args.global_tokens:,} tokens, seed {args.seed}, max {max_len:,})"


def _cost_model(args: argparse.Namespace) -> tuple[Any, int]:
    from ..planner.cost_model import CostModel
    from ..planner.presets import model_spec, preset_cost_model

    host = getattr(args, "host_memory_gb", None)
    if host is not None and not (host > 0 and host != float("inf")):
        raise ValueError(f"--host-memory-gb ({host}) must be a positive number of GB")
    budget = {} if host is None else {"host_memory_bytes": host * 1e9}
    if args.cost_model:
        cm = CostModel.load(args.cost_model).with_(**budget)
        return cm, args.pp_size or 1
    spec = model_spec(args.model)
    cm = preset_cost_model(args.model, tensor_parallel_size=args.tensor_model_parallel_size).with_(**budget)
    return cm, args.pp_size or spec.pipeline_parallel_size


def _topology(args: argparse.Namespace, cost_model: Any) -> Any:
    from ..planner.topology import Topology

    if args.node_map is not None:
        if args.ranks_per_node is not None:
            raise ValueError("give either --ranks-per-node or --node-map, not both")
        path = Path(args.node_map)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read --node-map {str(path)!r}: {exc.strerror or exc}") from exc
        try:
            nodes = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"--node-map {str(path)!r} must be a JSON list or one integer per line: {exc}") from exc
        if len(nodes) != args.hdp_size:
            raise ValueError(f"--node-map {str(path)!r} names {len(nodes)} HDP ranks but --hdp-size is {args.hdp_size}")
        return Topology.from_node_map(nodes)
    if args.ranks_per_node is not None:
        if args.ranks_per_node < 1:
            raise ValueError(f"--ranks-per-node ({args.ranks_per_node}) must be >= 1")
        return Topology(ranks_per_node=args.ranks_per_node)
    return Topology.of(cost_model)


# --------------------------------------------------------------------------- output
def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _row(name: str, plan: Any, seconds: float) -> dict[str, Any]:
    e = plan.estimate
    x = e.extra
    counts = x["micro_batch_counts"]
    sizes = [int(k) for k, v in x["ring_size_histogram"].items() if int(k) > 1 for _ in range(v)]
    return {
        "scheduler": name,
        "step_s": e.step_time_s,
        "max_s": x["max_rank_time_s"],
        "mean_s": x["mean_rank_time_s"],
        "lower_bound_s": x["lower_bound_s"],
        "balance": x["balance_ratio"],
        "critical_s": x["critical_path_s"],
        "p2p": e.p2p_bytes,
        "inter_p2p": x["inter_node_p2p_bytes"],
        "in_node": f"{x['rings_within_one_node']}/{x['rings_fitting_one_node']}",
        "rings": x["num_rings"],
        "ring_sizes": (f"{min(sizes)}-{int(np.median(sizes))}-{max(sizes)}" if sizes else "-"),
        "mb_per_rank": f"{min(counts)}-{max(counts)}" if counts else "-",
        "offloaded": x["offloaded_micro_batches"],
        "plan_ms": seconds * 1e3,
    }


def _print_table(rows: list[dict[str, Any]], failed: dict[str, str]) -> None:
    base = next((r for r in rows if r["scheduler"] == "balance"), None)
    head = ["scheduler", "step (s)", "x balance", "max/mean rank (s)", "lower bound (s)", "balance",
            "P2P", "x balance", "inter-node P2P", "rings", "in one node", "ring sizes min-med-max", "mb/rank",
            "offloaded", "plan (ms)"]
    lines = []
    for r in rows:
        lines.append([
            r["scheduler"], f"{r['step_s']:.2f}",
            f"{r['step_s'] / base['step_s']:.2f}" if base and base["step_s"] else "-",
            f"{r['max_s']:.2f}/{r['mean_s']:.2f}", f"{r['lower_bound_s']:.2f}", f"{r['balance']:.3f}",
            _fmt_bytes(r["p2p"]),
            f"{r['p2p'] / base['p2p']:.2f}" if base and base["p2p"] else "-",
            _fmt_bytes(r["inter_p2p"]), str(r["rings"]), r["in_node"], r["ring_sizes"], r["mb_per_rank"], str(r["offloaded"]), f"{r['plan_ms']:.0f}",
        ])
    for name, why in failed.items():
        lines.append([name, "n/a"] + [""] * (len(head) - 2))
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for l in lines:
        print("  ".join(c.ljust(w) for c, w in zip(l, widths)))
    for name, why in failed.items():
        print(f"{name}: not applicable: {why}")
    if base:
        print("(column 'balance' = max rank time / lower bound, the lower bound being total busy "
              "rank-seconds / HDP ranks; 'x balance' columns are ratios to the balance scheduler; "
              "'inter-node P2P' = the P2P bytes that cross a node boundary; 'in one node' = rings "
              "inside one node / rings small enough to fit one)")


def _report_overlong(plan: Any) -> None:
    meta = plan.meta
    if meta.get("dropped"):
        ids = meta["dropped"]
        print(f"{plan.scheduler}: dropped {len(ids)} overlong sequence(s), {meta.get('dropped_tokens', 0):,} tokens "
              f"(ids {ids[:10]}{' ...' if len(ids) > 10 else ''}; limit {meta.get('overlong_limit'):,} tokens)")
    if meta.get("truncated"):
        t = meta["truncated"]
        print(f"{plan.scheduler}: truncated {len(t)} overlong sequence(s) to {meta.get('overlong_limit'):,} tokens, "
              f"{meta.get('truncated_tokens', 0):,} tokens cut (ids {[x['id'] for x in t][:10]})")


# --------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    from ..planner.schedulers import make_plan

    lengths, source = _load_lengths(args)
    if len(lengths) == 0:
        raise ValueError(f"{source} holds no sequences (no lengths, or only empty documents): "
                         "nothing to plan")
    cost_model, pp_size = _cost_model(args)
    if args.two_level_ring:
        cost_model = cost_model.with_(two_level_ring=True)
    topology = _topology(args, cost_model)
    _progress(args, f"{len(lengths):,} sequences, {int(lengths.sum()):,} tokens from {source}")
    context = args.context_length
    names = list(SCHEDULER_ORDER) if args.compare else [args.scheduler]
    plans: dict[str, Any] = {}
    rows, failed = [], {}
    for name in names:
        _progress(args, f"planning with {name} on {args.hdp_size:,} HDP ranks ...")
        t0 = time.perf_counter()
        try:
            plan = make_plan(
                lengths, scheduler=name, hdp_size=args.hdp_size, capacity=args.capacity,
                cost_model=cost_model, pp_size=pp_size, offload=args.offload, overlong=args.overlong,
                align=args.align, context_length=context, delta=args.delta, num_buckets=args.num_buckets,
                topology=topology,
            )
        except ValueError as exc:
            if not args.compare or name == args.scheduler:
                raise
            failed[name] = str(exc)
            continue
        dt = time.perf_counter() - t0
        _progress(args, f"  {name}: {dt * 1e3:.0f} ms, estimated step {plan.estimate.step_time_s:.2f} s")
        plans[name] = plan
        rows.append(_row(name, plan, dt))
    print(f"bytescale plan: {source}; {args.hdp_size:,} HDP ranks x capacity {args.capacity:,}, "
          f"{topology.ranks_per_node} per node{' (node map)' if topology.node_of else ''}, "
          f"PP {pp_size}, cost model {cost_model.name}, offload {'on' if args.offload else 'off'}"
          f"{', two-level rings' if args.two_level_ring else ''}")
    _print_table(rows, failed)
    for plan in plans.values():
        _report_overlong(plan)
    chosen = plans[args.scheduler]
    if args.validate:
        from ..planner.order import check_deadlock_free

        _progress(args, f"validating the {args.scheduler} plan ...")
        chosen.validate()
        check_deadlock_free(chosen)
        print(f"{args.scheduler}: plan valid and deadlock-free (hash {chosen.content_hash()[:16]})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(chosen.to_json(), encoding="utf-8")
        print(f"wrote {args.scheduler} plan JSON to {args.json}")
    if args.plot:
        from .gantt import plot_gantt

        _progress(args, "plotting ...")
        panels = [(n, plans[n]) for n in SCHEDULER_ORDER if n in plans]
        written = plot_gantt(panels, cost_model, args.plot)
        print(f"wrote Gantt chart to {written}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bytescale plan``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        return run(args)
    except _UsageError as exc:
        print(f"bytescale plan: error: {exc} (see bytescale plan --help)", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError, json.JSONDecodeError) as exc:
        print(f"bytescale plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
