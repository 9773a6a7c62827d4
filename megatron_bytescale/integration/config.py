"""``ByteScaleConfig`` and the ``--bytescale-*`` command-line flags generated from it.

The dataclass is the single source of truth: every field carries a docstring, and
:func:`add_bytescale_args` turns the fields into an argparse group the way Megatron's
``ArgumentGroupFactory`` does (``foo_bar`` becomes ``--bytescale-foo-bar``, stored as
``args.bytescale_foo_bar``; the field docstring becomes the help; a bool becomes the pair
``--bytescale-x`` / ``--no-bytescale-x``; a ``Literal`` becomes ``choices``). The function has
the signature of Megatron's ``extra_args_provider(parser) -> parser``, so a patched
``pretrain_gpt.py`` passes it straight through. :meth:`ByteScaleConfig.from_args` reads the
parsed namespace back and validates it, raising ``ValueError`` that names the flag and value.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Optional

FLAG_PREFIX = "bytescale"

SchedulerName = Literal["naive", "balance", "static", "pow2"]
PlanMode = Literal["every_rank", "rank0_broadcast"]
AttentionBackend = Literal["auto", "torch", "math", "flash_attn", "te"]
DkvWire = Literal["accumulator", "input"]
OverlongPolicy = Literal["error", "drop", "truncate"]
DataLoaderName = Literal["local", "ray"]


class RefusedArguments(ValueError):
    """Every reason why ``--bytescale-hdp`` cannot run with the arguments given, at once.

    ``reasons`` holds one sentence per refused argument, each saying what is unsupported and
    what to do; the message lists them all, so a user fixes the command line in one go.
    """

    def __init__(self, reasons: "list[str] | tuple[str, ...]") -> None:
        self.reasons = tuple(reasons)
        if len(self.reasons) == 1:
            message = self.reasons[0]
        else:
            message = f"--bytescale-hdp cannot run with these {len(self.reasons)} arguments:\n" + (
                "\n".join(f"  - {reason}" for reason in self.reasons)
            )
        super().__init__(message)


@dataclass(frozen=True, kw_only=True)
class ByteScaleConfig:
    """Everything the plugin needs to know beyond Megatron's own arguments."""

    hdp: bool = False
    """Train with Hybrid Data Parallelism: Megatron runs with context-parallel size 1 and the
    data-parallel group becomes the HDP group; every global batch is planned by ByteScale."""

    capacity: Optional[int] = None
    """Token capacity C of one HDP rank per micro-batch (the paper's C; Megatron's analogue is
    --max-seqlen-per-dp-cp-rank): the most tokens whose activations one rank holds at once.
    Defaults to --seq-length."""

    scheduler: SchedulerName = "balance"
    """How a global batch is planned: 'balance' (ByteScale Alg. 2, ranks get different numbers
    of micro-batches so they finish together), 'naive' (Alg. 1, data-aware sharding only),
    'static' (Megatron-style DP x CP packing, one ring over a fixed CP group), 'pow2' (ring
    sizes rounded to powers of two, like Megatron's hybrid context parallel)."""

    offload: bool = False
    """Selective activation offload (paper Eq. 3): plan long sequences on fewer ranks, each
    holding more than C tokens, and park the planned share of every such micro-batch's saved
    activations in host memory during its forward (reloaded one layer ahead in backward)."""

    host_memory_gb: Optional[float] = None
    """Host memory per HDP rank, in GB (10^9 bytes), that offloaded activations may fill: the
    planner never picks an offload ratio that needs more (it uses a larger ring instead).
    Default: the cost model's budget (unlimited unless the cost model JSON sets one)."""

    plan_mode: PlanMode = "every_rank"
    """Where the plan is computed: 'every_rank' plans deterministically on every rank (no
    communication), 'rank0_broadcast' plans on rank 0 and broadcasts the plan. Either way the
    ranks compare plan hashes before training on a plan."""

    align: int = 1
    """Zigzag alignment: every one of the 2N parts of a sequence split over an N-rank ring is
    padded to a multiple of this many tokens (some attention kernels want tiles)."""

    context_length: Optional[int] = None
    """Longest sequence the job accepts, in tokens; also sizes the static baseline's CP group
    (ceil(context_length / capacity) ranks). Defaults to --seq-length."""

    overlong: OverlongPolicy = "error"
    """What the planner does with a sequence longer than the longest it can place (the context
    length, or what all HDP ranks can hold): 'error' stops naming the sequence, 'drop' leaves
    it out of the step, 'truncate' keeps its first tokens."""

    attention_backend: AttentionBackend = "auto"
    """Kernel under the dynamic-ring attention: 'torch' (PyTorch's own kernels, no extra
    package: FlashAttention-2 varlen on CUDA for fp16/bf16, head dim a multiple of 8 up to 256,
    sm80+; the CPU flash kernels on CPU), 'math' (tiled fp32 matmuls, any device, 10-50x slower
    on a GPU), 'flash_attn' (CUDA, needs flash-attn), 'te' (CUDA, needs Transformer Engine),
    'auto' (on CUDA the first of te, flash_attn, torch that is installed and runs the dtype and
    head dim, else math with a warning saying why; torch on CPU)."""

    dkv_wire_dtype: DkvWire = "accumulator"
    """Dtype of the dK/dV accumulators that travel around a ring in the backward:
    'accumulator' (float32: exact partial sums; with bf16 K/V the backward then sends 3x the
    forward's bytes) or 'input' (the K/V dtype: bf16 halves those bytes; each hop adds in fp32
    and rounds once for the wire, the owner accumulates in fp32). docs/benchmarks.md gives the
    measured error of both."""

    plan_prefetch: int = 1
    """Global batches read and planned ahead on a background thread while the current step
    trains (with --bytescale-plan-mode every_rank; 0 plans at the start of each step)."""

    cost_model: Optional[str] = None
    """Path of a planner cost model (JSON written by CostModel.save, e.g. fitted from your own
    measurements). Default: the analytic model of these model flags on an H100-class GPU."""

    ranks_per_node: Optional[int] = None
    """Processes (GPUs) per node of the job, numbered node by node as torchrun does: HDP ranks
    sit on node global_rank // this. The planner keeps rings that fit a node inside one (NVLink)
    and spreads longer rings over the fewest nodes. Default: LOCAL_WORLD_SIZE (set by
    torchrun), else the cost model's ranks per node."""

    two_level_ring: bool = False
    """Rings over several whole nodes run two-level: an all-to-all inside each node splits the
    heads (NVLink), and only a ring of one rank per node crosses the network, with every NIC of
    the node busy. Divides the network time of long rings by the ranks per node; the planner
    sizes long rings in whole nodes and keeps the flat plan when it is faster. Needs the
    key/value heads per tensor-parallel rank divisible by the HDP ranks per node."""

    seq_split: bool = False
    """Split the longest rings of PP-Balance's plan into 2, 4 or 8 causal chunks that follow
    each other through the pipeline (Seq1F1B-style), each only where the planner's estimate says
    the step gets shorter and the chunks' kept K/V fits the capacity. Needs
    --bytescale-scheduler balance, --pipeline-model-parallel-size > 1, no virtual stages, no
    expert parallelism, no --bytescale-offload, and no activation recomputation of the attention."""

    check_plan_hash: bool = True
    """All-gather the plan's content hash every step and stop with an error naming the ranks if
    they disagree (costs one tiny collective per step)."""

    dataloader: DataLoaderName = "local"
    """Where global batches are read and planned: 'local' (every rank reads the lengths and
    plans, the next step on a background thread) or 'ray' (ByteScale's remote loader: Ray
    reader actors run the data, one planner actor plans steps ahead for all ranks, and each rank
    fetches the plan and only its own micro-batches' tokens; pip install
    'megatron_bytescale[ray]')."""

    ray_address: Optional[str] = None
    """Ray cluster of --bytescale-dataloader ray ('auto', or the head's host:port). Default:
    RAY_ADDRESS, else a Ray instance that the first process starts on its node (one node)."""

    ray_readers: int = 2
    """Reader actors of --bytescale-dataloader ray; sequence i of a global batch is read by
    reader i mod this many."""

    ray_lookahead: int = 2
    """Steps the planner actor of --bytescale-dataloader ray plans beyond the newest step a
    rank asked for."""

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(
                f"{flag_name('capacity')} ({self.capacity}) must be a positive number of tokens"
            )
        if self.align < 1:
            raise ValueError(f"{flag_name('align')} ({self.align}) must be >= 1")
        if self.plan_prefetch < 0:
            raise ValueError(
                f"{flag_name('plan_prefetch')} ({self.plan_prefetch}) must be >= 0 (0: no prefetch)"
            )
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(
                f"{flag_name('context_length')} ({self.context_length}) must be a positive number "
                "of tokens"
            )
        if self.host_memory_gb is not None and not (
            math.isfinite(self.host_memory_gb) and self.host_memory_gb > 0
        ):
            raise ValueError(
                f"{flag_name('host_memory_gb')} ({self.host_memory_gb}) must be a positive number "
                "of GB (host memory per HDP rank for offloaded activations)"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(
                f"{flag_name('ranks_per_node')} ({self.ranks_per_node}) must be >= 1 (processes "
                "per node)"
            )
        for name in ("ray_readers", "ray_lookahead"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag_name(name)} ({getattr(self, name)}) must be >= 1")
        if self.dataloader == "ray" and self.plan_mode != "every_rank":
            raise ValueError(
                f"{flag_name('plan_mode')} {self.plan_mode} does not apply to "
                f"{flag_name('dataloader')} ray, whose planner actor plans for every rank; "
                f"leave {flag_name('plan_mode')} at every_rank"
            )
        for name in ("scheduler", "plan_mode", "attention_backend", "overlong", "dkv_wire_dtype",
                     "dataloader"):
            value = getattr(self, name)
            choices = _choices(_field_types()[name])
            if value not in choices:
                raise ValueError(
                    f"{flag_name(name)} ({value!r}) must be one of {', '.join(choices)}"
                )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ByteScaleConfig":
        """Build the config from a namespace parsed with :func:`add_bytescale_args`.

        Fills ``capacity`` and ``context_length`` from Megatron's ``--seq-length`` when they were
        not given (HDP runs Megatron with CP = 1, so a context-length sequence fits one rank
        unless ``--bytescale-capacity`` says less), and checks that the capacity can hold one
        zigzag part. Raises ``ValueError`` naming the flag and value on bad input.
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            dest = dest_name(f.name)
            if hasattr(args, dest):
                values[f.name] = getattr(args, dest)
        seq_length = getattr(args, "seq_length", None)
        if values.get("capacity") is None and seq_length:
            values["capacity"] = int(seq_length)
        if values.get("context_length") is None and seq_length:
            values["context_length"] = int(seq_length)
        config = cls(**values)
        config.check_capacity()
        return config

    def check_capacity(self) -> None:
        """Raise ``ValueError`` if the capacity cannot serve the context length or alignment."""
        if self.capacity is None:
            return
        if self.capacity < self.align:
            raise ValueError(
                f"{flag_name('capacity')} ({self.capacity}) is smaller than "
                f"{flag_name('align')} ({self.align}): no zigzag part would fit"
            )
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"{flag_name('context_length')} must be positive")

    def ray_loader_options(self) -> Any:
        """The :class:`~megatron_bytescale.data.ray_loader.RayLoaderOptions` of these flags."""
        from megatron_bytescale.data.ray_loader import RayLoaderOptions

        return RayLoaderOptions(address=self.ray_address, num_readers=self.ray_readers,
                                lookahead=self.ray_lookahead)

    @property
    def ring_attention_backend(self) -> Optional[str]:
        """The backend name for ``runtime.ring_attention`` (None lets the runtime choose)."""
        return None if self.attention_backend == "auto" else self.attention_backend

    def require_capacity(self) -> int:
        """The capacity, or a ``ValueError`` telling the user which flag to set."""
        if self.capacity is None:
            raise ValueError(
                f"{flag_name('capacity')} is not set and there is no --seq-length to derive it "
                "from; pass the per-rank token capacity"
            )
        return self.capacity


# ----------------------------------------------------------------------------- flags


def flag_name(field_name: str) -> str:
    """``capacity`` -> ``--bytescale-capacity``."""
    return f"--{FLAG_PREFIX}-{field_name.replace('_', '-')}"


def dest_name(field_name: str) -> str:
    """``capacity`` -> ``bytescale_capacity`` (the attribute on Megatron's ``args``)."""
    return f"{FLAG_PREFIX}_{field_name}"


def add_bytescale_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--bytescale-*`` group to ``parser``; usable as ``extra_args_provider``."""
    group = parser.add_argument_group(
        title="ByteScale", description="Hybrid Data Parallelism (megatron_bytescale plugin)"
    )
    docs = field_docstrings()
    types = _field_types()
    for f in dataclasses.fields(ByteScaleConfig):
        help_text = docs.get(f.name, "")
        annotation = types[f.name]
        dest = dest_name(f.name)
        if annotation is bool:
            pair = group.add_mutually_exclusive_group()
            pair.add_argument(
                flag_name(f.name),
                dest=dest,
                action=_RecordedStore,
                nargs=0,
                const=True,
                default=f.default,
                help=f"{help_text} (default: {'on' if f.default else 'off'})",
            )
            pair.add_argument(
                f"--no-{FLAG_PREFIX}-{f.name.replace('_', '-')}",
                dest=dest,
                action=_RecordedStore,
                nargs=0,
                const=False,
                default=f.default,
                help=f"Turn off {flag_name(f.name)}.",
            )
            continue
        choices = _choices(annotation)
        kind = _scalar_type(annotation)
        group.add_argument(
            flag_name(f.name),
            dest=dest,
            action=_RecordedStore,
            type=kind,
            default=f.default,
            choices=list(choices) if choices else None,
            metavar=None if choices else kind.__name__.upper(),
            help=f"{help_text} (default: {f.default})",
        )
    return parser


GIVEN_FLAGS_ATTRIBUTE = f"{FLAG_PREFIX}_flags_given"
"""Attribute of a parsed namespace listing the ``--bytescale-*`` flags on its command line."""


class _RecordedStore(argparse.Action):
    """argparse's store (``nargs=0``: store ``const``, as ``store_true`` / ``store_false``) that
    also notes the flag in ``args.bytescale_flags_given``.

    A flag given with its default value is still given: without ``--bytescale-hdp`` the hooks
    refuse every ByteScale flag on the command line, and comparing values with the defaults
    would miss ``--bytescale-scheduler balance`` or ``--bytescale-align 1``.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = list(getattr(namespace, GIVEN_FLAGS_ATTRIBUTE, None) or [])
        if option_string and option_string not in given:
            given.append(option_string)
        setattr(namespace, GIVEN_FLAGS_ATTRIBUTE, given)


def given_flags(args: Any) -> list[str]:
    """The ``--bytescale-*`` / ``--no-bytescale-*`` flags on the command line ``args`` was parsed
    from (by :func:`add_bytescale_args`), in the order given; values do not matter."""
    return list(getattr(args, GIVEN_FLAGS_ATTRIBUTE, None) or [])


@lru_cache(maxsize=1)
def field_docstrings() -> dict[str, str]:
    """The docstring under every field of :class:`ByteScaleConfig`, one line each.

    Python keeps no attribute docstrings at run time, so they are read from the class source
    (as Megatron's ``ArgumentGroupFactory`` does).
    """
    source = textwrap.dedent(inspect.getsource(ByteScaleConfig))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@lru_cache(maxsize=1)
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(ByteScaleConfig)


def _choices(annotation: Any) -> tuple[str, ...]:
    if typing.get_origin(annotation) is Literal:
        return tuple(typing.get_args(annotation))
    return ()


def _scalar_type(annotation: Any) -> type:
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0]
    return annotation
