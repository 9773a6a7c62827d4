"""Named models (paper Table 1) and an H100-class GPU, for the analytic cost model.

Model shapes. Layers, heads, KV groups and hidden size are the paper's Table 1 (paper.md §7.1).
The paper gives neither FFN sizes nor vocabularies; we take them from the public model cards
(``config.json`` on the Hugging Face hub) of the closest public models:

==============  ==================================  ========  ======  =====================
preset          public model card used              FFN       vocab   TP x PP (our choice)
==============  ==================================  ========  ======  =====================
llama-7b        meta-llama/Llama-2-7b-hf            11008     32000   1 x 1
llama-13b       meta-llama/Llama-2-13b-hf           13824     32000   2 x 1
llama-30b       huggyllama/llama-30b (LLaMA-1 33B)  17920     32000   4 x 1
llama-70b       meta-llama/Llama-2-70b-hf           28672     32000   8 x 4
mistral-8x7b    mistralai/Mixtral-8x7B-v0.1         14336     32000   4 x 4 (8 experts, top-2)
mistral-8x22b   mistralai/Mixtral-8x22B-v0.1        16384     32000   8 x 8 (8 experts, top-2)
==============  ==================================  ========  ======  =====================

Notes. Table 1 gives 8 KV groups for every model (GQA), unlike Llama-2-7B/13B; we follow
Table 1. Table 1 gives LLaMA-30B 56 heads for hidden 6656 (the public LLaMA-1 33B has 52 heads
of 128); we keep 56 heads, so head_dim = 6656/56 is not an integer: the cost model only needs
the products (q_dim = hidden, kv_dim = groups * hidden / heads). TP and PP are not in the paper
beyond "HDP + TP" for 7B-30B and "HDP + TP + PP" for 70B and the MoE models (§8.2); the 7B
case study has d_cp = 256 among 1,024 GPUs, so TP = 1 there. Our TP/PP choices keep the weights,
ZeRO-1 states and 8K tokens of activations of one rank under 80 GB; change them with
:func:`model_spec` keyword arguments. MoE layers cost the router and top-k experts per token
(the expert FLOPs a rank runs on average under any expert parallelism), plus the token
dispatch of :mod:`.moe_cost`: the dispatcher's copies, its TP collectives and, with
``expert_parallel_size`` E > 1 (EP groups of E expert-TP groups of ``expert_tensor_parallel_size``
GPUs, TP by default), its all-to-alls.

H100-class GPU (:data:`H100`), every constant with its source:

* peak 989.4 TFLOP/s dense BF16: NVIDIA H100 SXM5 datasheet (1,979 with sparsity).
* GEMM efficiency 0.5: Megatron-LM reports 45-55 % model FLOP utilisation for large dense GPT
  training on H100 (NVIDIA Megatron-Core performance tables); we use 0.5 for the layer GEMMs.
* attention efficiency 0.4: FlashAttention-2 reaches ~330-400 TFLOP/s fwd+bwd on H100 at head
  dim 128 (FlashAttention-3 paper, Fig. 5 baselines), i.e. 0.35-0.4 of peak.
* gamma 30 us per layer per micro-batch: ~30 kernels per layer fwd+bwd at ~1 us launch/tail.
* PCIe 50 GB/s each direction: PCIe Gen5 x16 is 64 GB/s raw; pinned cudaMemcpy measures about
  50-55 GB/s on H100 SXM (nvbandwidth host_to_device / device_to_host).
* NVLink 360 GB/s one direction: NVLink 4 is 450 GB/s per direction; NCCL P2P reaches ~80 %.
* network 40 GB/s one direction: one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s) at ~80 %.
* latency 10 us: NCCL P2P small-message latency across InfiniBand (intra-node is lower; one
  value keeps the model simple and errs on the slow side).
* 8 GPUs per node (HGX H100).
* memory 3.35 TB/s: H100 SXM5 HBM3 datasheet (the MoE dispatcher's permute copies).

Fig. 6(a) sanity check (:func:`fig6a_comparison`): the paper's per-layer attention and MLP times
for 4K-128K are consistent with LLaMA-7B at TP = 8 on this GPU (hardware not stated in the
paper; TP = 8 is our reading). See the report in docs/benchmarks.md for the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .cost_model import CostModel
from .expert_layout import expert_lockstep_size

#: FLOPs of forward + backward relative to forward for GEMMs (backward = dgrad + wgrad).
GEMM_FWD_BWD_FACTOR = 3.0
#: FLOPs of forward + backward relative to forward for FlashAttention-2: the backward pass
#: recomputes QK^T and does four more s^2 GEMMs (dP, dS->dQ, dK, dV): 5 vs 2 in forward.
ATTENTION_FWD_BWD_FACTOR = 3.5


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer as the cost model needs it (LLaMA / Mistral family)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """KV heads (GQA groups); equal to num_attention_heads for plain multi-head attention."""
    ffn_hidden_size: int
    """SwiGLU intermediate size (per expert for MoE)."""
    vocab_size: int
    num_experts: int = 1
    """1 for a dense model."""
    moe_router_topk: int = 1
    expert_parallel_size: int = 1
    """EP size E (Megatron's ``--expert-model-parallel-size``): experts split over E expert-TP
    groups, tokens dispatched by all-to-all (:mod:`.moe_cost`); 1: every expert on every rank."""
    tensor_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """Expert TP size ETP (Megatron's ``--expert-tensor-parallel-size``): each expert's weights
    split over ETP GPUs; None: TP, Megatron's default. An expert group is ETP x E consecutive
    GPUs, so it spans :attr:`expert_lockstep_size` HDP ranks; ETP x E and TP must divide one
    another (:func:`.expert_layout.expert_lockstep_refusal`)."""
    pipeline_parallel_size: int = 1
    """Default PP degree for this model (the planner's ``pp_size`` overrides it)."""
    dtype_bytes: int = 2
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "num_experts", "moe_router_topk",
                     "expert_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {name} ({value!r}) must be an integer >= 1")
        tp = self.tensor_parallel_size
        if not _tp_fits(tp, self.num_attention_heads, self.num_query_groups):
            choices = [d for d in range(1, self.num_attention_heads + 1)
                       if _tp_fits(d, self.num_attention_heads, self.num_query_groups)]
            raise ValueError(
                f"model {self.name!r}: tensor_parallel_size ({tp}) must divide the attention heads "
                f"({self.num_attention_heads}) and be a divisor or multiple of the KV groups "
                f"({self.num_query_groups}), as Megatron requires; choose one of {choices}"
            )
        if self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"model {self.name!r}: moe_router_topk ({self.moe_router_topk}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        if self.num_experts % self.expert_parallel_size:
            divisors = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ValueError(
                f"model {self.name!r}: expert_parallel_size ({self.expert_parallel_size}) must divide "
                f"num_experts ({self.num_experts}); choose one of {divisors}"
            )
        etp = self.expert_tensor_parallel_size
        if etp is not None:
            if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
                raise ValueError(f"model {self.name!r}: expert_tensor_parallel_size ({etp!r}) must be an "
                                 "integer >= 1, or None for the tensor_parallel_size")
            if self.num_experts <= 1 and etp != tp:
                raise ValueError(f"model {self.name!r} is dense (num_experts 1): expert_tensor_parallel_size "
                                 f"({etp}) applies to MoE models only; leave it None")
        block = self.expert_tp * self.expert_parallel_size
        if block % tp and tp % block:
            raise ValueError(
                f"model {self.name!r}: expert_tensor_parallel_size ({self.expert_tp}) x expert_parallel_size "
                f"({self.expert_parallel_size}) = {block} and tensor_parallel_size ({tp}) do not divide one "
                "another: an expert group must hold whole TP groups or lie inside one (the TP ranks of an "
                "HDP rank run one micro-batch); choose sizes where one divides the other"
            )

    @property
    def expert_tp(self) -> int:
        """ETP in effect: ``expert_tensor_parallel_size``, else TP (Megatron's default)."""
        return self.expert_tensor_parallel_size or self.tensor_parallel_size

    @property
    def expert_lockstep_size(self) -> int:
        """HDP ranks one expert group spans, which a plan keeps in step (``StepPlan.ep_size``):
        ``max(1, ETP x E / TP)`` (:func:`.expert_layout.expert_lockstep_size`); E when ETP = TP."""
        return expert_lockstep_size(self.tensor_parallel_size, self.expert_tp, self.expert_parallel_size)

    @property
    def head_dim(self) -> float:
        return self.hidden_size / self.num_attention_heads

    @property
    def kv_dim(self) -> float:
        return self.num_query_groups * self.head_dim


def _tp_fits(tp: int, heads: int, groups: int) -> bool:
    """Megatron's rule: TP divides the heads; KV groups are a multiple or a divisor of TP."""
    return heads % tp == 0 and (groups % tp == 0 or tp % groups == 0)


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One GPU and its links, as the cost model needs them."""

    name: str
    peak_flops: float
    """Dense BF16 tensor-core FLOP/s of one GPU."""
    gemm_efficiency: float
    """Achieved fraction of peak for the layer's GEMMs (fwd+bwd)."""
    attention_efficiency: float
    """Achieved fraction of peak for causal flash attention (fwd+bwd)."""
    layer_overhead_s: float
    """gamma: fixed seconds per layer per micro-batch (kernel launches, norms of tiny inputs)."""
    d2h_bandwidth: float
    """Bytes/s device-to-host over PCIe (pinned memory)."""
    h2d_bandwidth: float
    p2p_bandwidth_intra: float
    """Bytes/s one direction between two GPUs of one node (NVLink)."""
    p2p_bandwidth_inter: float
    """Bytes/s one direction between GPUs of different nodes (one NIC per GPU)."""
    p2p_latency_s: float
    gpus_per_node: int
    source: str = ""
    memory_bandwidth: float = 3.35e12
    """Bytes/s of device memory (H100 SXM5 HBM3): the MoE dispatcher's memory-bound copies."""
    ring_straggler_s: float = 0.0
    """Per ring step per layer, the wait for a ring's slowest member per unit of sqrt(2 ln D)
    (:attr:`CostModel.ring_straggler_s`); 0 for a datasheet GPU."""
    ring_straggler_link_ratio: float = 0.0
    """The same wait as a multiple of the ring step's link time
    (:attr:`CostModel.ring_straggler_link_ratio`); 0 for a datasheet GPU."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "d2h_bandwidth", "h2d_bandwidth", "p2p_bandwidth_intra",
                     "p2p_bandwidth_inter", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} ({getattr(self, name)!r}) must be > 0")
        for name in ("gemm_efficiency", "attention_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name!r}: {name} ({getattr(self, name)!r}) must be in (0, 1]")
        if min(self.layer_overhead_s, self.p2p_latency_s, self.ring_straggler_s, self.ring_straggler_link_ratio) < 0:
            raise ValueError(f"hardware {self.name!r}: layer_overhead_s, p2p_latency_s, ring_straggler_s and "
                             "ring_straggler_link_ratio must be >= 0")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node ({self.gpus_per_node!r}) must be >= 1")


def layer_flops_per_token(model: ModelSpec) -> dict[str, float]:
    """Forward FLOPs per token of one layer before the TP split, by part.

    ``attention_linear`` is the QKV and output projections; ``mlp`` the SwiGLU (three GEMMs,
    top-k experts plus the router for MoE); ``lm_head`` the output layer's share amortised over
    the layers (it runs once per token on the last stage; spreading it keeps T(s) per layer);
    ``attention_quadratic`` the coefficient of s (causal QK^T and AV: 2 * s * q_dim each over the
    half mask, so FLOPs = attention_quadratic * s**2 per sequence).
    """
    h = float(model.hidden_size)
    q_dim = h
    kv_dim = model.kv_dim
    attention_linear = 2.0 * h * (q_dim + 2.0 * kv_dim) + 2.0 * q_dim * h
    mlp = model.moe_router_topk * 2.0 * 3.0 * h * model.ffn_hidden_size
    if model.num_experts > 1:
        mlp += 2.0 * h * model.num_experts
    lm_head = 2.0 * h * model.vocab_size / model.num_layers
    return {
        "attention_linear": attention_linear,
        "mlp": mlp,
        "lm_head": lm_head,
        "attention_quadratic": 2.0 * q_dim,
    }


def activation_bytes_per_token(model: ModelSpec) -> float:
    """Bytes per token of one layer's saved activations before the TP split.

    Counted tensors (flash attention, so nothing of size s^2 is kept): the input of the first
    norm and its output (the QKV GEMM input), Q/K/V, the attention output (also the output
    projection's input) and its fp32 log-sum-exp per head, the input of the second norm and its
    output (the MLP input), the gate and up outputs and the SwiGLU output (per routed expert
    copy for MoE), and for MoE the experts' input. With sequence parallelism every one of them
    is split over TP, so the caller divides by TP.

    The experts' input is the exception to that split: megatron-core's dispatcher gathers the
    routed copies of the whole expert-TP group (ETP ranks of ``k s / TP`` copies each) before
    the first expert GEMM, which keeps all ``ETP k s / TP`` rows at full width ``h`` for its
    weight gradient, so it counts ``ETP k h`` per token here (``k h`` at ETP 1). The gate / up /
    SwiGLU outputs of those rows are ``1 / ETP`` of the expert's width, ``3 f k`` per token
    after the same division.
    """
    d = model.dtype_bytes
    h = float(model.hidden_size)
    k = model.moe_router_topk
    moe_copy = h * k * model.expert_tp if model.num_experts > 1 else 0.0
    elements = 4.0 * h + 2.0 * h + 2.0 * model.kv_dim + 3.0 * model.ffn_hidden_size * k + moe_copy
    return d * elements + 4.0 * model.num_attention_heads


def analytic_cost_model(model: ModelSpec, hardware: HardwareSpec, *, name: str | None = None) -> CostModel:
    """The analytic cost model of ``model`` on ``hardware`` (TP split applied, SP assumed).

    FLOPs: :func:`layer_flops_per_token` times 3 (GEMM fwd+bwd) or 3.5 (flash attention
    fwd+bwd), divided by TP and by the achieved rate ``peak * efficiency``; for MoE models plus
    the dispatcher's permute copies (in ``beta1``) and its exposed communication
    (``moe_dispatch_s_per_token``, ``moe_dispatch_s``; :func:`.moe_cost.moe_dispatch`). Activations:
    :func:`activation_bytes_per_token` / TP, beta2 = 0 (no per-layer constant buffers are
    kept for backward). KV bytes: 2 (K and V) * KV heads on this TP rank (at least one: Megatron
    replicates KV heads when TP > groups) * head_dim * dtype bytes; dKV the same in fp32 (ring
    attention accumulates the travelling dK/dV in fp32).
    """
    from .moe_cost import moe_dispatch

    tp = model.tensor_parallel_size
    flops = layer_flops_per_token(model)
    moe = moe_dispatch(model, hardware)
    gemm_rate = hardware.peak_flops * hardware.gemm_efficiency
    attn_rate = hardware.peak_flops * hardware.attention_efficiency
    linear = flops["attention_linear"] + flops["mlp"] + flops["lm_head"]
    kv_heads_per_rank = max(model.num_query_groups / tp, 1.0)
    kv_elements = 2.0 * kv_heads_per_rank * model.head_dim
    return CostModel(
        name=name or f"{model.name}@{hardware.name}",
        num_layers=model.num_layers,
        alpha1=ATTENTION_FWD_BWD_FACTOR * flops["attention_quadratic"] / tp / attn_rate,
        beta1=GEMM_FWD_BWD_FACTOR * linear / tp / gemm_rate + moe.permute_s_per_token,
        gamma=hardware.layer_overhead_s,
        alpha2=activation_bytes_per_token(model) / tp,
        beta2=0.0,
        d2h_bandwidth=hardware.d2h_bandwidth,
        h2d_bandwidth=hardware.h2d_bandwidth,
        kv_bytes_per_token=kv_elements * model.dtype_bytes,
        dkv_bytes_per_token=kv_elements * 4.0,
        q_bytes_per_token=model.hidden_size / tp * model.dtype_bytes,
        p2p_bandwidth_intra=hardware.p2p_bandwidth_intra,
        p2p_bandwidth_inter=hardware.p2p_bandwidth_inter,
        p2p_latency_s=hardware.p2p_latency_s,
        ring_straggler_s=hardware.ring_straggler_s,
        ring_straggler_link_ratio=hardware.ring_straggler_link_ratio,
        ranks_per_node=max(1, hardware.gpus_per_node // tp),
        attention_forward_fraction=1.0 / ATTENTION_FWD_BWD_FACTOR,
        forward_fraction=1.0 / GEMM_FWD_BWD_FACTOR,
        expert_parallel_size=model.expert_parallel_size,
        expert_lockstep_size=(None if model.expert_tp == tp else model.expert_lockstep_size),
        moe_dispatch_s_per_token=moe.seconds_per_token,
        moe_dispatch_s=moe.seconds,
        moe_a2a_bytes_per_token=moe.a2a_bytes_per_token,
        moe_tp_bytes_per_token=moe.tp_bytes_per_token,
        source=f"analytic: {model.source or model.name}; {hardware.source or hardware.name}",
    )



MODELS: dict[str, ModelSpec] = {
    "llama-7b": ModelSpec(
        name="llama-7b", num_layers=32, hidden_size=4096, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=11008, vocab_size=32000,
        tensor_parallel_size=1, pipeline_parallel_size=1,
        source="Table 1 + Llama-2-7b-hf card (FFN 11008, vocab 32000)",
    ),
    "llama-13b": ModelSpec(
        name="llama-13b", num_layers=40, hidden_size=5120, num_attention_heads=40,
        num_query_groups=8, ffn_hidden_size=13824, vocab_size=32000,
        tensor_parallel_size=2, pipeline_parallel_size=1,
        source="Table 1 + Llama-2-13b-hf card (FFN 13824, vocab 32000)",
    ),
    "llama-30b": ModelSpec(
        name="llama-30b", num_layers=60, hidden_size=6656, num_attention_heads=56,
        num_query_groups=8, ffn_hidden_size=17920, vocab_size=32000,
        tensor_parallel_size=4, pipeline_parallel_size=1,
        source="Table 1 + LLaMA-1 33B card (FFN 17920, vocab 32000)",
    ),
    "llama-70b": ModelSpec(
        name="llama-70b", num_layers=80, hidden_size=8192, num_attention_heads=64,
        num_query_groups=8, ffn_hidden_size=28672, vocab_size=32000,
        tensor_parallel_size=8, pipeline_parallel_size=4,
        source="Table 1 + Llama-2-70b-hf card (FFN 28672, vocab 32000)",
    ),
    "mistral-8x7b": ModelSpec(
        name="mistral-8x7b", num_layers=32, hidden_size=4096, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=14336, vocab_size=32000,
        num_experts=8, moe_router_topk=2, tensor_parallel_size=4, pipeline_parallel_size=4,
        source="Table 1 + Mixtral-8x7B-v0.1 card (FFN 14336, vocab 32000, 8 experts top-2)",
    ),
    "mistral-8x22b": ModelSpec(
        name="mistral-8x22b", num_layers=56, hidden_size=6144, num_attention_heads=48,
        num_query_groups=8, ffn_hidden_size=16384, vocab_size=32000,
        num_experts=8, moe_router_topk=2, tensor_parallel_size=8, pipeline_parallel_size=8,
        source="Table 1 + Mixtral-8x22B-v0.1 card (FFN 16384, vocab 32000, 8 experts top-2)",
    ),
}

H100 = HardwareSpec(
    name="h100",
    peak_flops=989.4e12,
    gemm_efficiency=0.5,
    attention_efficiency=0.4,
    layer_overhead_s=30e-6,
    d2h_bandwidth=50e9,
    h2d_bandwidth=50e9,
    p2p_bandwidth_intra=360e9,
    p2p_bandwidth_inter=40e9,
    p2p_latency_s=10e-6,
    gpus_per_node=8,
    source="H100 SXM5 datasheet; NVLink4 / 400G NDR at ~80 %; PCIe Gen5 pinned copies",
)

#: The paper's hidden cluster, fitted to every hardware-revealing number the paper gives (its
#: case study's three step times and 97.6 % P2P share, Fig. 18's per-ring-step compute and P2P
#: readings) by ``scripts/fit_network.py``, which prints the residual of every observation;
#: docs/reproduction.md section 2 explains the fit. The H100 datasheet peak, NVLink and PCIe,
#: GPU efficiencies close to the datasheet preset's (GEMM 0.49, attention 0.39), 57 GB/s per GPU
#: between nodes, and a wait for the ring's slowest member of 1.67x the ring step's own link time
#: per unit of sqrt(2 ln D) (5.6x at D = 256; ``ring_straggler_link_ratio``): no link rate alone
#: makes the baseline's 256-rank rings as slow as its 8m40s step while keeping naive's 39-rank
#: rings as fast as its 4m32s. The wait scales with the bytes a step sends (not an absolute time,
#: which fits the case study as well but swamps the TP 8 models of Fig. 17), so TP 8 models, whose
#: ring steps send 8x less, wait 8x less, and rings inside a node wait at the NVLink rate.
PAPER_FIT = replace(
    H100,
    name="paper-fit",
    gemm_efficiency=0.49,
    attention_efficiency=0.39,
    p2p_bandwidth_inter=57e9,
    ring_straggler_link_ratio=1.67,
    source="fitted to the paper's case study and Fig. 18 (scripts/fit_network.py); H100 SXM5 peak, "
           "NVLink4, PCIe Gen5",
)

HARDWARE: dict[str, HardwareSpec] = {"h100": H100, "paper-fit": PAPER_FIT}

#: Paper Fig. 6(a), per-layer milliseconds (attention, MLP) by sequence length [F, OCR reading].
FIG6A_MS: dict[int, tuple[float, float]] = {
    4096: (0.8, 0.9),
    8192: (1.8, 1.8),
    16384: (4.8, 3.6),
    32768: (14.1, 7.5),
    65536: (48.2, 15.1),
    131072: (175.5, 28.2),
}

_ALIASES = {"7b": "llama-7b", "13b": "llama-13b", "30b": "llama-30b", "70b": "llama-70b",
            "8x7b": "mistral-8x7b", "8x22b": "mistral-8x22b",
            "mixtral-8x7b": "mistral-8x7b", "mixtral-8x22b": "mistral-8x22b"}


def _lookup(table: dict[str, Any], name: str, what: str) -> Any:
    key = str(name).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key) if table is MODELS else key
    if key not in table:
        raise ValueError(f"unknown {what} preset {name!r}; choose one of {sorted(table)}")
    return table[key]


def model_spec(name: str, **overrides: Any) -> ModelSpec:
    """The Table 1 model ``name`` (e.g. ``"llama-7b"``), with fields such as TP/PP overridden."""
    spec = _lookup(MODELS, name, "model")
    return replace(spec, **overrides) if overrides else spec


def hardware_spec(name: str = "h100", **overrides: Any) -> HardwareSpec:
    """The GPU/network preset ``name``, with fields overridden."""
    spec = _lookup(HARDWARE, name, "hardware")
    return replace(spec, **overrides) if overrides else spec


def preset_cost_model(
    model: str = "llama-7b",
    hardware: str = "h100",
    *,
    tensor_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
    expert_tensor_parallel_size: int | None = None,
) -> CostModel:
    """The analytic :class:`CostModel` of a named model on a named GPU.

    ``tensor_parallel_size``, ``expert_parallel_size`` and ``expert_tensor_parallel_size``
    override the preset's TP, EP and ETP (PP is a planner argument, not part of the per-layer
    cost). The name gains ``-ep{E}`` for E > 1 and ``-etp{P}`` for an ETP other than TP.
    """
    overrides: dict[str, Any] = {}
    if tensor_parallel_size is not None:
        overrides["tensor_parallel_size"] = tensor_parallel_size
    if expert_parallel_size is not None:
        overrides["expert_parallel_size"] = expert_parallel_size
    if expert_tensor_parallel_size is not None:
        overrides["expert_tensor_parallel_size"] = expert_tensor_parallel_size
    spec = model_spec(model, **overrides)
    hw = hardware_spec(hardware)
    ep = f"-ep{spec.expert_parallel_size}" if spec.expert_parallel_size > 1 else ""
    if spec.expert_tp != spec.tensor_parallel_size:
        ep += f"-etp{spec.expert_tp}"
    return CostModel.from_specs(spec, hw, name=f"{spec.name}-tp{spec.tensor_parallel_size}{ep}@{hw.name}")


def toy_cost_model(**changes: Any) -> CostModel:
    """A cost model for toy batches (tens to thousands of tokens per rank), the tests' and the
    scripts' small model (``changes`` override its fields).

    Chosen so that every regime shows up at these sizes: attention matters from a few hundred
    tokens, offload is only overlap-feasible for long sequences (r_max = (alpha1*s + beta1) *
    B / alpha2), and rings across nodes (4 ranks per node) can be communication-bound.
    """
    values: dict[str, Any] = dict(
        name="toy", num_layers=8, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0, beta2=0.0,
        d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0, dkv_bytes_per_token=128.0,
        p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8, p2p_latency_s=1e-6, ranks_per_node=4,
    )
    values.update(changes)
    return CostModel(**values)


def fig6a_comparison(
    model: str = "llama-7b", hardware: str = "h100", *, tensor_parallel_size: int = 8
) -> list[dict[str, float]]:
    """Per-layer attention and MLP milliseconds of the analytic model next to paper Fig. 6(a).

    "Attention" is the core (quadratic) plus the QKV/output projections, "MLP" the SwiGLU,
    both forward + backward on one rank with the given TP. Returns one row per length with the
    model's and the paper's milliseconds.
    """
    spec = model_spec(model, tensor_parallel_size=tensor_parallel_size)
    hw = hardware_spec(hardware)
    flops = layer_flops_per_token(spec)
    tp = spec.tensor_parallel_size
    gemm = hw.peak_flops * hw.gemm_efficiency
    attn = hw.peak_flops * hw.attention_efficiency
    rows = []
    for s, (paper_attn, paper_mlp) in sorted(FIG6A_MS.items()):
        attention = (ATTENTION_FWD_BWD_FACTOR * flops["attention_quadratic"] * s * s / tp / attn
                     + GEMM_FWD_BWD_FACTOR * flops["attention_linear"] * s / tp / gemm)
        mlp = GEMM_FWD_BWD_FACTOR * flops["mlp"] * s / tp / gemm
        rows.append({
            "length": float(s),
            "attention_ms": attention * 1e3,
            "paper_attention_ms": paper_attn,
            "mlp_ms": mlp * 1e3,
            "paper_mlp_ms": paper_mlp,
        })
    return rows
