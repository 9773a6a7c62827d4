"""``bytescale profile``: measure this model on this machine and write the planner's cost model.

On the current device (CUDA if there is one, else CPU with gloo) it builds the real megatron-core
GPT from the usual model flags (``--num-layers``, ``--hidden-size``, ...), measures per-layer
forward + backward time of the decoder layers and activation bytes over a range of lengths, the
host link (D2H / H2D) and, with two or more ranks, the ring's P2P bandwidth, latency and step
overhead over the HDP group; then it fits the cost model, prints the fit quality (R^2, residual
per length, warnings) and writes the JSON that ``bytescale plan --cost-model`` and
``--bytescale-cost-model`` read. Run it under ``torchrun`` (one process per GPU), or let it start
``--nproc-per-node`` processes itself. The measurements are :mod:`..integration.calibration`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from megatron_bytescale.env import MAX_PORT, MAX_PROCESSES, env_int, omp_num_threads

DEFAULT_OUT = "cost_model.json"


def build_parser() -> argparse.ArgumentParser:
    from megatron_bytescale.integration.config import add_bytescale_args

    parser = argparse.ArgumentParser(
        prog="bytescale profile",
        description="Measure the model of these flags on this machine and fit the planner's cost model "
                    "(T(s), Act(s), host link, ring P2P); print the fit quality and write the JSON that "
                    "bytescale plan --cost-model / --bytescale-cost-model read.",
    )
    model = parser.add_argument_group("model (Megatron's flags)")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-attention-heads", type=int, default=8)
    model.add_argument("--num-query-groups", type=int, default=None, help="KV heads (GQA); default: no GQA")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    model.add_argument("--seq-length", type=int, default=2048, help="longest length measured by default")
    model.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    model.add_argument("--vocab-size", type=int, default=256, help="embedding rows (not timed)")
    model.add_argument("--tensor-model-parallel-size", type=int, default=1)
    model.add_argument("--num-experts", type=int, default=None,
                       help="MoE: experts per layer (megatron-core's MoE layer, alltoall dispatcher); "
                            "default: a dense model")
    model.add_argument("--moe-router-topk", type=int, default=2, help="MoE: experts per token (default 2)")
    model.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="MoE: each expert's FFN size (default --ffn-hidden-size)")
    model.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="MoE: also time the token all-to-all over expert groups of this many consecutive "
                            "HDP ranks and fit the dispatch terms (default 1: no all-to-all). The layer "
                            "itself is timed with every expert on the rank")
    model.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="MoE: the training run's expert-TP size (default: --tensor-model-parallel-size). "
                            "The all-to-all is timed over EP groups whose members sit this many GPUs apart, "
                            "and the cost model keeps max(1, ETP x EP / TP) HDP ranks in step")
    precision = model.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    run = parser.add_argument_group("profile")
    run.add_argument("--lengths", default=None,
                     help="comma-separated sequence lengths to time (default: --num-lengths lengths from "
                          "--min-length to --max-length, geometric)")
    run.add_argument("--min-length", type=int, default=None, help="default: --max-length / 32")
    run.add_argument("--max-length", type=int, default=None, help="default: --seq-length")
    run.add_argument("--num-lengths", type=int, default=6)
    run.add_argument("--repeats", type=int, default=3, help="timings per length, best kept (default 3)")
    run.add_argument("--nproc-per-node", type=int, default=None,
                     help="processes to start when not under torchrun (default: the GPUs, or 2 on CPU; "
                          "one process measures no P2P link)")
    run.add_argument("--out", default=DEFAULT_OUT, help="cost model JSON to write (default %(default)s)")
    run.add_argument("--report", default=None, metavar="FILE.json",
                     help="also write the samples and the fit report as JSON")
    run.add_argument("--seed", type=int, default=1234)
    add_bytescale_args(parser)
    return parser


def profile_lengths(args: argparse.Namespace) -> list[int]:
    """The lengths to measure; ValueError names the flag."""
    if args.lengths:
        try:
            lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
        except ValueError:
            raise ValueError(f"--lengths {args.lengths!r} must be comma-separated integers") from None
    else:
        top = args.max_length or args.seq_length
        low = args.min_length or max(16, top // 32)
        if args.num_lengths < 3 or not 1 <= low < top:
            raise ValueError(f"--min-length ({low}) must be below --max-length ({top}) and "
                             f"--num-lengths ({args.num_lengths}) at least 3")
        lengths = sorted({int(round(low * (top / low) ** (i / (args.num_lengths - 1))))
                          for i in range(args.num_lengths)})
    positions = args.max_position_embeddings or args.seq_length
    if len(lengths) < 3 or lengths[0] < 1 or lengths[-1] > positions:
        raise ValueError(f"lengths {lengths}: need at least 3 distinct lengths between 1 and "
                         f"--max-position-embeddings ({positions})")
    return lengths


def check_model_flags(args: argparse.Namespace, world_size: int | None) -> None:
    """The model and launch flags, checked before any worker starts (a bad one would otherwise
    end every rank with a traceback); ValueError names the flag. ``world_size``: the processes
    of the job (None: not known yet)."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "tensor_model_parallel_size", "num_lengths", "repeats"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} ({value}) must be >= 1")
    for flag in ("num_query_groups", "ffn_hidden_size", "max_position_embeddings", "min_length",
                 "max_length"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} ({value}) must be >= 1")
    if args.nproc_per_node is not None and not 1 <= args.nproc_per_node <= 1024:
        raise ValueError(f"--nproc-per-node ({args.nproc_per_node}) must be from 1 to 1024 "
                         "(leave it out for one per GPU, or 2 on CPU)")
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    groups = args.num_query_groups or heads
    if args.hidden_size % heads or heads % groups:
        raise ValueError(f"--hidden-size ({args.hidden_size}) must divide by --num-attention-heads ({heads}) "
                         f"and that by --num-query-groups ({groups})")
    if heads % tp or groups % tp:
        raise ValueError(f"--num-attention-heads ({heads}) and --num-query-groups ({groups}) must divide by "
                         f"--tensor-model-parallel-size ({tp})")
    if world_size is not None and world_size % tp:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must divide the {world_size} processes "
                         f"(--nproc-per-node); use {tp} or a multiple of it")
    if args.seed < 0:
        raise ValueError(f"--seed ({args.seed}) must be >= 0")
    check_moe_flags(args, world_size)
    if not args.out:
        raise ValueError("--out is empty; give the cost model JSON file to write")
    omp_num_threads()


def check_moe_flags(args: argparse.Namespace, world_size: int | None) -> None:
    """The MoE flags (ValueError naming the flag)."""
    from megatron_bytescale.planner.expert_layout import expert_lockstep_refusal

    experts, ep, etp = args.num_experts, args.expert_model_parallel_size, args.expert_tensor_parallel_size
    tp = args.tensor_model_parallel_size
    if etp is not None and etp < 1:
        raise ValueError(f"--expert-tensor-parallel-size ({etp}) must be >= 1 (leave it out for the TP size)")
    if experts is None:
        if ep != 1:
            raise ValueError(f"--expert-model-parallel-size ({ep}) needs a MoE model: give --num-experts")
        if etp is not None and etp != tp:
            raise ValueError(f"--expert-tensor-parallel-size ({etp}) needs a MoE model: give --num-experts")
        return
    if experts < 2:
        raise ValueError(f"--num-experts ({experts}) must be >= 2 (leave it out for a dense model)")
    if not 1 <= args.moe_router_topk <= experts:
        raise ValueError(f"--moe-router-topk ({args.moe_router_topk}) must be from 1 to --num-experts ({experts})")
    if args.moe_ffn_hidden_size is not None and args.moe_ffn_hidden_size < 1:
        raise ValueError(f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must be >= 1")
    if ep < 1 or experts % ep:
        raise ValueError(f"--expert-model-parallel-size ({ep}) must divide --num-experts ({experts})")
    why = expert_lockstep_refusal(tp, etp, ep, who="an HDP run cannot keep in step")
    if why:
        raise ValueError(why)
    if world_size is None:
        return
    if etp in (None, tp):
        hdp = world_size // args.tensor_model_parallel_size
        if ep > 1 and hdp % ep:
            raise ValueError(f"--expert-model-parallel-size ({ep}) must divide the {hdp} HDP ranks "
                             f"(--nproc-per-node / --tensor-model-parallel-size)")
    elif world_size % (etp * ep):
        raise ValueError(f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) = "
                         f"{etp * ep} GPUs of an expert group must divide the {world_size} processes "
                         "(--nproc-per-node)")


_WORKER_HINT = ("bytescale profile runs as a torchrun worker when WORLD_SIZE is set; unset "
                "WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE to let it start the workers")


def _world_size(args: argparse.Namespace) -> int:
    """Processes of the job: torchrun's WORLD_SIZE, else what :func:`launch` will start."""
    if "WORLD_SIZE" in os.environ:
        return env_int("WORLD_SIZE", low=1, high=MAX_PROCESSES, hint=_WORKER_HINT)
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_model_flags(args, None)
        lengths = profile_lengths(args)
        world = _world_size(args)
        check_model_flags(args, world)
        if "WORLD_SIZE" in os.environ:  # a worker: what run_worker reads, checked before torch
            check_worker_environment(world)
    except ValueError as exc:
        parser.error(str(exc))
    if "WORLD_SIZE" in os.environ:
        return run_worker(args, lengths)
    return launch(args, list(sys.argv[1:] if argv is None else argv))


def check_worker_environment(world_size: int) -> None:
    """The variables a worker reads besides WORLD_SIZE (one line naming a bad one)."""
    env_int("RANK", low=0, high=world_size - 1, default=0, hint=_WORKER_HINT)
    local = env_int("LOCAL_WORLD_SIZE", low=1, high=world_size, default=world_size, hint=_WORKER_HINT)
    env_int("LOCAL_RANK", low=0, high=local - 1, default=0, hint=_WORKER_HINT)
    env_int("MASTER_PORT", low=1, high=MAX_PORT, default=None, hint=_WORKER_HINT)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--nproc-per-node`` workers with torch.distributed.run and wait for them.

    Started like the demo's (:func:`.demo_process.run_supervised`): in their own session, with
    their output relayed until a signal arrives, so Ctrl-C is one line, not a traceback per rank.
    """
    import signal

    from .demo_process import Interrupted, run_supervised

    nproc = _world_size(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), "-m", "megatron_bytescale.tools.profile_cmd", *argv]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or "1"
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    try:
        returncode = run_supervised(command, env=env)
    except Interrupted as exc:
        what = "interrupted (SIGINT)" if exc.signum == signal.SIGINT else str(exc)
        print(f"bytescale profile: {what}; torchrun and its workers were stopped", file=sys.stderr)
        return 128 + exc.signum
    if returncode != 0:
        print(f"bytescale profile: the workers failed (exit code {returncode}); see above", file=sys.stderr)
    return returncode


def run_worker(args: argparse.Namespace, lengths: list[int]) -> int:
    """One rank: set up Megatron for HDP, build the model, profile it; rank 0 reports."""
    import torch
    import torch.distributed as dist

    from megatron_bytescale.integration.config import ByteScaleConfig

    config = ByteScaleConfig.from_args(args)
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(env_int("LOCAL_RANK", low=0, high=MAX_PROCESSES, default=0))
    else:
        torch.set_num_threads(omp_num_threads())
    dist.init_process_group("nccl" if on_cuda else "gloo")
    saved = True
    try:
        result = _profile(args, config, lengths, on_cuda=on_cuda)
        dist.barrier()  # every collective done: a failed write on rank 0 cannot strand the others
        if dist.get_rank() == 0:
            saved = _report(args, result)
    finally:
        dist.destroy_process_group()
    return 0 if saved else 1


def _profile(args: argparse.Namespace, config: Any, lengths: list[int], *, on_cuda: bool) -> Any:
    import torch
    import torch.distributed as dist

    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel
    from megatron_bytescale.integration.profile_source import profile_model
    from megatron_bytescale.integration.training import (
        build_gpt_model,
        make_transformer_config,
        seed_model_parallel,
    )

    if not on_cuda:
        from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

        enable_cpu_megatron()
    tp = args.tensor_model_parallel_size
    manager = initialize_hdp_model_parallel(tensor_model_parallel_size=tp,
                                            attention_backend=config.ring_attention_backend,
                                            dkv_wire=config.dkv_wire_dtype)
    seed_model_parallel(args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    moe: dict[str, Any] = {}
    if args.num_experts is not None:  # megatron-core's MoE layer; TP needs sequence parallelism
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size or 4 * args.hidden_size,
                   moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                   add_bias_linear=False, sequence_parallel=tp > 1)
    model_config = make_transformer_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, tensor_model_parallel_size=tp,
        bf16=args.bf16, fp16=args.fp16, params_dtype=dtype, **moe,
    )  # fmt: skip
    model = build_gpt_model(model_config, vocab_size=args.vocab_size,
                            max_sequence_length=args.max_position_embeddings or args.seq_length)
    start = time.perf_counter()
    rank0 = dist.get_rank() == 0

    def progress(message: str) -> None:
        if rank0:
            print(f"[bytescale profile {time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr,
                  flush=True)

    local = env_int("LOCAL_WORLD_SIZE", low=1, high=MAX_PROCESSES, default=dist.get_world_size())
    etp = args.expert_tensor_parallel_size
    what = (f"MoE ({args.num_experts} experts, top-{args.moe_router_topk}, EP "
            f"{args.expert_model_parallel_size}{f', ETP {etp}' if etp not in (None, tp) else ''}) "
            if args.num_experts else "")
    progress(f"{args.num_layers}-layer {what}GPT on {manager.size} HDP rank(s), lengths {lengths}")
    return profile_model(model, manager, lengths=lengths, repeats=args.repeats,
                         vocab_size=args.vocab_size, dkv_wire=config.dkv_wire_dtype, progress=progress,
                         ranks_per_node=max(1, local // tp),
                         expert_parallel_size=args.expert_model_parallel_size,
                         expert_tensor_parallel_size=etp)


def _report(args: argparse.Namespace, result: Any) -> bool:
    """Print the fit and write the files (each printed on stdout if it cannot be written);
    returns whether everything was saved."""
    from megatron_bytescale.planner.profile import format_report

    from .results_io import save_or_print

    print(format_report(result))
    prog = "bytescale profile"
    saved = save_or_print(args.out, json.dumps(result.cost_model.to_dict(), indent=2) + "\n",
                          what="cost model JSON", prog=prog)
    if saved:
        print(f"cost model: {args.out}  (bytescale plan --cost-model {args.out}; "
              f"pretrain_gpt.py --bytescale-cost-model {args.out})")
    if args.report:
        if save_or_print(args.report, json.dumps(result.to_dict(), indent=1) + "\n", what="profile report",
                         prog=prog):
            print(f"report:     {args.report}")
        else:
            saved = False
    return saved


if __name__ == "__main__":
    sys.exit(main())
