"""``bytescale simulate``: simulate training steps of several systems side by side, at any scale.

It takes the data and cluster arguments of ``bytescale plan``, plans every step with each
variant (static DP x CP, pow2, HDP naive with and without offload, HDP balance with and
without lookahead) and times the whole step with the planner's own model of time plus the
gradient reduction, the optimizer and the data/plan wait (:mod:`megatron_bytescale.sim`).
Typical use::

    bytescale simulate                                             # Byted-like 32M tokens, LLaMA-7B, 1,024 GPUs
    bytescale simulate --synthetic github --contexts 256K,512K,1M,2M --plot out/sim
    bytescale simulate lengths.txt --hdp-size 512 --model llama-13b --variants static,balance --json sim.json
    bytescale simulate --cost-model out/demo/cost_model.json --hdp-size 4 --capacity 512 --model-params 1.1e6

Errors exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from .plan_inputs import (
    OneLineArgumentParser,
    DEFAULT_CONTEXT,
    add_cluster_arguments,
    add_data_arguments,
    add_scheduling_arguments,
    check_global_tokens,
    EP_SCHEDULERS,
    ep_lockstep_note,
    expert_flags,
    expert_parallel_size,
    load_cost_model,
    load_lengths,
    load_topology,
    model_name,
    moe_note,
    positive_int,
    run_command,
)


def build_parser() -> argparse.ArgumentParser:
    from ..sim.variants import VARIANTS

    p = OneLineArgumentParser(
        prog="bytescale simulate",
        description="Simulate training steps of static DP x CP, Megatron hybrid CP and ByteScale's "
                    "HDP variants side by side on the same global batches: step time, tokens/s per "
                    "GPU, where the time goes, per-rank imbalance.",
    )
    add_data_arguments(p)
    add_cluster_arguments(p)
    sched = p.add_argument_group("scheduling")
    sched.add_argument("--variants", default=",".join(VARIANTS),
                       help=f"comma-separated systems to compare, in table order (default: all: {', '.join(VARIANTS)})")
    add_scheduling_arguments(sched)

    sim = p.add_argument_group("simulation")
    sim.add_argument("--contexts", default=None, metavar="LIST",
                     help="sweep context lengths, e.g. 256K,512K,1M,2M (synthetic data: each context "
                          "draws its own batch with that maximum length)")
    sim.add_argument("--steps", type=positive_int, default=1,
                     help="training steps per context (synthetic data: seeds --seed, --seed + 1, ...; default 1)")
    sim.add_argument("--model-params", type=float, default=None, metavar="N",
                     help="total model parameters for the gradient reduction and optimizer (default: the "
                          "--model preset's count; required with --cost-model to model them)")
    sim.add_argument("--grad-reduce-bytes", type=int, choices=[2, 4], default=4,
                     help="bytes per gradient element in the reduction (default 4: fp32)")
    sim.add_argument("--no-distributed-optimizer", action="store_true",
                     help="plain all-reduce and a full optimizer step per rank instead of ZeRO-1")
    sim.add_argument("--load-s", type=float, default=0.0,
                     help="seconds per step to read the next global batch (hidden by lookahead; default 0)")
    sim.add_argument("--plan-time-s", type=float, default=None,
                     help="seconds the cluster's planner takes per step, a modelled input hidden by "
                          "lookahead (default 0; the planner wall time on this machine is reported "
                          "separately and never added to a simulated step)")
    sim.add_argument("--hardware", default="paper-fit", choices=["paper-fit", "h100"],
                     help="GPU and network preset for --model: paper-fit (default; fitted to the paper's "
                          "own measured cluster, see docs/reproduction.md section 2) or h100 (datasheet "
                          "rates and no straggler wait: 3-4x faster than the paper's measured steps)")
    links = p.add_argument_group("links (override the cost model)")
    links.add_argument("--inter-node-bandwidth", type=float, default=None, metavar="GB/s",
                       help="P2P bandwidth between nodes, one direction, per GPU")
    links.add_argument("--intra-node-bandwidth", type=float, default=None, metavar="GB/s",
                       help="P2P bandwidth inside a node (NVLink), one direction")
    links.add_argument("--pcie-bandwidth", type=float, default=None, metavar="GB/s",
                       help="host<->device bandwidth for offload, each direction")
    links.add_argument("--p2p-latency-us", type=float, default=None, metavar="US",
                       help="latency of one P2P exchange")

    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="FILE", help="write every result (per-rank times included) as JSON")
    out.add_argument("--plot", default=None, metavar="DIR",
                     help="write throughput.png (with --contexts), rank_times.png and ablation.png into DIR")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


# --------------------------------------------------------------------------- inputs
def _progress(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(f"[bytescale simulate] {msg}", file=sys.stderr, flush=True)


def _with_links(args: argparse.Namespace, cost_model: Any) -> Any:
    """The cost model with the link flags applied; each must be a positive number."""
    changes = {}
    for flag, field, scale in (("inter_node_bandwidth", "p2p_bandwidth_inter", 1e9),
                               ("intra_node_bandwidth", "p2p_bandwidth_intra", 1e9),
                               ("pcie_bandwidth", "d2h_bandwidth", 1e9),
                               ("p2p_latency_us", "p2p_latency_s", 1e-6)):
        value = getattr(args, flag)
        if value is None:
            continue
        positive = field != "p2p_latency_s"
        if not (value > 0 if positive else value >= 0) or value != value or value == float("inf"):
            unit = "us" if field == "p2p_latency_s" else "GB/s"
            raise ValueError(f"--{flag.replace('_', '-')} ({value:g}) must be a finite number "
                             f"{'> 0' if positive else '>= 0'} {unit}")
        changes[field] = value * scale
        if field == "d2h_bandwidth":
            changes["h2d_bandwidth"] = value * scale
    return cost_model.with_(**changes) if changes else cost_model


def _tensor_parallel_size(args: argparse.Namespace) -> int:
    from ..planner.presets import model_spec

    tp = args.tensor_model_parallel_size
    if tp is None:
        tp = 1 if args.cost_model else model_spec(model_name(args)).tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must be >= 1")
    return tp


def _overheads(args: argparse.Namespace, *, tp: int, pp: int) -> tuple[Any, str]:
    """The step-level terms and a one-line description of them."""
    from ..planner.presets import model_spec
    from ..sim.overheads import H100_OPTIMIZER_S_PER_PARAM, StepOverheads, parameter_count

    experts, ep, etp = 0.0, 1, tp
    if args.model_params is not None:
        if not args.model_params >= 1:
            raise ValueError(f"--model-params ({args.model_params:g}) must be >= 1")
        total = float(args.model_params)
    elif args.cost_model:
        total = 0.0
    else:
        spec = model_spec(model_name(args))
        counts = parameter_count(spec)
        total = counts["total"]
        ep = getattr(args, "ep_size", None) or spec.expert_parallel_size
        etp = getattr(args, "etp_size", None) or tp
        experts = counts["experts_per_layer"] * spec.num_layers if ep > 1 or etp != tp else 0.0
    for flag in ("load_s", "plan_time_s"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} ({value:g}) must be a finite number of seconds >= 0")
    # 1 / E of the experts with EP, each split over ETP GPUs (tp / etp is 1.0 when ETP = TP)
    on_rank = (total - experts + experts / ep * (tp / etp)) / (tp * pp)
    overheads = StepOverheads(
        params_per_rank=on_rank, expert_params_per_rank=experts / ep / (etp * pp), expert_parallel_size=ep,
        tensor_parallel_size=tp, expert_tensor_parallel_size=None if etp == tp else etp,
        grad_bytes_per_param=float(args.grad_reduce_bytes),
        distributed_optimizer=not args.no_distributed_optimizer,
        optimizer_s_per_param=0.0 if args.cost_model else H100_OPTIMIZER_S_PER_PARAM,
        load_s=args.load_s, plan_s=args.plan_time_s,
    )
    if total <= 0:
        return overheads, "gradient reduction and optimizer not modelled (pass --model-params)"
    how = "plain all-reduce" if args.no_distributed_optimizer else "ZeRO-1 over the HDP group"
    if ep > 1 or etp != tp:
        how += (f" (experts over the {ep}-way expert-parallel split's data-parallel groups"
                + (f", each expert over {etp} GPUs)" if etp != tp else ")"))
    return overheads, f"{total / 1e9:.3g}B parameters, {how}, {args.grad_reduce_bytes}-byte gradients"


def _contexts(args: argparse.Namespace) -> list[int | None]:
    from ..sim.sweep import parse_tokens

    if args.contexts is None:
        return [args.context_length if args.context_length is not None
                else (None if args.lengths is not None else DEFAULT_CONTEXT)]
    if args.lengths is not None:
        raise ValueError("--contexts sweeps synthetic batches; drop the lengths file or --contexts")
    if args.context_length is not None:
        raise ValueError("give either --context-length or --contexts, not both")
    from ..planner.plan import MAX_SEQUENCE_LENGTH

    contexts = []
    for text in args.contexts.split(","):
        try:
            value = parse_tokens(text)
        except ValueError as exc:
            raise ValueError(f"--contexts {args.contexts!r}: {exc}") from None
        if value > MAX_SEQUENCE_LENGTH:
            raise ValueError(f"--contexts {args.contexts!r}: {text.strip()!r} is longer than the "
                             f"{MAX_SEQUENCE_LENGTH:,} (2**40) tokens a sequence may have")
        contexts.append(value)
    return contexts


def _variants_for_ep(args: argparse.Namespace, variants: list[Any], ep: int) -> tuple[list[Any], list[Any]]:
    """(variants to simulate, variants skipped): with expert parallelism only the schedulers
    whose plans meet its slot rule are simulated (a plan an EP run cannot train is not priced)."""
    if ep <= 1:
        return variants, []
    keep = [v for v in variants if v.scheduler in EP_SCHEDULERS]
    skipped = [v for v in variants if v.scheduler not in EP_SCHEDULERS]
    if not keep:
        raise ValueError(f"--variants {args.variants}: none of them plans for {expert_flags(args, ep)} "
                         f"(ring micro-batches at one local index on all members); use balance, "
                         "balance+lookahead or static")
    return keep, skipped


# --------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    from ..data.synthetic import synthetic_lengths
    from ..sim import ClusterSetup, parse_variants, run_sweep, summarize
    from ..sim.report import NOTE, errors, summary_table
    from ..sim.sweep import format_tokens

    variants = parse_variants(args.variants)
    contexts = _contexts(args)
    cost_model, pp = load_cost_model(args)
    cost_model = _with_links(args, cost_model)
    topology = load_topology(args, cost_model)
    tp = _tensor_parallel_size(args)
    ep = expert_parallel_size(args, cost_model)
    variants, skipped = _variants_for_ep(args, variants, ep)
    overheads, overhead_line = _overheads(args, tp=tp, pp=pp)
    if args.vpp_size != 1:
        from ..planner.plan import check_virtual_pipeline

        check_virtual_pipeline(args.vpp_size, pp, max(1, cost_model.num_layers // pp))
    setup = ClusterSetup(
        hdp_size=args.hdp_size, capacity=args.capacity, cost_model=cost_model, pp_size=pp,
        tensor_parallel_size=tp, align=args.align, overlong=args.overlong, delta=args.delta,
        num_buckets=args.num_buckets, overheads=overheads, topology=topology,
        virtual_pipeline_size=args.vpp_size, seq_split=args.seq_split, ep_size=ep,
    )  # fmt: skip
    if args.lengths is not None:
        if args.steps > 1:
            raise ValueError("a lengths file is one global batch; --steps > 1 needs --synthetic")
        file_lengths, source = load_lengths(args)
        lengths_for = lambda context, step: file_lengths  # noqa: E731
    else:
        name = args.synthetic or "byted"
        check_global_tokens(args.global_tokens)
        source = f"synthetic {name} ({args.global_tokens:,} tokens per step, seed {args.seed}"
        source += f"..{args.seed + args.steps - 1})" if args.steps > 1 else ")"

        def lengths_for(context: int | None, step: int) -> Any:
            return synthetic_lengths(name, args.global_tokens, seed=args.seed + step,
                                     max_length=context or DEFAULT_CONTEXT)

    _progress(args, f"{len(contexts)} context(s) x {args.steps} step(s) x {len(variants)} variant(s) "
                    f"on {setup.num_gpus:,} GPUs")
    points = run_sweep(lengths_for, contexts=contexts, steps=args.steps, variants=variants, setup=setup,
                       progress=None if args.quiet else lambda m: _progress(args, m))
    summaries = summarize(points)
    if not any(s.ok for s in summaries):
        raise ValueError(f"no variant could plan the batch: {summaries[0].error}")
    vpp = (f" x VPP {args.vpp_size}" if args.vpp_size != 1 else "") + (", sequence split (balance)" if args.seq_split else "")
    print(f"bytescale simulate: {source}; {setup.num_gpus:,} GPUs = {args.hdp_size:,} HDP ranks x TP {tp} "
          f"x PP {pp}{vpp}, capacity {args.capacity:,}, {topology.ranks_per_node} HDP ranks per node, "
          f"cost model {cost_model.name}{', two-level rings' if cost_model.two_level_ring else ''}; {overhead_line}")
    print(summary_table(summaries))
    print(f"({NOTE})")
    if skipped:
        print(f"note: {', '.join(v.name for v in skipped)} skipped: their schedulers do not guarantee "
              f"every ring micro-batch the same local index on all its members, which "
              f"{expert_flags(args, ep)} needs; balance and static plans here keep it")
    note = moe_note(args)
    if note:
        print(note)
    if ep > 1:
        print(ep_lockstep_note(ep, expert_flags(args, ep)))
    for line in errors(summaries):
        print(line)
    status = 0
    if args.json:
        if _write_json(args, setup, summaries, source, overhead_line):
            print(f"wrote {args.json}")
        else:
            status = 1
    if args.plot:
        from ..sim.plots import plot_sweep

        _progress(args, "plotting ...")
        title = f"{cost_model.name}, {setup.num_gpus:,} GPUs"
        for path in plot_sweep(summaries, args.plot, title=title):
            print(f"wrote {path}")
    ok = [s for s in summaries if s.ok]
    if ok and len(contexts) > 1:
        from ..sim import drop_per_doubling

        drops = {v.name: drop_per_doubling(summaries, v.name) for v in variants}
        print("throughput drop per context doubling: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in drops.items() if v == v) + f" (over {format_tokens(contexts[0])}"
              f"-{format_tokens(contexts[-1])})")
    return status


def _write_json(args: argparse.Namespace, setup: Any, summaries: Sequence[Any], source: str, overheads: str) -> bool:
    """Write every result as JSON to ``--json`` (printed on stdout if that fails); saved?"""
    from .results_io import save_or_print

    data = {
        "version": 1,
        "source": source,
        "hdp_size": setup.hdp_size, "capacity": setup.capacity, "pp_size": setup.pp_size,
        "virtual_pipeline_size": setup.virtual_pipeline_size,
        "tensor_parallel_size": setup.tensor_parallel_size, "num_gpus": setup.num_gpus,
        "cost_model": setup.cost_model.to_dict(), "overheads": overheads,
        "results": [s.to_dict(per_rank=True) for s in summaries],
    }  # fmt: skip
    return save_or_print(args.json, json.dumps(data, indent=1) + "\n", what="simulation results JSON",
                         prog="bytescale simulate")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bytescale simulate``; returns the exit status."""
    return run_command("bytescale simulate", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
