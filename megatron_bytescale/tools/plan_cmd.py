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
import sys
import time
from typing import Any, Sequence

import numpy as np

from .plan_inputs import (
    OneLineArgumentParser,
    add_cluster_arguments,
    add_data_arguments,
    add_scheduling_arguments,
    EP_SCHEDULERS,
    ep_lockstep_note,
    ep_refusal,
    expert_flags,
    expert_parallel_size,
    load_cost_model,
    load_lengths,
    load_topology,
    moe_note,
    run_command,
)

SCHEDULER_ORDER = ("balance", "naive", "static", "pow2")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="bytescale plan",
        description="Plan one global batch over HDP ranks with ByteScale's schedulers and show "
                    "what each would cost (estimated with the analytic or a saved cost model).",
    )
    add_data_arguments(p)
    add_cluster_arguments(p)

    sched = p.add_argument_group("scheduling")
    sched.add_argument("--scheduler", default="balance", choices=list(SCHEDULER_ORDER),
                       help="scheduler whose plan --json/--plot use (default balance)")
    sched.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                       help="Eq. 3 selective offload for naive/balance (default on)")
    sched.add_argument("--host-memory-gb", type=float, default=None,
                       help="host memory per HDP rank (GB) offloaded activations may fill (default: "
                            "the cost model's, unlimited unless it sets one)")
    add_scheduling_arguments(sched)

    out = p.add_argument_group("output")
    out.add_argument("--compare", action="store_true",
                     help="run every scheduler and print them side by side, with Megatron's own "
                          "hybrid CP scheduler (megatron-core 0.19+) as the megatron-hybrid-cp row")
    out.add_argument("--megatron-hybrid-cp", action=argparse.BooleanOptionalAction, default=True,
                     help="with --compare, also run Megatron's own hybrid CP scheduler (default on; "
                          "it takes minutes at 1,024 ranks: see docs/benchmarks.md)")
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


# --------------------------------------------------------------------------- output
def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _ep_label(args: argparse.Namespace, ep: int) -> str:
    """``EP {ep}``, or with ``--expert-tensor-parallel-size`` the HDP ranks an expert group spans."""
    if getattr(args, "etp_size", None) is None:
        return f"EP {ep}"
    return f"ETP {args.etp_size} x EP {args.ep_size or 1}: expert groups of {ep} HDP ranks"


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


# --------------------------------------------------------------------------- Megatron's row
MEGATRON_ROW = "megatron-hybrid-cp"


def _megatron_hybrid_cp_row(args: argparse.Namespace, lengths: Any, cost_model: Any, pp_size: int,
                            topology: Any, plans: dict[str, Any], rows: list[dict[str, Any]],
                            failed: dict[str, str]) -> None:
    """The "Megatron hybrid CP" row: megatron-core 0.19's own scheduler (``--hybrid-context-
    parallel``) run on the same batch, or why it cannot run here."""
    from ..integration.megatron_hybrid_cp import (
        megatron_hybrid_cp_unavailable,
        plan_megatron_hybrid_cp,
    )

    why = megatron_hybrid_cp_unavailable()
    if why is None and pp_size > 1:
        why = f"Megatron's hybrid CP does not support pipeline parallelism (PP {pp_size})"
    if why is not None:
        failed[MEGATRON_ROW] = why
        return
    _progress(args, f"planning with Megatron's hybrid CP scheduler on {args.hdp_size:,} ranks ...")
    t0 = time.perf_counter()
    try:
        plan = plan_megatron_hybrid_cp(lengths, hdp_size=args.hdp_size, capacity=args.capacity,
                                       cost_model=cost_model, align=args.align, topology=topology,
                                       context_length=args.context_length)
    except ValueError as exc:
        failed[MEGATRON_ROW] = str(exc)
        return
    dt = time.perf_counter() - t0
    _progress(args, f"  {MEGATRON_ROW}: {dt * 1e3:.0f} ms, estimated step "
                    f"{plan.estimate.step_time_s:.2f} s")
    plans[MEGATRON_ROW] = plan
    rows.append(_row(MEGATRON_ROW, plan, dt))


# --------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    from ..planner.plan import check_virtual_pipeline
    from ..planner.schedulers import check_seq_split, make_plan

    lengths, source = load_lengths(args)
    cost_model, pp_size = load_cost_model(args)
    if args.vpp_size != 1:
        check_virtual_pipeline(args.vpp_size, pp_size, max(1, cost_model.num_layers // pp_size))
    ep = expert_parallel_size(args, cost_model)
    flags = expert_flags(args, ep)
    if args.seq_split:
        check_seq_split(scheduler=args.scheduler, pp_size=pp_size, ep_size=ep,
                        virtual_pipeline_size=args.vpp_size, flag="--seq-split")
    topology = load_topology(args, cost_model)
    if ep > 1 and args.scheduler not in EP_SCHEDULERS:
        raise ValueError(ep_refusal(args.scheduler, ep, flags))
    _progress(args, f"{len(lengths):,} sequences, {int(lengths.sum()):,} tokens from {source}")
    context = args.context_length
    names = list(SCHEDULER_ORDER) if args.compare else [args.scheduler]
    plans: dict[str, Any] = {}
    rows, failed = [], {}
    for name in names:
        if ep > 1 and name not in EP_SCHEDULERS:  # --compare: the row says why
            failed[name] = ep_refusal(name, ep, flags)
            continue
        _progress(args, f"planning with {name} on {args.hdp_size:,} HDP ranks ...")
        t0 = time.perf_counter()
        try:
            plan = make_plan(
                lengths, scheduler=name, hdp_size=args.hdp_size, capacity=args.capacity,
                cost_model=cost_model, pp_size=pp_size, offload=args.offload, overlong=args.overlong,
                align=args.align, context_length=context, delta=args.delta, num_buckets=args.num_buckets,
                topology=topology, seq_split=args.seq_split and name == "balance",
                ep_size=ep, virtual_pipeline_size=args.vpp_size,
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
    if args.compare and args.megatron_hybrid_cp and ep > 1:
        failed[MEGATRON_ROW] = ep_refusal("megatron-hybrid-cp", ep, flags)
    elif args.compare and args.megatron_hybrid_cp:  # Megatron's own scheduler, costed the same way
        _megatron_hybrid_cp_row(args, lengths, cost_model, pp_size, topology, plans, rows, failed)
    print(f"bytescale plan: {source}; {args.hdp_size:,} HDP ranks x capacity {args.capacity:,}, "
          f"{topology.ranks_per_node} per node{' (node map)' if topology.node_of else ''}, "
          f"PP {pp_size}{f' x VPP {args.vpp_size}' if args.vpp_size != 1 else ''}"
          f"{f', {_ep_label(args, ep)} (ring micro-batches at one slot on all members)' if ep > 1 else ''}"
          f", cost model {cost_model.name}, offload {'on' if args.offload else 'off'}"
          f"{', two-level rings' if args.two_level_ring else ''}{', sequence split (balance)' if args.seq_split else ''}")
    _print_table(rows, failed)
    note = moe_note(args)
    if note:
        print(note)
    if ep > 1:
        print(ep_lockstep_note(ep, flags))
    for plan in plans.values():
        _report_overlong(plan)
    chosen = plans[args.scheduler]
    if args.validate:
        from ..planner.order import check_deadlock_free

        _progress(args, f"validating the {args.scheduler} plan ...")
        chosen.validate()
        check_deadlock_free(chosen)
        print(f"{args.scheduler}: plan valid and deadlock-free (hash {chosen.content_hash()[:16]})")
    status = 0
    if args.json:
        from .results_io import save_or_print

        if save_or_print(args.json, chosen.to_json(), what=f"{args.scheduler} plan JSON", prog="bytescale plan"):
            print(f"wrote {args.scheduler} plan JSON to {args.json}")
        else:
            status = 1
    if args.plot:
        from .gantt import plot_gantt

        _progress(args, "plotting ...")
        panels = [(n, plans[n]) for n in (*SCHEDULER_ORDER, MEGATRON_ROW) if n in plans]
        written = plot_gantt(panels, cost_model, args.plot)
        print(f"wrote Gantt chart to {written}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bytescale plan``; returns the exit status."""
    return run_command("bytescale plan", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
