"""The measurements of ``bytescale profile`` on a real megatron-core model (through calibration).

:class:`MegatronProfileSource` is the :class:`~megatron_bytescale.tools.profile.ProfileSource`
of a live model: it runs :func:`~.calibration.calibrate_cost_model` (decoder layers only, timed
per length; activation bytes; the host link; the P2P link and ring step overhead over the HDP
group) and hands the samples to the profile's fit and report; for a MoE model with expert
parallelism it also times the expert group's all-to-all (:mod:`.moe_calibration`). There is
one implementation of the measurements, in those modules; this one only adapts them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_bytescale.planner.profile import Profile, ProfileSamples, profile

from megatron_bytescale.planner.expert_layout import expert_lockstep_size
from megatron_bytescale.planner.moe_cost import a2a_bytes_per_token

from .calibration import calibrate_cost_model
from .groups import HDPGroupManager
from .moe_calibration import measure_moe_all_to_all


class MegatronProfileSource:
    """Measure ``model`` (a bare ``ByteScaleGPTModel``) on every HDP rank of ``manager``.

    Collective: every HDP rank calls :meth:`measure`; all get the same samples (rank 0's).
    """

    def __init__(self, model: torch.nn.Module, manager: HDPGroupManager, *, kv_bytes_per_token: float,
                 dkv_bytes_per_token: float | None = None, repeats: int = 3, vocab_size: int = 256,
                 host_bytes: int = 64 << 20, expert_parallel_size: int = 1,
                 expert_tensor_parallel_size: int | None = None) -> None:
        self.model, self.manager = model, manager
        self.expert_parallel_size = expert_parallel_size
        self.expert_tensor_parallel_size = expert_tensor_parallel_size
        self.kv_bytes_per_token, self.dkv_bytes_per_token = kv_bytes_per_token, dkv_bytes_per_token
        self.repeats, self.vocab_size, self.host_bytes = repeats, vocab_size, host_bytes

    def measure(self, lengths: Sequence[int], *,
                progress: Callable[[str], None] | None = None) -> ProfileSamples:
        calibration = calibrate_cost_model(
            self.model, self.manager, lengths=lengths, kv_bytes_per_token=self.kv_bytes_per_token,
            dkv_bytes_per_token=self.dkv_bytes_per_token, repeats=self.repeats,
            vocab_size=self.vocab_size, host_bytes=self.host_bytes, progress=progress,
        )
        moe: dict = {}
        if self.expert_parallel_size > 1:
            moe = self._measure_all_to_all(progress)
        tp = int(getattr(self.model.config, "tensor_model_parallel_size", 1) or 1)
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp != tp:  # recorded only when it is not Megatron's default
            moe.update(expert_tensor_parallel_size=etp,
                       expert_lockstep_size=expert_lockstep_size(tp, etp, self.expert_parallel_size))
        return ProfileSamples(
            time_samples=calibration.time_samples,
            activation_samples=calibration.activation_samples,
            d2h_bandwidth=calibration.d2h_bandwidth,
            h2d_bandwidth=calibration.h2d_bandwidth,
            p2p_bandwidth=calibration.p2p_bandwidth,
            p2p_latency_s=calibration.p2p_latency_s,
            ring_step_overhead_s=calibration.cost_model.ring_step_overhead_s,
            per_document_s=calibration.cost_model.per_document_s,
            ring_fit=calibration.ring_fit,
            device_name=calibration.device_name,
            hdp_size=self.manager.size,
            **moe,
        )

    def _measure_all_to_all(self, progress: Callable[[str], None] | None) -> dict:
        """The expert group's all-to-all samples, per token of a sequence share: with sequence
        parallelism a rank sends 1 / TP of its share's tokens, so ``n`` timed rows stand for
        ``n * TP`` share tokens."""
        config, ep = self.model.config, self.expert_parallel_size
        if not getattr(config, "num_moe_experts", None):
            raise ValueError(f"--expert-model-parallel-size {ep} needs a MoE model (--num-experts)")
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        element = 2 if (config.bf16 or config.fp16) else 4
        dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
        samples = measure_moe_all_to_all(self.manager.hdp, ep_size=ep,
                                         expert_tensor_parallel_size=self.expert_tensor_parallel_size,
                                         hidden_size=int(config.hidden_size),
                                         topk=int(config.moe_router_topk), dtype=dtype, repeats=self.repeats,
                                         progress=progress)
        return dict(
            moe_dispatch_samples=tuple((n * tp, t) for n, t in samples), expert_parallel_size=ep,
            moe_a2a_bytes_per_token=a2a_bytes_per_token(
                hidden_size=int(config.hidden_size), topk=int(config.moe_router_topk), element_size=element,
                expert_parallel_size=ep, tensor_parallel_size=tp),
        )


def kv_bytes_per_token(config: object, *, dkv_wire: str = "accumulator") -> tuple[float, float]:
    """(K+V, dK+dV) bytes per token per layer one TP rank moves in a ring step.

    K and V travel in the model's dtype; dK/dV in float32 accumulators, or in the K/V dtype with
    ``dkv_wire="input"`` (``--bytescale-dkv-wire-dtype``).
    """
    heads = int(config.num_attention_heads)
    groups = int(config.num_query_groups or heads)
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    head_dim = int(config.kv_channels or config.hidden_size // heads)
    element = 2 if (config.bf16 or config.fp16) else 4
    per = 2 * max(1, groups // tp) * head_dim
    return float(per * element), float(per * (element if dkv_wire == "input" else 4))


def profile_model(model: torch.nn.Module, manager: HDPGroupManager, *, lengths: Sequence[int],
                  repeats: int = 3, vocab_size: int = 256, dkv_wire: str = "accumulator",
                  progress: Callable[[str], None] | None = None, expert_parallel_size: int = 1,
                  expert_tensor_parallel_size: int | None = None, **cost_model_fields) -> Profile:
    """``bytescale profile`` from Python: measure ``model`` at ``lengths``, fit, report.

    Collective over the HDP group. ``cost_model_fields`` go to the fitted :class:`CostModel`
    (``ranks_per_node``, ``name``, ...); ``num_layers`` and the K/V bytes come from the model.
    ``expert_parallel_size`` > 1 (a MoE model): also time the all-to-all over expert groups of
    that many consecutive HDP ranks and fit the dispatch terms. ``expert_tensor_parallel_size``
    (None: TP): the run's expert-TP size; the all-to-all is then timed over EP groups whose
    members sit that many GPUs apart, and the profile records it and the HDP ranks an expert
    group spans (the plans' ``ep_size``).
    """
    config = model.config
    kv, dkv = kv_bytes_per_token(config, dkv_wire=dkv_wire)
    source = MegatronProfileSource(model, manager, kv_bytes_per_token=kv, dkv_bytes_per_token=dkv,
                                   repeats=repeats, vocab_size=vocab_size,
                                   expert_parallel_size=expert_parallel_size,
                                   expert_tensor_parallel_size=expert_tensor_parallel_size)
    cost_model_fields.setdefault("num_layers", int(config.num_layers))
    return profile(source, lengths=lengths, progress=progress, kv_bytes_per_token=kv,
                   dkv_bytes_per_token=dkv, **cost_model_fields)
