"""``bytescale profile`` as a Python API: measure a model, fit the planner's cost model, judge the fit.

The planner's cost model (:class:`~megatron_bytescale.planner.cost_model.CostModel`) rests on a
few measured functions of the sequence length s: per-layer forward + backward time
``T(s) = alpha1 s^2 + beta1 s + gamma`` and activation bytes ``Act(s) = alpha2 s + beta2``, plus
the host link (offload) and the ring's P2P link. :func:`profile` takes those measurements from a
:class:`ProfileSource`, fits the model (:meth:`CostModel.fit`) and says how well it fits:

* R^2 of each fit and the relative residual at every measured length;
* warnings when the fit is poor (R^2 below :data:`MIN_R2`, a residual beyond
  :data:`MAX_RELATIVE_RESIDUAL`), when the quadratic (attention) term came out as zero (the
  lengths were too short to see it) or when too few lengths were measured to judge the fit.

Sources: :class:`~megatron_bytescale.integration.profile_source.MegatronProfileSource` measures
the real megatron-core model through :mod:`~megatron_bytescale.integration.calibration` (one
implementation of the measurements); :class:`SyntheticSource` plays a known cost model with
noise, for tests and for checking what the fit can recover. The fitted model is what
``bytescale plan --cost-model`` and ``--bytescale-cost-model`` read (:meth:`CostModel.save`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .cost_model import CostModel
from .moe_cost import fit_moe_dispatch

MIN_R2 = 0.98
"""A fit with a lower R^2 (time or activations) gets a warning."""
MAX_RELATIVE_RESIDUAL = 0.2
"""A measured length off the fit by more than this fraction gets a warning."""

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class ProfileSamples:
    """Everything a profile measured (per layer, on one rank of one TP group)."""

    time_samples: tuple[tuple[int, float], ...]
    """(length, seconds per layer, forward + backward)."""
    activation_samples: tuple[tuple[int, float], ...]
    """(length, activation bytes per layer)."""
    d2h_bandwidth: float
    h2d_bandwidth: float
    p2p_bandwidth: float
    p2p_latency_s: float
    ring_step_overhead_s: float = 0.0
    device_name: str = "cpu"
    hdp_size: int = 1
    """Ranks the P2P link and the rings were measured over (1: not measured)."""
    per_document_s: float = 0.0
    """Seconds per document per ring step per layer (:attr:`CostModel.per_document_s`), fitted
    with the ring step overhead by :func:`fit_ring_terms`."""
    ring_fit: "RingTermsFit | None" = None
    """The micro-batches the two ring terms were fitted to, with residuals before and after."""
    moe_dispatch_samples: tuple[tuple[int, float], ...] = ()
    """MoE models with expert parallelism: (tokens per rank, seconds of one all-to-all of their
    top-k copies over an expert group); empty for dense models and EP 1."""
    expert_parallel_size: int = 1
    """The expert-group size the all-to-alls were measured over."""
    expert_tensor_parallel_size: int | None = None
    """The expert-TP size ETP of the run profiled (``--expert-tensor-parallel-size``): the EP
    group's members sit ETP GPUs apart; None: TP (Megatron's default)."""
    expert_lockstep_size: int | None = None
    """HDP ranks one expert group spans, ``max(1, ETP x E / TP)`` (:mod:`.expert_layout`), which
    the fitted cost model hands to plans (:attr:`CostModel.plan_ep_size`); None: E (ETP = TP)."""
    moe_a2a_bytes_per_token: float = 0.0
    """Bytes one rank sends per token per layer in the four all-to-alls (forward + backward)."""


@dataclass(frozen=True, kw_only=True)
class RingTermsFit:
    """The two terms that single-sequence timings cannot show, fitted to measured micro-batches.

    Every sample is ``(ring size D, documents n, tokens, seconds)`` of one member's decoder
    layers (forward + backward). The model without the two terms, ``base``, predicts
    ``b_i``; the residual is fitted non-negatively as

        measured_i - b_i = overhead * layers * (D - 1) + per_document * layers * (n D - 1)

    (``n D - 1``: the single-sequence local timings that fitted ``gamma`` already held one
    document's cost, so ``gamma`` gives it back: :meth:`apply`). ``before`` is the previous
    calibration, the overhead alone fitted to the same samples; ``after`` both terms.
    """

    overhead_s: float
    per_document_s: float
    overhead_only_s: float
    samples: tuple[tuple[int, int, int, float], ...]
    predicted_before: tuple[float, ...]
    predicted_after: tuple[float, ...]

    def apply(self, cost_model: CostModel) -> CostModel:
        """``cost_model`` with both terms (``gamma`` less the one document it held)."""
        return cost_model.with_(ring_step_overhead_s=self.overhead_s, per_document_s=self.per_document_s,
                                gamma=max(0.0, cost_model.gamma - self.per_document_s))

    def residuals(self, which: str = "after") -> list[float]:
        """``(measured - predicted) / measured`` per sample, ``before`` or ``after``."""
        predicted = self.predicted_after if which == "after" else self.predicted_before
        return [(m - p) / m if m else 0.0 for (_, _, _, m), p in zip(self.samples, predicted)]


def fit_ring_terms(base: CostModel, samples: Sequence[tuple[int, int, int, float]], *, layers: int,
                   lengths_of: Callable[[int, int, int], Sequence[int]] | None = None) -> RingTermsFit:
    """Fit the ring step overhead and the per-document cost to measured micro-batches.

    ``samples``: ``(D, documents, tokens, seconds)``; ``lengths_of(D, documents, tokens)`` gives
    the documents' lengths (default: ``documents`` equal parts of ``tokens``, the last one taking
    the remainder). ``base`` must have neither term (it is the single-sequence fit).
    """
    split = lengths_of or _equal_documents
    rows, rhs, base_pred = [], [], []
    for d, n, tokens, seconds in samples:
        b = base.with_(ring_step_overhead_s=0.0, per_document_s=0.0).micro_batch_time(
            split(d, n, tokens), d, layers=layers)
        base_pred.append(b)
        rows.append([layers * (d - 1), layers * (n * d - 1)])
        rhs.append(seconds - b)
    x = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    y = np.asarray(rhs, dtype=np.float64)
    overhead = per_doc = only = 0.0
    if len(y):
        from .least_squares import nonnegative_lstsq  # one solver for every fit of the cost model

        if np.any(x[:, 0] > 0):
            only = max(0.0, float(np.sum(y * x[:, 0]) / np.sum(x[:, 0] ** 2)))
        overhead, per_doc = nonnegative_lstsq(x, y) if np.any(x > 0) else (0.0, 0.0)
    before = [b + only * r[0] for b, r in zip(base_pred, rows)]
    after = [b + overhead * r[0] + per_doc * r[1] for b, r in zip(base_pred, rows)]
    return RingTermsFit(overhead_s=float(overhead), per_document_s=float(per_doc), overhead_only_s=only,
                        samples=tuple((int(d), int(n), int(t), float(m)) for d, n, t, m in samples),
                        predicted_before=tuple(before), predicted_after=tuple(after))


def _equal_documents(ring_size: int, documents: int, tokens: int) -> list[int]:
    """``documents`` lengths summing to ``tokens``, as equal as integers allow."""
    n = max(1, int(documents))
    base, extra = divmod(int(tokens), n)
    return [base + (1 if i < extra else 0) for i in range(n)]


class ProfileSource(Protocol):
    """Where measurements come from; :func:`profile` calls :meth:`measure` once."""

    def measure(self, lengths: Sequence[int], *, progress: Progress | None = None) -> ProfileSamples: ...


@dataclass(frozen=True, kw_only=True)
class FitQuality:
    """How well one fitted function matches its samples."""

    r2: float
    residuals: tuple[tuple[int, float], ...]
    """(length, (measured - fitted) / measured) per sample."""

    @property
    def worst_residual(self) -> float:
        return max((abs(r) for _, r in self.residuals), default=0.0)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A fitted cost model with its samples and the quality of its fit."""

    cost_model: CostModel
    samples: ProfileSamples
    time_fit: FitQuality
    activation_fit: FitQuality
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the cost model, the samples and the fit report."""
        s = self.samples
        return {
            "cost_model": self.cost_model.to_dict(),
            "samples": {
                "time": [list(x) for x in s.time_samples],
                "activation": [list(x) for x in s.activation_samples],
                "d2h_bandwidth": s.d2h_bandwidth, "h2d_bandwidth": s.h2d_bandwidth,
                "p2p_bandwidth": s.p2p_bandwidth, "p2p_latency_s": s.p2p_latency_s,
                "ring_step_overhead_s": s.ring_step_overhead_s, "device": s.device_name,
                "hdp_size": s.hdp_size, "per_document_s": s.per_document_s,
                "moe_all_to_all": [list(x) for x in s.moe_dispatch_samples],
                "expert_parallel_size": s.expert_parallel_size,
                "expert_tensor_parallel_size": s.expert_tensor_parallel_size,
                "expert_lockstep_size": s.expert_lockstep_size,
                "ring_micro_batches": None if s.ring_fit is None else {
                    "samples": [list(x) for x in s.ring_fit.samples],
                    "predicted_before": list(s.ring_fit.predicted_before),
                    "predicted_after": list(s.ring_fit.predicted_after),
                },
            },
            "fit": {
                "time_r2": self.time_fit.r2, "time_residuals": [list(x) for x in self.time_fit.residuals],
                "activation_r2": self.activation_fit.r2,
                "activation_residuals": [list(x) for x in self.activation_fit.residuals],
            },
            "warnings": list(self.warnings),
        }


def profile(source: ProfileSource, *, lengths: Sequence[int], progress: Progress | None = None,
            **cost_model_fields: Any) -> Profile:
    """Measure with ``source`` at ``lengths``, fit the cost model, report the fit.

    ``cost_model_fields`` are the fields measurement cannot give (``num_layers``,
    ``kv_bytes_per_token``, ``dkv_bytes_per_token``, ``ranks_per_node``, ``name``, ...).

    Raises:
        ValueError: fewer than 3 distinct lengths, or a length < 1.
    """
    distinct = sorted({int(n) for n in lengths})
    if len(distinct) < 3 or distinct[0] < 1:
        raise ValueError(
            f"profile needs at least 3 distinct lengths >= 1 to fit T(s) = a s^2 + b s + c, got "
            f"{list(lengths)}; measure more lengths (--lengths, or --min-length/--max-length)"
        )
    samples = source.measure(distinct, progress=progress)
    return fit_profile(samples, **cost_model_fields)


def fit_profile(samples: ProfileSamples, **cost_model_fields: Any) -> Profile:
    """Fit :class:`CostModel` to ``samples`` (non-negative least squares) and judge the fit."""
    fields_ = dict(cost_model_fields)
    fields_.setdefault("name", f"profiled-{samples.device_name}")
    fields_.setdefault("source", (f"bytescale profile on {samples.device_name} at lengths "
                                  f"{[n for n, _ in samples.time_samples]}"))
    p2p = dict(p2p_bandwidth_intra=samples.p2p_bandwidth, p2p_bandwidth_inter=samples.p2p_bandwidth,
               p2p_latency_s=samples.p2p_latency_s, ring_step_overhead_s=samples.ring_step_overhead_s,
               per_document_s=samples.per_document_s)
    if samples.hdp_size < 2:  # nothing measured: keep the caller's (or a neutral) link
        p2p = {k: fields_.pop(k, v) for k, v in p2p.items()}
    cost_model = CostModel.fit(
        samples.time_samples, samples.activation_samples,
        d2h_bandwidth=samples.d2h_bandwidth, h2d_bandwidth=samples.h2d_bandwidth,
        **{**p2p, **fields_},
    )
    if cost_model.per_document_s:  # a single-sequence timing held one document's cost in gamma
        cost_model = cost_model.with_(gamma=max(0.0, cost_model.gamma - samples.per_document_s))
    if samples.moe_dispatch_samples:  # the all-to-all; the layer's other MoE costs are in T(s)
        dispatch = fit_moe_dispatch(samples.moe_dispatch_samples)
        cost_model = cost_model.with_(
            expert_parallel_size=samples.expert_parallel_size, moe_dispatch_s_per_token=dispatch.seconds_per_token,
            moe_dispatch_s=dispatch.seconds, moe_a2a_bytes_per_token=samples.moe_a2a_bytes_per_token)
    if samples.expert_lockstep_size is not None:  # ETP other than TP (an EP 1 run included)
        cost_model = cost_model.with_(expert_lockstep_size=samples.expert_lockstep_size)
    time_fit = fit_quality(samples.time_samples, lambda n: cost_model.layer_time(n) + cost_model.per_document_s)
    activation_fit = fit_quality(samples.activation_samples, cost_model.activation_bytes)
    return Profile(cost_model=cost_model, samples=samples, time_fit=time_fit,
                   activation_fit=activation_fit,
                   warnings=tuple(fit_warnings(cost_model, samples, time_fit, activation_fit)))


def fit_quality(samples: Sequence[tuple[int, float]], fitted: Callable[[Any], Any]) -> FitQuality:
    """R^2 and per-length relative residuals of ``fitted`` against ``samples``."""
    s = np.asarray([x for x, _ in samples], dtype=np.float64)
    y = np.asarray([v for _, v in samples], dtype=np.float64)
    f = np.asarray(fitted(s), dtype=np.float64).reshape(-1)
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - f) ** 2)) / total if total > 0 else 1.0
    residuals = tuple((int(n), float((v - p) / v) if v else 0.0) for n, v, p in zip(s, y, f))
    return FitQuality(r2=r2, residuals=residuals)


def fit_warnings(cost_model: CostModel, samples: ProfileSamples, time_fit: FitQuality,
                 activation_fit: FitQuality) -> list[str]:
    """What a user should know before planning with this fit (empty when it is good)."""
    out = []
    for what, fit in (("T(s) (time)", time_fit), ("Act(s) (activations)", activation_fit)):
        if fit.r2 < MIN_R2:
            out.append(f"{what} fits poorly: R^2 = {fit.r2:.3f} < {MIN_R2}; the machine may be "
                       "busy (measure again with more --repeats) or the lengths too few")
        bad = [(n, r) for n, r in fit.residuals if abs(r) > MAX_RELATIVE_RESIDUAL]
        if bad:
            listed = ", ".join(f"{n} tokens {100 * r:+.0f}%" for n, r in bad)
            out.append(f"{what}: measurements off the fit by more than "
                       f"{100 * MAX_RELATIVE_RESIDUAL:.0f}%: {listed}")
    if len(samples.time_samples) < 4:
        out.append(f"only {len(samples.time_samples)} lengths: a 3-coefficient fit through 3 "
                   "points always looks perfect; measure at least 4")
    if cost_model.alpha1 == 0.0:
        longest = max(n for n, _ in samples.time_samples)
        out.append(f"the attention (s^2) term fitted to 0: up to {longest} tokens it is not "
                   "visible; measure longer sequences (--max-length) so long rings are costed right")
    if samples.moe_dispatch_samples:
        fit = fit_moe_dispatch(samples.moe_dispatch_samples)
        bad = [(n, (t - p) / t) for (n, t), p in zip(fit.samples, fit.predicted)
               if t and abs(t - p) / t > MAX_RELATIVE_RESIDUAL]
        if bad:
            listed = ", ".join(f"{n} tokens {100 * r:+.0f}%" for n, r in bad)
            out.append(f"MoE all-to-all: timings off the fit by more than {100 * MAX_RELATIVE_RESIDUAL:.0f}%: "
                       f"{listed}; the machine may be busy (measure again with more --repeats)")
    if samples.expert_tensor_parallel_size is not None:
        out.append(f"expert-tensor parallelism {samples.expert_tensor_parallel_size}: the layers were timed with "
                   "every expert on the rank, so T(s) holds the dispatcher's gather over the TP group, not "
                   "over the expert-TP group (docs/moe.md)")
    if samples.hdp_size < 2:
        out.append("one rank: the P2P link and the ring step overhead were not measured (run "
                   "with --nproc-per-node >= 2)")
    return out


def format_report(result: Profile) -> str:
    """The human-readable fit report ``bytescale profile`` prints."""
    cm, s = result.cost_model, result.samples
    lines = [
        f"cost model {cm.name!r} ({cm.num_layers} layers) from {len(s.time_samples)} lengths on "
        f"{s.device_name}:",
        f"  T(s)   = {cm.alpha1:.4g} s^2 + {cm.beta1:.4g} s + {cm.gamma:.4g}  seconds per layer, "
        f"fwd+bwd   (R^2 {result.time_fit.r2:.4f})",
        f"  Act(s) = {cm.alpha2:.4g} s + {cm.beta2:.4g}  bytes per layer   "
        f"(R^2 {result.activation_fit.r2:.4f})",
        f"  host link D2H {s.d2h_bandwidth / 1e9:.2f} GB/s, H2D {s.h2d_bandwidth / 1e9:.2f} GB/s",
    ]
    if s.hdp_size >= 2:
        lines.append(f"  ring P2P {s.p2p_bandwidth / 1e9:.3f} GB/s, latency {s.p2p_latency_s * 1e6:.0f} us, "
                     f"ring step overhead {s.ring_step_overhead_s * 1e3:.3f} ms per layer "
                     f"(over {s.hdp_size} ranks)")
        lines.append(f"  per document per ring step {s.per_document_s * 1e3:.3f} ms per layer")
        if s.ring_fit is not None and s.ring_fit.samples:
            lines.append("  ring micro-batches   measured   before   resid    after   resid")
            rf = s.ring_fit
            for (d, n, tokens, m), b, a, rb, ra in zip(rf.samples, rf.predicted_before, rf.predicted_after,
                                                      rf.residuals("before"), rf.residuals("after")):
                lines.append(f"  D={d:<3} {n:>3} doc(s) {tokens:>6} tok {m * 1e3:8.1f} ms {b * 1e3:8.1f} "
                             f"{100 * rb:+6.1f}% {a * 1e3:8.1f} {100 * ra:+6.1f}%")
    if s.moe_dispatch_samples:
        etp = (f" ({s.expert_tensor_parallel_size} GPU(s) apart)" if s.expert_tensor_parallel_size is not None
               else "")
        lines.append(f"  MoE all-to-all over {s.expert_parallel_size} ranks{etp}: "
                     f"{cm.moe_dispatch_s_per_token * 1e6:.3f} us per token + {cm.moe_dispatch_s * 1e3:.3f} ms "
                     f"per layer (4 per layer, fwd+bwd; {cm.moe_a2a_bytes_per_token:.0f} B/token sent)")
        dispatch = fit_moe_dispatch(s.moe_dispatch_samples)
        for (n, t), p in zip(dispatch.samples, dispatch.predicted):
            lines.append(f"    {n:>6} tokens  {t * 1e3:8.3f} ms  fit {p * 1e3:8.3f} ms  {100 * (t - p) / t if t else 0:+5.1f}%")
    lines.append("  length    time/layer      fit    resid   act/layer        fit    resid")
    act = dict(s.activation_samples)
    t_res, a_res = dict(result.time_fit.residuals), dict(result.activation_fit.residuals)
    for n, t in s.time_samples:
        a = act.get(n, math.nan)
        lines.append(
            f"  {n:>6}  {t * 1e3:9.3f} ms {(cm.layer_time(n) + cm.per_document_s) * 1e3:9.3f}  {100 * t_res.get(n, 0):+5.1f}%"
            f"  {a / 1e6:8.3f} MB {cm.activation_bytes(n) / 1e6:9.3f}  {100 * a_res.get(n, 0):+5.1f}%"
        )
    lines += [f"WARNING: {w}" for w in result.warnings]
    return "\n".join(lines)


class SyntheticSource:
    """Measurements played from a known cost model with multiplicative noise (tests, what-ifs)."""

    #: Tokens per rank of the played MoE all-to-alls (when the truth has an all-to-all).
    MOE_TOKENS = (256, 512, 1024, 2048, 4096)

    def __init__(self, truth: CostModel, *, noise: float = 0.0, seed: int = 0, hdp_size: int = 2,
                 device_name: str = "synthetic") -> None:
        if noise < 0:
            raise ValueError(f"noise ({noise}) must be >= 0 (a relative standard deviation)")
        self.truth, self.noise, self.hdp_size, self.device_name = truth, noise, hdp_size, device_name
        self._rng = np.random.default_rng(seed)

    def _noisy(self, value: float) -> float:
        return float(value * (1.0 + self.noise * self._rng.standard_normal())) if self.noise else float(value)

    def measure(self, lengths: Sequence[int], *, progress: Progress | None = None) -> ProfileSamples:
        t = self.truth
        time_samples, activation_samples = [], []
        for i, n in enumerate(lengths):
            time_samples.append((int(n), self._noisy(t.layer_time(n) + t.per_document_s)))
            activation_samples.append((int(n), self._noisy(t.activation_bytes(n))))
            if progress is not None:
                progress(f"{i + 1}/{len(lengths)} lengths: {n} tokens")
        moe: tuple[tuple[int, float], ...] = ()
        if t.expert_parallel_size > 1:  # one all-to-all is a quarter of the layer's dispatch
            moe = tuple((n, self._noisy((t.moe_dispatch_s_per_token * n + t.moe_dispatch_s) / 4))
                        for n in self.MOE_TOKENS)
        return ProfileSamples(
            time_samples=tuple(time_samples), activation_samples=tuple(activation_samples),
            d2h_bandwidth=t.d2h_bandwidth, h2d_bandwidth=t.h2d_bandwidth,
            p2p_bandwidth=t.p2p_bandwidth_intra, p2p_latency_s=t.p2p_latency_s,
            ring_step_overhead_s=t.ring_step_overhead_s, device_name=self.device_name,
            hdp_size=self.hdp_size, per_document_s=t.per_document_s, moe_dispatch_samples=moe,
            expert_parallel_size=t.expert_parallel_size, moe_a2a_bytes_per_token=t.moe_a2a_bytes_per_token,
            expert_lockstep_size=t.expert_lockstep_size,
        )
