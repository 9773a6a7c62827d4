"""The profiler's cost model (paper §4 "Profiler", Eq. 3's coefficients) and the ring cost.

Everything the planner decides comes down to two per-layer functions of a sequence length s,
both for **one layer on one HDP rank** (one TP group, so the TP split is already applied):

    T(s)   = alpha1 * s**2 + beta1 * s + gamma      seconds, forward + backward
    Act(s) = alpha2 * s + beta2                     bytes of activations kept for backward

plus the transfer rates that Eq. 3 and the rings need: host<->device bandwidth (D2H, H2D),
ring P2P bandwidth (intra-node, inter-node) and latency, and the K+V bytes per token per layer
per TP rank that a ring rotates (GQA-aware). MoE models add the token dispatch (the expert
all-to-all and the dispatcher's TP collectives, exposed, linear in a member's tokens:
``moe_dispatch_s_per_token``, ``moe_dispatch_s``; :mod:`.moe_cost`), 0 for dense models.

A :class:`CostModel` is built three ways:

* analytically from a model and a GPU/network description (:meth:`CostModel.from_specs`; the
  specs, the FLOP and activation counts and the named presets live in :mod:`.presets`);
* by least squares from measured samples (:meth:`CostModel.fit`);
* from JSON written by :meth:`CostModel.save` (round trip: ``load(save(m)) == m``).

The ring micro-batch cost (:meth:`CostModel.micro_batch_time`, :meth:`CostModel.ring_time_terms`)
is one formula, written out in :mod:`.ring_time` with every term: per layer and per member,
linear work, causal attention split into D ring steps, each step overlapping one P2P
exchange, plus the per-document kernel calls, the per-step overhead, the wait for the
ring's slowest member and any exposed offload transfer.

Host memory: a member offloading the ratio r of a micro-batch fills ``r * (l - 2) * Act(share)``
bytes of host memory (``host_memory_bytes`` caps it, for all micro-batches in flight at once).

Offload (Eq. 3): moving ``r * Act`` bytes of one layer over PCIe is hidden behind that layer's
compute when ``T >= Act * r / min(B_d2h, B_h2d)``, which is exactly the overlap constraint Eq. 3
imposes; the solver in :mod:`.offload` only picks ratios that satisfy it, so offload is free
in the estimate. If a ratio above that bound is forced (an otherwise overlong sequence), the
excess ``r * Act / B - layer time`` is charged as exposed time.

P2P bytes of a ring micro-batch: :meth:`CostModel.ring_p2p_bytes` (formula in :mod:`.ring_time`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .inputs import bounded_int, loads_json, read_text_file
from .least_squares import nonnegative_lstsq, samples_array
from .plan import MAX_SEQUENCE_LENGTH
from .ring_time import RingTimeTerms, ring_time_terms, two_level_bytes

logger = logging.getLogger(__name__)

COST_MODEL_VERSION = 1
_MAX_COST_MODEL_BYTES = 2**20

# --------------------------------------------------------------------------- model
_FLOAT_FIELDS = (
    "alpha1", "beta1", "gamma", "alpha2", "beta2", "d2h_bandwidth", "h2d_bandwidth",
    "kv_bytes_per_token", "p2p_bandwidth_intra", "p2p_bandwidth_inter", "p2p_latency_s",
    "attention_forward_fraction", "forward_fraction", "ring_step_overhead_s", "q_bytes_per_token",
    "per_document_s", "ring_straggler_s", "ring_straggler_link_ratio",
    "moe_dispatch_s_per_token", "moe_dispatch_s", "moe_a2a_bytes_per_token", "moe_tp_bytes_per_token",
)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-layer time and memory of one HDP rank, and the links between ranks.

    All times are seconds, all sizes bytes, all bandwidths bytes/s, all per layer unless the
    name says otherwise.
    """

    name: str = "custom"
    num_layers: int
    """Transformer layers of the whole model; l in Eq. 3 is num_layers / pp_size."""
    alpha1: float
    """T(s) quadratic coefficient: causal attention, s/token^2."""
    beta1: float
    """T(s) linear coefficient: GEMMs and the amortised LM head, s/token."""
    gamma: float
    """T(s) constant: fixed cost per layer per micro-batch, s."""
    alpha2: float
    """Act(s) slope: bytes per token per layer."""
    beta2: float = 0.0
    """Act(s) constant: bytes per layer."""
    d2h_bandwidth: float
    h2d_bandwidth: float
    kv_bytes_per_token: float
    """K + V bytes per token per layer that one TP rank sends in a ring step (GQA-aware)."""
    dkv_bytes_per_token: float | None = None
    """dK + dV bytes per token per layer in the backward ring (None: same as K + V)."""
    p2p_bandwidth_intra: float
    p2p_bandwidth_inter: float
    p2p_latency_s: float = 0.0
    ring_step_overhead_s: float = 0.0
    """Seconds per ring step per layer (forward and backward together) that no compute hides:
    launch/synchronisation cost on GPUs, gloo's copies on the computing cores on CPU."""
    ranks_per_node: int = 1
    """HDP ranks that share a node (gpus_per_node // TP); a ring inside one node uses NVLink."""
    host_memory_bytes: float | None = None
    """Host memory one HDP rank may fill with offloaded activations (None: unlimited). Eq. 3
    never picks a ratio that needs more (see :func:`.offload.host_bytes_per_member`)."""
    attention_forward_fraction: float = 2.0 / 7.0
    """Share of the attention time spent in forward (2/7 for FlashAttention-2: 2 of 7 s^2 GEMMs)."""
    forward_fraction: float = 1.0 / 3.0
    """Share of a micro-batch's time spent in forward (1/3 for GEMMs); used by the 1F1B model."""
    two_level_ring: bool = False
    """Rings over several whole nodes run two-level (the runtime's --bytescale-two-level-ring):
    heads are split inside each node by an all-to-all over NVLink and only a ring of one rank
    per node crosses the network (see :meth:`ring_time_from_sums` and docs/two_level_ring.md)."""
    q_bytes_per_token: float = 0.0
    """Query bytes per token per layer per TP rank (= the attention output's); what the
    two-level ring's all-to-all moves besides K and V."""
    per_document_s: float = 0.0
    """Seconds per document per ring step per layer (forward and backward together): the
    attention kernel is called once per document segment of every ring step where the backend
    cannot take all segments in one call (the CPU path; varlen GPU kernels make it ~0). A local
    pack of n documents pays it n times, a member of a ring of D pays it n * D times."""
    ring_straggler_s: float = 0.0
    """Seconds per ring step per layer (forward and backward together) by which the slowest of a
    ring's members delays the step, per unit of ``sqrt(2 ln D)`` (the expected maximum of D
    independent delays of standard deviation ``ring_straggler_s``): a ring advances in lockstep,
    so wide rings wait longer. Not hidden by compute. 0 in the analytic presets; an absolute
    wait fits the paper's case study but not its TP 8 models (docs/reproduction.md, section 2),
    so the ``paper-fit`` preset uses :attr:`ring_straggler_link_ratio` instead."""
    ring_straggler_link_ratio: float = 0.0
    """The same wait as a multiple of each ring step's own link time (forward K/V plus backward
    K/V and dK/dV at the ring's rate), per unit of ``sqrt(2 ln D)``: a delay that grows with the
    bytes a member sends per step, so rings of small messages (TP 8, inside a node) wait less.
    0 in the analytic presets; the ``paper-fit`` preset fits it to the case study
    (docs/reproduction.md, section 2; :mod:`.ring_time`)."""
    expert_parallel_size: int = 1
    """Expert-parallel size E the MoE terms below were built for (1: no all-to-all)."""
    expert_lockstep_size: int | None = None
    """HDP ranks one expert group spans, which plans keep in step (:attr:`plan_ep_size`):
    ``max(1, ETP x E / TP)`` with expert-tensor parallelism ETP (:mod:`.expert_layout`);
    None: E, the ETP = TP layout (and every cost model saved before ETP was modelled)."""
    moe_dispatch_s_per_token: float = 0.0
    """MoE token dispatch, seconds per token of a member's share per layer (forward and backward
    together) that no compute hides: the all-to-alls over the EP group and, with expert TP > 1,
    the dispatcher's all-gathers / reduce-scatters over expert TP (:mod:`.moe_cost`). 0 for
    dense models."""
    moe_dispatch_s: float = 0.0
    """MoE token dispatch, seconds per layer per micro-batch (the collectives' latency)."""
    moe_a2a_bytes_per_token: float = 0.0
    """Bytes one rank sends in the EP all-to-alls per token of its share per layer (forward and
    backward): ``4 k h dtype (E - 1) / (E T)``; reported, the time is in the two terms above."""
    moe_tp_bytes_per_token: float = 0.0
    """Bytes one rank sends in the dispatcher's expert-TP collectives per token of its share per
    layer: ``4 k h dtype (P - 1) / T`` with expert TP size P (TP by default)."""
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "ranks_per_node", "expert_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cost model {self.name!r}: {name} ({value!r}) must be an integer >= 1")
        lockstep = self.expert_lockstep_size
        if lockstep is not None and (isinstance(lockstep, bool) or not isinstance(lockstep, int) or lockstep < 1):
            raise ValueError(f"cost model {self.name!r}: expert_lockstep_size ({lockstep!r}) must be an "
                             "integer >= 1, or null for expert_parallel_size")
        if not isinstance(self.two_level_ring, bool):
            raise ValueError(f"cost model {self.name!r}: two_level_ring ({self.two_level_ring!r}) must be true or false")
        if self.dkv_bytes_per_token is not None and not (
            _is_number(self.dkv_bytes_per_token) and self.dkv_bytes_per_token >= 0
        ):
            raise ValueError(f"cost model {self.name!r}: dkv_bytes_per_token ({self.dkv_bytes_per_token!r}) must be >= 0 or None")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model {self.name!r}: {name} ({value!r}) must be a finite number >= 0")
        for name in ("d2h_bandwidth", "h2d_bandwidth", "p2p_bandwidth_intra", "p2p_bandwidth_inter", "alpha2"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cost model {self.name!r}: {name} ({getattr(self, name)!r}) must be > 0")
        if self.host_memory_bytes is not None and not (
            isinstance(self.host_memory_bytes, (int, float)) and math.isfinite(self.host_memory_bytes)
            and self.host_memory_bytes > 0
        ):
            raise ValueError(
                f"cost model {self.name!r}: host_memory_bytes ({self.host_memory_bytes!r}) must be "
                "a number of bytes > 0, or None for unlimited host memory"
            )
        for name in ("attention_forward_fraction", "forward_fraction"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"cost model {self.name!r}: {name} ({getattr(self, name)!r}) must be in (0, 1)")
        self._check_no_overflow()

    def _check_no_overflow(self) -> None:
        """Refuse coefficients so large that the planner's sums would overflow to inf (and
        then print NaN): the costs of the longest sequence the planner accepts, over every layer
        and a million micro-batches, must stay finite."""
        s = float(MAX_SEQUENCE_LENGTH)
        headroom = float(self.num_layers) * 2.0**20
        kv = self.kv_bytes_per_token + self.dkv_bytes
        terms = (
            ("alpha1", self.alpha1 * s * s),
            ("beta1", self.beta1 * s),
            ("gamma", self.gamma),
            ("alpha2", self.alpha2 * s),
            ("alpha2", self.alpha2 * s / self.offload_bandwidth),
            ("beta2", self.beta2 / self.offload_bandwidth),
            ("kv_bytes_per_token", kv * s / min(self.p2p_bandwidth_intra, self.p2p_bandwidth_inter)),
            ("p2p_latency_s", self.p2p_latency_s + self.ring_step_overhead_s),
            ("ring_straggler_s", self.ring_straggler_s * 5.0),
            ("ring_straggler_link_ratio", self.ring_straggler_link_ratio * 5.0 * kv * s
             / min(self.p2p_bandwidth_intra, self.p2p_bandwidth_inter)),
            ("per_document_s", self.per_document_s * s),
            ("moe_dispatch_s_per_token", self.moe_dispatch_s_per_token * s),
            ("moe_dispatch_s", self.moe_dispatch_s),
            ("moe_a2a_bytes_per_token", self.moe_a2a_bytes_per_token * s),
            ("moe_tp_bytes_per_token", self.moe_tp_bytes_per_token * s),
        )
        for name, value in terms:
            if not math.isfinite(value * headroom):
                raise ValueError(
                    f"cost model {self.name!r}: {name} ({getattr(self, name)!r}) is out of range: "
                    f"the cost of a {MAX_SEQUENCE_LENGTH}-token sequence would overflow (check it "
                    "and the bandwidths). Coefficients are per layer, in seconds, bytes and "
                    "bytes/s; on a GPU alpha1 is about 1e-12 s/token^2, beta1 about 1e-7 s/token"
                )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_specs(cls, model: Any, hardware: Any, *, name: str | None = None) -> "CostModel":
        """The analytic cost model of a :class:`~.presets.ModelSpec` on a :class:`~.presets.HardwareSpec`
        (see :func:`.presets.analytic_cost_model` for the derivation)."""
        from .presets import analytic_cost_model

        return analytic_cost_model(model, hardware, name=name)

    @classmethod
    def fit(
        cls,
        time_samples: Iterable[Sequence[float]],
        activation_samples: Iterable[Sequence[float]],
        *,
        base: "CostModel | None" = None,
        name: str = "fitted",
        **fields_: Any,
    ) -> "CostModel":
        """Least-squares fit of T(s) and Act(s) from measured ``(s, seconds)`` and ``(s, bytes)``.

        The coefficients are constrained to be >= 0 (a negative alpha1 from noise would make
        long sequences look free); the fit tries every subset of active coefficients and keeps the
        non-negative one with the smallest residual. Every other field comes from ``base`` and
        then from ``fields_`` (``num_layers``, bandwidths, ...).

        Raises:
            ValueError: fewer samples (or distinct lengths) than unknowns: 3 for T, 2 for Act.
        """
        t = samples_array(time_samples, "time_samples")
        a = samples_array(activation_samples, "activation_samples")
        for arr, what, unknowns in ((t, "time_samples (s, seconds)", 3), (a, "activation_samples (s, bytes)", 2)):
            distinct = len(np.unique(arr[:, 0])) if len(arr) else 0
            if distinct < unknowns:
                raise ValueError(
                    f"CostModel.fit needs at least {unknowns} {what} at distinct lengths to fit "
                    f"{unknowns} unknowns, got {len(arr)} samples at {distinct} distinct lengths; "
                    f"measure more sequence lengths"
                )
        s = t[:, 0]
        alpha1, beta1, gamma = nonnegative_lstsq(np.stack([s * s, s, np.ones_like(s)], axis=1), t[:, 1])
        s = a[:, 0]
        alpha2, beta2 = nonnegative_lstsq(np.stack([s, np.ones_like(s)], axis=1), a[:, 1])
        params: dict[str, Any] = {}
        if base is not None:
            params.update({f.name: getattr(base, f.name) for f in fields(base)})
        params.update(fields_)
        params.update(name=name, alpha1=alpha1, beta1=beta1, gamma=gamma, alpha2=alpha2, beta2=beta2)
        params.setdefault("source", f"least-squares fit of {len(t)} time and {len(a)} activation samples")
        missing = [f.name for f in fields(cls) if f.name not in params and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"CostModel.fit: pass base= or the fields {missing}")
        return cls(**params)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"version": COST_MODEL_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        if not isinstance(data, Mapping):
            raise ValueError(f"cost model JSON must be an object, got {type(data).__name__}")
        version = data.get("version", COST_MODEL_VERSION)
        if version != COST_MODEL_VERSION:
            raise ValueError(f"cost model version {version!r} is not supported (expected {COST_MODEL_VERSION})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"version"})
        if unknown:
            raise ValueError(f"cost model JSON has unknown fields {unknown}; known: {sorted(known)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(
                f"cost model JSON lacks the fields {missing}; write it with CostModel.save (e.g. "
                "the cost_model.json of a bytescale demo run), which stores every field"
            )
        _check_field_types(data)
        return cls(**{k: v for k, v in data.items() if k != "version"})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        p = Path(path)
        text = read_text_file(p, "cost model file", max_bytes=_MAX_COST_MODEL_BYTES)  # FIFOs refused
        data = loads_json(text, f"cost model file {str(p)!r}")  # depth and number sizes bounded
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost model file {str(p)!r}: {exc}") from None

    # ------------------------------------------------------------------ per layer
    def layer_time(self, s: Any) -> Any:
        """T(s): seconds of one layer, forward + backward, of a sequence of s tokens on one rank."""
        if type(s) is int or type(s) is float:  # scalar fast path: the same float operations as numpy's
            s = float(s)
            return float(self.alpha1 * s * s + self.beta1 * s + self.gamma)
        s = np.asarray(s, dtype=np.float64)
        out = self.alpha1 * s * s + self.beta1 * s + self.gamma
        return float(out) if out.ndim == 0 else out

    def activation_bytes(self, s: Any) -> Any:
        """Act(s): bytes one layer keeps for backward for s tokens on one rank."""
        if type(s) is int or type(s) is float:  # scalar fast path (planning calls it per sequence)
            return float(self.alpha2 * float(s) + self.beta2)
        s = np.asarray(s, dtype=np.float64)
        out = self.alpha2 * s + self.beta2
        return float(out) if out.ndim == 0 else out

    @property
    def plan_ep_size(self) -> int:
        """The ``StepPlan.ep_size`` this cost model's expert groups need: the HDP ranks one spans
        (:attr:`expert_lockstep_size`, else :attr:`expert_parallel_size` as with ETP = TP)."""
        return self.expert_parallel_size if self.expert_lockstep_size is None else self.expert_lockstep_size

    @property
    def offload_bandwidth(self) -> float:
        """min(B_d2h, B_h2d) of Eq. 3's overlap constraint."""
        return min(self.d2h_bandwidth, self.h2d_bandwidth)

    def layers_per_stage(self, pp_size: int) -> int:
        """l of Eq. 3: layers on one PP stage; PP must divide the layer count."""
        if not isinstance(pp_size, int) or pp_size < 1:
            raise ValueError(f"pp_size ({pp_size!r}) must be an integer >= 1")
        if self.num_layers % pp_size:
            raise ValueError(
                f"pp_size ({pp_size}) must divide the model's {self.num_layers} layers "
                f"(cost model {self.name!r}); choose a divisor of {self.num_layers}"
            )
        return self.num_layers // pp_size

    # ------------------------------------------------------------------ micro-batches
    def padded_lengths(self, lengths: Any, ring_size: int, align: int = 1) -> np.ndarray:
        """``P_j``: the padded length of each sequence on a ring of ``ring_size`` (zigzag)."""
        s = np.asarray(lengths, dtype=np.int64)
        if ring_size == 1:
            return s.copy()
        parts = 2 * ring_size
        chunk = -(-s // parts)
        chunk = -(-chunk // align) * align
        return chunk * parts

    def ring_time_from_sums(
        self,
        sum_p: Any,
        sum_p2: Any,
        ring_size: Any,
        *,
        layers: int,
        offload_ratio: Any = 0.0,
        intra_node: Any = True,
        node_group: Any = 1,
        num_docs: Any = 1,
    ) -> Any:
        """Per-member seconds of micro-batches given ``sum(P_j)`` and ``sum(P_j**2)`` (vectorised).

        See the module docstring for the formula; ``ring_size`` 1 means a local micro-batch.
        ``node_group`` G > 1 (with ``two_level_ring``) costs a two-level ring of D / G nodes of G
        members: an all-to-all inside each node before and after attention, moving
        ``(G - 1) / G`` of every member's q, k, v, out forward and their gradients backward
        over NVLink, then a ring of D / G steps between nodes, each step computing 1 / (D / G)
        of the member's attention while the next node's K/V (dK/dV backward) arrives over the
        network. ``num_docs``: documents per micro-batch (the ``per_document_s`` term). It is the
        sum of :meth:`ring_time_terms`.
        """
        out = self.ring_time_terms(
            sum_p, sum_p2, ring_size, layers=layers, offload_ratio=offload_ratio, intra_node=intra_node,
            node_group=node_group, num_docs=num_docs,
        ).total
        return float(out) if out.ndim == 0 else out

    def ring_time_terms(
        self,
        sum_p: Any,
        sum_p2: Any,
        ring_size: Any,
        *,
        layers: int,
        offload_ratio: Any = 0.0,
        intra_node: Any = True,
        node_group: Any = 1,
        num_docs: Any = 1,
    ) -> RingTimeTerms:
        """:meth:`ring_time_from_sums` split into what the time is spent on (arrays, per member,
        ``layers`` layers): the simulator reports where a step goes with the planner's own model.
        A two-level ring's all-to-alls and the straggler wait count as exposed communication,
        the per-document cost as compute (:func:`.ring_time.ring_time_terms`)."""
        return ring_time_terms(
            self, sum_p, sum_p2, ring_size, layers=layers, offload_ratio=offload_ratio, intra_node=intra_node,
            node_group=node_group, num_docs=num_docs,
        )

    def two_level_bytes(self, sum_p: Any, ring_size: Any, node_group: Any, *, layers: int) -> tuple[Any, Any]:
        """``(intra-node, inter-node)`` bytes all members of two-level rings send over ``layers``
        layers (:func:`.ring_time.two_level_bytes`)."""
        return two_level_bytes(self, sum_p, ring_size, node_group, layers=layers)

    def micro_batch_time(
        self,
        lengths: Sequence[int] | np.ndarray,
        ring_size: int,
        *,
        layers: int,
        offload_ratio: float = 0.0,
        align: int = 1,
        intra_node: bool = True,
        node_group: int = 1,
    ) -> float:
        """Seconds one member of a ring of ``ring_size`` spends on a micro-batch of ``lengths``.

        ``layers`` is the number of layers the rank runs (all of them without PP, one stage's
        with PP). ``intra_node`` picks the NVLink rate (all members on one node) or the network;
        ``node_group`` > 1 costs a two-level ring (see :meth:`ring_time_from_sums`).
        """
        p = self.padded_lengths(lengths, ring_size, align).astype(np.float64)
        return float(
            self.ring_time_from_sums(
                p.sum(), (p * p).sum(), ring_size, layers=layers,
                offload_ratio=offload_ratio, intra_node=intra_node, node_group=node_group,
                num_docs=len(p),
            )
        )

    def ring_p2p_bytes(
        self, lengths: Sequence[int] | np.ndarray, ring_size: int, *, layers: int, align: int = 1
    ) -> int:
        """Bytes all members of a ring send for one micro-batch over ``layers`` layers (one TP rank).

        ``layers * (D - 1) * (2 * kv + dkv) * sum_j P_j``; 0 for D = 1.
        """
        if ring_size <= 1:
            return 0
        total = int(self.padded_lengths(lengths, ring_size, align).sum())
        return int(round(layers * (ring_size - 1) * self.ring_bytes_per_token * total))

    def moe_a2a_bytes(self, lengths: Sequence[int] | np.ndarray, ring_size: int, *, layers: int,
                      align: int = 1) -> int:
        """Bytes all members of a ring send in the MoE all-to-alls for one micro-batch over
        ``layers`` layers (one TP rank each): ``layers * moe_a2a_bytes_per_token * sum_j P_j``
        (every member dispatches its own share; 0 for dense models and EP 1)."""
        total = float(self.padded_lengths(lengths, ring_size, align).sum())
        return int(round(layers * self.moe_a2a_bytes_per_token * total))

    @property
    def dkv_bytes(self) -> float:
        """dK + dV bytes per token per layer (``dkv_bytes_per_token`` or K + V's)."""
        return self.kv_bytes_per_token if self.dkv_bytes_per_token is None else self.dkv_bytes_per_token

    @property
    def ring_bytes_per_token(self) -> float:
        """Bytes a ring moves per padded token per layer per hop: K+V forward, K+V and dK+dV backward."""
        return 2.0 * self.kv_bytes_per_token + self.dkv_bytes

    def ring_is_intra_node(self, ring: Sequence[int]) -> bool:
        """Whether every member of ``ring`` sits on one node (HDP rank // ranks_per_node)."""
        if len(ring) <= 1:
            return True
        node = ring[0] // self.ranks_per_node
        return all(r // self.ranks_per_node == node for r in ring)

    def with_(self, **changes: Any) -> "CostModel":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _check_field_types(data: Mapping[str, Any]) -> None:
    """Types a JSON cost model must have before the dataclass checks run: text fields are
    strings (an object as ``name`` would be printed in every message), counts are bounded
    integers and numbers are within float range (``10**400`` cannot be compared as a float)."""
    for name in ("name", "source"):
        if name in data and not isinstance(data[name], str):
            raise ValueError(f"cost model field {name!r} ({data[name]!r:.60}) must be a string")
    for name in ("num_layers", "ranks_per_node", "expert_parallel_size", "expert_lockstep_size"):  # __post_init__
        value = data.get(name)
        if isinstance(value, int) and value > 2**31 - 1:
            bounded_int(value, name, low=1, high=2**31 - 1)
    for name, value in data.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**1000:
            raise ValueError(f"cost model field {name!r} is an integer of about "
                             f"{int(value.bit_length() * 0.30103) + 1} digits: out of range")


def _is_number(value: Any) -> bool:
    """An int or float, not a bool (JSON ``true`` must not pass for 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
