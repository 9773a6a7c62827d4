"""The data and cluster arguments that ``bytescale plan`` and ``bytescale simulate`` share.

Both commands take the same global batch (a lengths file, a Megatron index, or a synthetic
mix) and the same cluster (HDP ranks, capacity, model preset or saved cost model, TP/PP,
nodes), so a plan and its simulation always describe the same thing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

DEFAULT_GLOBAL_TOKENS = 32 * 2**20
DEFAULT_CONTEXT = 2_097_152
DEFAULT_MODEL = "llama-7b"
MAX_GLOBAL_TOKENS = 2**36
"""Most tokens of a synthetic global batch (68.7 billion, 2,000 times the paper's 32M)."""
_MAX_NODE_MAP_BYTES = 64 * 2**20


class UsageError(Exception):
    """Bad command line, reported like every other error (one line, exit 2)."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump), like every other error."""

    def error(self, message: str) -> None:
        raise UsageError(message)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a size, a count, a number of tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def run_command(prog: str, parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
                argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run; bad input of any kind is one line on stderr and exit status 2."""
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        return run(args)
    except UsageError as exc:
        print(f"{prog}: error: {exc} (see {prog} --help)", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError, json.JSONDecodeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The ``data`` group: lengths file or ``--synthetic``, batch size, seed, context."""
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


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The ``cluster and model`` group: HDP size, capacity, PP/TP, model or cost model, nodes."""
    cluster = p.add_argument_group("cluster and model")
    cluster.add_argument("--hdp-size", type=positive_int, default=1024, help="HDP ranks (DP x CP of Megatron; default 1024)")
    cluster.add_argument("--capacity", type=positive_int, default=8192, help="tokens per rank per micro-batch, C (default 8192)")
    cluster.add_argument("--pp-size", type=positive_int, default=None, help="pipeline stages (default: the model preset's)")
    cluster.add_argument("--vpp-size", "--virtual-pipeline-model-parallel-size", dest="vpp_size", type=positive_int,
                         default=1, help="model chunks per pipeline stage: estimate interleaved 1F1B, whose fill and "
                                         "drain shrink by this factor (default 1: plain 1F1B; needs --pp-size > 1)")
    cluster.add_argument("--tensor-model-parallel-size", type=positive_int, default=None,
                         help="TP degree (default: the model preset's)")
    cluster.add_argument("--expert-model-parallel-size", "--ep-size", dest="ep_size", type=positive_int,
                         default=None,
                         help="EP degree of a mixture-of-experts --model preset: experts split over this many "
                              "consecutive HDP ranks, tokens dispatched by all-to-all, which the cost model "
                              "charges (default 1: no all-to-all)")
    cluster.add_argument("--expert-tensor-parallel-size", "--etp-size", dest="etp_size", type=positive_int,
                         default=None,
                         help="expert-TP degree of a mixture-of-experts --model preset: each expert split over "
                              "this many GPUs; an expert group is then ETP x EP GPUs, i.e. max(1, ETP x EP / TP) "
                              "HDP ranks that plans keep in step (default: the TP degree, Megatron's default)")
    cluster.add_argument("--model", default=None,
                         help="model preset: llama-7b, llama-13b, llama-30b, llama-70b, mistral-8x7b, "
                              "mistral-8x22b (default llama-7b; not with --cost-model)")
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


def add_scheduling_arguments(group: Any) -> None:
    """Scheduler settings every scheduler shares: overlong handling, alignment, Alg. 2's knobs."""
    group.add_argument("--overlong", choices=["error", "drop", "truncate"], default="error",
                       help="what to do with a sequence that cannot fit (default error)")
    group.add_argument("--align", type=positive_int, default=1, help="zigzag padding alignment per part (default 1)")
    group.add_argument("--delta", type=float, default=0.05, help="Alg. 2 threshold, fraction of max time (default 0.05)")
    group.add_argument("--num-buckets", type=positive_int, default=4, help="Alg. 2 equal-work buckets (default 4)")
    group.add_argument("--seq-split", action="store_true",
                       help="balance with PP > 1: split the longest rings into 2/4/8 causal chunks along the "
                            "pipeline where the estimate says it pays and their kept K/V fits the capacity "
                            "(plain 1F1B, no expert parallelism)")


def load_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """The global batch's sequence lengths from the data arguments, and where they came from."""
    if args.lengths is not None:
        if args.synthetic is not None:
            raise ValueError("give either a lengths file or --synthetic, not both")
        path = Path(args.lengths)
        if path.suffix in (".idx", ".bin") or (not path.exists() and Path(str(path) + ".idx").exists()):
            from ..integration.indexed_lengths import read_indexed_lengths

            lengths, source = read_indexed_lengths(path), f"Megatron index {path}"
        else:
            from ..data.lengths import read_lengths

            lengths, source = read_lengths(path), f"file {path}"
        if len(lengths) == 0:
            raise ValueError(f"{source} holds no sequences (no lengths, or only empty documents): "
                             "nothing to plan")
        return lengths, source
    from ..data.synthetic import synthetic_lengths

    name = args.synthetic or "byted"
    max_len = args.context_length or DEFAULT_CONTEXT
    check_global_tokens(args.global_tokens)
    lengths = synthetic_lengths(name, args.global_tokens, seed=args.seed, max_length=max_len)
    return lengths, f"synthetic {name} ({args.global_tokens:,} tokens, seed {args.seed}, max {max_len:,})"


def check_global_tokens(tokens: int) -> None:
    """Refuse a synthetic batch too large to hold its lengths in memory."""
    if tokens > MAX_GLOBAL_TOKENS:
        raise ValueError(f"--global-tokens ({tokens:,}) is more than the {MAX_GLOBAL_TOKENS:,} (2**36) tokens a "
                         "synthetic batch may have; plan a smaller batch (the paper's is 32M tokens)")


def model_name(args: argparse.Namespace) -> str:
    """The ``--model`` preset (default llama-7b); refused together with ``--cost-model``,
    which would otherwise replace it without a word."""
    if args.cost_model and args.model is not None:
        raise ValueError(f"give either --model {args.model} or --cost-model {args.cost_model}, not both: "
                         "a cost model file already describes the model")
    return args.model or DEFAULT_MODEL


def moe_note(args: argparse.Namespace) -> str | None:
    """What a mixture-of-experts ``--model`` preset's numbers are, in one line (None: dense).

    The presets' cost model counts the router and top-k experts per token plus the token
    dispatch (the dispatcher's copies and TP collectives, and the all-to-alls with
    ``--expert-model-parallel-size`` > 1; :mod:`..planner.moe_cost`), and the plugin trains MoE
    under HDP only in some layouts (docs/moe.md), so the output must not read as a measured or
    necessarily trainable MoE layout.
    """
    from ..planner.presets import model_spec

    if args.cost_model:
        return None
    spec = model_spec(model_name(args))
    if spec.num_experts <= 1:
        return None
    ep = getattr(args, "ep_size", None) or spec.expert_parallel_size
    dispatch = (f"the all-to-all over expert-parallel groups of {ep}" if ep > 1
                else "no all-to-all (expert parallelism 1)")
    etp = getattr(args, "etp_size", None)
    if etp is not None:
        dispatch += f", experts split over {etp} GPUs (expert-tensor parallelism)"
    return (f"note: {spec.name} is a mixture-of-experts model ({spec.num_experts} experts, "
            f"top-{spec.moe_router_topk}); the cost model counts the router and top-"
            f"{spec.moe_router_topk} experts per token and the token dispatch ({dispatch}), "
            "and the plugin trains MoE under HDP with tensor parallelism, pipeline parallelism "
            "or both, with or without expert parallelism (docs/moe.md): "
            "an analytic estimate, not a measured layout")


#: Schedulers whose plans keep every ring micro-batch at the same local index (slot) on all its
#: members, the rule expert parallelism's all-to-all needs (``StepPlan.ep_size``).
EP_SCHEDULERS = ("balance", "static")


def expert_parallel_size(args: argparse.Namespace, cost_model: Any) -> int:
    """The plans' ``ep_size``: the HDP ranks one expert group spans, which plans keep in step
    (:attr:`.CostModel.plan_ep_size`: E, or ``max(1, ETP x E / TP)`` with
    ``--expert-tensor-parallel-size``; the ``--cost-model`` file's); it must divide ``--hdp-size``."""
    ep = int(getattr(cost_model, "plan_ep_size", getattr(cost_model, "expert_parallel_size", 1)))
    hdp = getattr(args, "hdp_size", None)
    if ep > 1 and hdp is not None and hdp % ep:
        raise ValueError(f"expert-parallel size {ep} (of the cost model) must divide --hdp-size ({hdp}): "
                         "expert groups are that many consecutive HDP ranks")
    return ep


def expert_flags(args: argparse.Namespace, ep: int) -> str:
    """The flags that make expert groups of ``ep`` HDP ranks, as messages name them."""
    etp = getattr(args, "etp_size", None)
    if etp is None:
        return f"--expert-model-parallel-size {ep}"
    return (f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {args.ep_size or 1} "
            f"(expert groups of {ep} HDP ranks)")


def ep_lockstep_note(ep: int, flags: str | None = None) -> str:
    """What estimates and simulated steps at expert parallelism ``ep`` charge, in one line
    (``flags``: :func:`expert_flags`, default ``--expert-model-parallel-size {ep}``)."""
    flags = flags or f"--expert-model-parallel-size {ep}"
    return (f"note: with {flags} the members of an expert group wait for each "
            "other in every slot (each MoE layer's all-to-all); the estimated steps charge that wait, "
            "an empty slot included, and balance sorts each member's micro-batches so that similar ones "
            "share a slot (docs/moe.md)")


def ep_refusal(scheduler: str, ep: int, flags: str | None = None) -> str:
    """Why ``scheduler`` cannot plan for expert parallelism ``ep``, in one line (``flags``:
    :func:`expert_flags`, default ``--expert-model-parallel-size {ep}``)."""
    flags = flags or f"--expert-model-parallel-size {ep}"
    return (f"scheduler {scheduler!r} cannot plan for {flags}: it does not guarantee "
            "every ring micro-batch the same local index on all its members, which the experts' "
            f"all-to-all needs; use " + " or ".join(f"--scheduler {s}" for s in EP_SCHEDULERS))


def load_cost_model(args: argparse.Namespace) -> tuple[Any, int]:
    """The cost model (``--cost-model`` file, else the ``--model`` preset at its or the given
    TP; two-level rings with ``--two-level-ring``) and the PP size (``--pp-size``, else the
    preset's, else 1)."""
    from ..planner.cost_model import CostModel
    from ..planner.expert_layout import expert_lockstep_refusal, expert_lockstep_size
    from ..planner.presets import model_spec, preset_cost_model

    model = model_name(args)
    ep = getattr(args, "ep_size", None)
    etp = getattr(args, "etp_size", None)
    if args.cost_model:
        for flag, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
            if value is not None:
                raise ValueError(f"{flag} {value} applies to a --model preset; a cost model file already "
                                 "holds its MoE dispatch terms (bytescale profile --num-experts)")
        cm, pp = CostModel.load(args.cost_model), args.pp_size or 1
    else:
        spec = model_spec(model)
        if ep is not None and ep > 1 and spec.num_experts <= 1:
            raise ValueError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts --model "
                             f"(mistral-8x7b, mistral-8x22b); {model} is dense")
        tp = args.tensor_model_parallel_size or spec.tensor_parallel_size
        if etp is not None and etp != tp and spec.num_experts <= 1:
            raise ValueError(f"--expert-tensor-parallel-size {etp} needs a mixture-of-experts --model "
                             f"(mistral-8x7b, mistral-8x22b); {model} is dense")
        why = (expert_lockstep_refusal(tp, etp, ep or spec.expert_parallel_size, who="HDP plans cannot keep "
                                       "in step") if etp is not None else None)
        if why:
            raise ValueError(why)
        hdp = getattr(args, "hdp_size", None)
        block = expert_lockstep_size(tp, etp, ep or spec.expert_parallel_size) if etp is not None else ep
        if block is not None and hdp is not None and hdp % block:
            what = (f"--expert-model-parallel-size ({ep})" if etp is None else
                    f"an expert group of --expert-tensor-parallel-size {etp} x --expert-model-parallel-size "
                    f"{ep or spec.expert_parallel_size} GPUs ({block} HDP ranks of TP {tp})")
            raise ValueError(f"{what} must divide --hdp-size ({hdp}): expert groups are that many "
                             "consecutive HDP ranks")
        cm = preset_cost_model(model, getattr(args, "hardware", "h100"),
                               tensor_parallel_size=args.tensor_model_parallel_size,
                               expert_parallel_size=ep, expert_tensor_parallel_size=etp)
        pp = args.pp_size or model_spec(model).pipeline_parallel_size
    if getattr(args, "two_level_ring", False):
        cm = cm.with_(two_level_ring=True)
    host = getattr(args, "host_memory_gb", None)
    if host is not None:
        if not (host > 0 and host != float("inf")):
            raise ValueError(f"--host-memory-gb ({host}) must be a positive number of GB")
        cm = cm.with_(host_memory_bytes=host * 1e9)
    return cm, pp


def load_topology(args: argparse.Namespace, cost_model: Any) -> Any:
    """The :class:`~megatron_bytescale.planner.topology.Topology` of ``--node-map`` or
    ``--ranks-per-node``, else the cost model's ranks per node."""
    from ..planner.topology import Topology

    if args.node_map is not None:
        if args.ranks_per_node is not None:
            raise ValueError("give either --ranks-per-node or --node-map, not both")
        from ..planner.inputs import loads_json, parse_decimal, read_text_file, split_lines

        path = Path(args.node_map)
        what = f"--node-map {str(path)!r}"
        text = read_text_file(path, "--node-map file", max_bytes=_MAX_NODE_MAP_BYTES)
        if text.lstrip().startswith("["):
            nodes = loads_json(text, what)
            if not isinstance(nodes, list):
                raise ValueError(f"{what} must be a JSON list of node ids, one per HDP rank")
        else:
            nodes = [parse_decimal(word, f"{what}, line {i}")
                     for i, line in enumerate(split_lines(text), start=1) for word in line.replace("\t", " ").split(" ") if word]
        if len(nodes) != args.hdp_size:
            raise ValueError(f"--node-map {str(path)!r} names {len(nodes)} HDP ranks but --hdp-size is {args.hdp_size}")
        return Topology.from_node_map(nodes)
    if args.ranks_per_node is not None:
        if not 1 <= args.ranks_per_node <= 2**31 - 1:
            raise ValueError(f"--ranks-per-node ({args.ranks_per_node}) must be >= 1 (at most {2**31 - 1:,})")
        return Topology(ranks_per_node=args.ranks_per_node)
    return Topology.of(cost_model)
