"""What one ``bytescale demo`` run does, as plain data shared by the launcher and the workers.

The launcher (``demo_cmd``) parses the command line into :class:`DemoSettings`, writes it as
JSON next to the results, and starts the torchrun workers (``demo_worker``), which read it
back. Keeping it plain data means the workers never re-parse the command line.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

MODES = ("static", "naive", "balance", "offload")
"""Every mode the demo knows; ``offload`` is HDP balance with selective activation offload."""
DEFAULT_MODES = ("static", "naive", "balance")
DEFAULT_TIMEOUT_MINUTES = 3.0
BUILTIN_DATASETS = ("stdlib", "stdlib-files", "synthetic-github", "synthetic-byted", "synthetic-rings")
MAX_DEMO_TOKENS = 2**24
"""Most tokens of all steps together (16.8M): the launcher and every rank hold them all, and
a CPU trains some thousands of tokens per second."""
MAX_TIMEOUT_MINUTES = 7 * 24 * 60
MIN_CAPACITY = 32
"""The cost model is calibrated at lengths from 8 to 32 tokens up to the capacity and more."""


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    """One demo run: data, model, HDP settings and where results go."""

    datasets: tuple[str, ...] = ("stdlib",)
    """Built-in names (see BUILTIN_DATASETS), a .jsonl file, or a Megatron indexed prefix."""
    modes: tuple[str, ...] = DEFAULT_MODES
    ranks: int = 4
    steps: int = 12
    capacity: int = 512
    """Tokens per HDP rank per micro-batch (C)."""
    context_length: int = 2048
    """Longest sequence; the static baseline's CP size is context_length / capacity."""
    micro_batches_per_rank: int = 4
    """Global batch = ranks * capacity * this many tokens."""
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 8
    num_query_groups: int = 4
    ffn_hidden_size: int = 512
    lr: float = 3e-3
    seed: int = 1234
    plan_mode: str = "every_rank"
    offload: bool = False
    """Add the ``offload`` mode (HDP balance with selective offload) to the comparison."""
    host_memory_gb: float | None = None
    """Host memory per rank the offload mode may fill (--bytescale-host-memory-gb)."""
    align: int = 1
    attention_backend: str = "auto"
    check_plan_hash: bool = True
    plan_prefetch: int = 1
    cost_model: str | None = None
    """A CostModel JSON to plan with instead of calibrating on this machine."""
    distributed_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES
    """How long a collective of the HDP group waits for a rank that does not answer (gloo's own
    default is 30 minutes); then the job stops naming that rank."""
    interleave_modes: bool = False
    """Run step 1 of every mode, then step 2 of every mode, ... instead of one mode after the
    other: on a machine whose load drifts, every mode then sees the same load (the simulator's
    validation runs it so)."""
    calibration_lengths: tuple[int, ...] = ()
    """Empty: C/8, C/4, C/2, C, 2C and 4C (up to the context length): the quadratic term
    is only measurable at the long lengths the rings carry."""
    out_dir: str = "out/demo"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "ranks",
            "steps",
            "capacity",
            "context_length",
            "micro_batches_per_rank",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} ({getattr(self, name)}) must be >= 1")
        if self.ranks > 256:
            raise ValueError(f"--ranks ({self.ranks}) must be at most 256: each rank is a CPU process")
        if self.capacity < MIN_CAPACITY:
            raise ValueError(
                f"--bytescale-capacity ({self.capacity}) must be at least {MIN_CAPACITY}: the demo "
                f"calibrates its cost model on sequences of 8 to {MIN_CAPACITY} tokens and more"
            )
        if not 1 <= self.align <= self.capacity:
            raise ValueError(
                f"--bytescale-align ({self.align}) must be from 1 to --bytescale-capacity "
                f"({self.capacity}): every zigzag part is padded to a multiple of it"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr ({self.lr}) must be a finite number > 0, e.g. 3e-3")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed ({self.seed}) must be from 0 to {2**32 - 1} (numpy's seed range)")
        if self.tokens_per_step * self.steps > MAX_DEMO_TOKENS:
            raise ValueError(
                f"--steps {self.steps} x --ranks {self.ranks} x capacity {self.capacity} x "
                f"--micro-batches-per-rank {self.micro_batches_per_rank} = "
                f"{self.tokens_per_step * self.steps:,} tokens: more than the {MAX_DEMO_TOKENS:,} "
                "a CPU demo holds in memory; use fewer steps or micro-batches per rank"
            )
        if not self.out_dir:
            raise ValueError("--out is empty; give the directory for the results, e.g. out/demo")
        if not self.datasets:
            raise ValueError(
                f"--data {','.join(self.datasets)!r} names no dataset; give one or more of "
                f"{', '.join(BUILTIN_DATASETS)}, a .jsonl file or a Megatron indexed prefix"
            )
        if not 0 < self.distributed_timeout_minutes <= MAX_TIMEOUT_MINUTES:
            raise ValueError(
                f"--distributed-timeout-minutes ({self.distributed_timeout_minutes}) must be > 0 "
                f"and at most {MAX_TIMEOUT_MINUTES} (a week)"
            )
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(
                f"--modes {','.join(self.modes)}: each mode must be one of {', '.join(MODES)}"
            )
        if self.context_length > self.ranks * self.capacity:
            raise ValueError(
                f"--bytescale-context-length ({self.context_length}) must be at most ranks x "
                f"capacity = {self.ranks * self.capacity}: the longest sequence has to fit on all "
                "ranks together"
            )
        if self.context_length % self.capacity:
            raise ValueError(
                f"--bytescale-context-length ({self.context_length}) must be a multiple of "
                f"--bytescale-capacity ({self.capacity}) so the static baseline has a whole CP size"
            )
        if (
            self.hidden_size % self.num_attention_heads
            or self.num_attention_heads % self.num_query_groups
        ):
            raise ValueError(
                "--hidden-size must divide by --heads and --heads by --kv-heads "
                f"(got {self.hidden_size}, {self.num_attention_heads}, {self.num_query_groups})"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.ranks * self.capacity * self.micro_batches_per_rank

    @property
    def static_cp_size(self) -> int:
        return self.context_length // self.capacity

    @property
    def effective_calibration_lengths(self) -> tuple[int, ...]:
        if self.calibration_lengths:
            return tuple(self.calibration_lengths)
        c = self.capacity
        lengths = {max(8, c // 8), max(16, c // 4), max(32, c // 2), c}
        lengths |= {n for n in (2 * c, 4 * c) if n <= self.context_length}
        return tuple(sorted(lengths))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "DemoSettings":
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        values = {
            k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in known
        }
        return cls(**values)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "DemoSettings":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
