"""What a Mixture-of-Experts layer adds to the cost model: token dispatch and its copies.

A MoE layer (megatron-core's ``MoELayer`` with the all-to-all token dispatcher, the one the
Mixtral example runs) computes, per token, the router (``h x E`` GEMM) and ``k`` SwiGLU experts
(``SequentialMLP`` or grouped GEMM: the same FLOPs, ``k * 3 * 2 h f`` forward), which
:func:`.presets.layer_flops_per_token` counts. Around them it moves tokens, which FLOPs do not
show. Per layer, for one rank of an expert-parallel (EP) group of size ``E`` whose tensor-
parallel size is ``T`` and whose experts are split over ``P`` GPUs each (expert-tensor
parallelism, Megatron's ``--expert-tensor-parallel-size``; ``P = T`` by default), with sequence
parallelism, so the rank holds ``s / T`` of its HDP rank's ``s`` tokens, and uniform routing
(what the load-balancing loss aims at). megatron-core 0.16's all-to-all dispatcher
(``MoEAlltoAllTokenDispatcher``) permutes the rank's own routed copies, all-to-alls them over
the EP group, all-gathers them over the expert-TP group (``P`` ranks), sorts them by local
expert, and does the reverse after the experts; the expert ranks are laid out ``tp-ep-dp-pp``
with tp = ``P``, so an EP group's members sit ``P`` GPUs apart and the group (with its expert-TP
peers) spans ``E P`` consecutive GPUs:

* **all-to-all over EP** (dispatch before the experts, combine after; each again in backward):
  four all-to-alls, each sending ``k * h * dtype * (E - 1) / E`` bytes per token of the rank's
  ``s / T``, i.e. ``4 k h dtype (E - 1) / (E T)`` per token of the sequence share (``P`` does
  not enter: the rank sends its own tokens). With ``G`` GPUs per node a member's ``E - 1`` peers
  are ``min(E, max(1, G // P)) - 1`` on its node (NVLink) and the rest on other nodes (network);
  NVLink and the NIC run at once, so an all-to-all takes the longer of the two shares. With
  ``P = T`` that is ``min(E, R) - 1`` with ``R = G // T`` HDP ranks per node, as the EP group
  is then ``E`` consecutive HDP ranks (``StepPlan.ep_size``; in general an expert group spans
  ``max(1, P E / T)`` HDP ranks, :mod:`.expert_layout`);
* **all-gather / reduce-scatter over expert TP** (``P > 1``): after the all-to-all the rank
  holds ``k s / T`` routed tokens; the dispatcher gathers those of its ``P - 1`` expert-TP peers
  before the experts and reduce-scatters after (and the reverse in backward): four collectives
  of ``(P - 1) / T * k * h * dtype`` bytes per token of the share, over NVLink when ``P <= G``,
  else the network (a group no wider than TP keeps NVLink's rate even past a node: the cost
  model takes TP groups as NVLink-connected). Charged at EP 1 too: it is the dispatcher's, not
  expert parallelism's;
* **permute / unpermute copies**: the dispatcher copies each of the rank's own routed tokens
  into expert order and back (read and write, forward and backward): ``8 k h dtype / T`` bytes
  per token of the share at the GPU's memory bandwidth, memory-bound, counted as compute. They
  run before the all-to-all and after the combine, on the rank's ``s / T`` tokens, so ``P``
  does not enter. The second sort (by local expert, on the ``P k s / T`` gathered tokens, only
  with more than one local expert) is not modelled;
* **latency**: ``p2p_latency_s`` per collective (4 all-to-alls when ``E > 1``, 4 expert-TP
  collectives when ``P > 1``), per layer per micro-batch.

The experts' FLOPs do not change with ``P``: the rank runs ``P k s / T`` tokens through ``1 / P``
of each expert's FFN.

None of it overlaps compute in megatron-core 0.16 (the dispatcher waits for its collectives),
so the communication is exposed time: :attr:`.CostModel.moe_dispatch_s_per_token` per token of
a member's share plus :attr:`.CostModel.moe_dispatch_s` per micro-batch, both per layer,
forward and backward together (:mod:`.ring_time` adds them to every micro-batch). Dense models
get 0 for all of it: their sequence-parallel collectives are part of the GEMM efficiency that
Megatron's dense MFU tables measure (with TP communication overlap), as before. Not modelled:
the router's probabilities (``k`` fp32 per token, < 0.1 % of the bytes), load imbalance
between experts (a perfectly balanced router is assumed), capacity-factor token dropping.

Without expert parallelism (``E = 1``) there is no all-to-all; with ``P = 1`` there are no
expert-TP collectives (a TP 1 model at its default ETP has no MoE communication at all). With
``P = T`` every number is the one from before expert-tensor parallelism was modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .expert_layout import expert_lockstep_refusal

#: Per routed token copy per layer, bytes the dispatcher's permute and unpermute read and write
#: in units of ``h * dtype``: permute reads and writes the copy (2), unpermute reads it and
#: writes the combined token (2), and backward does both again (x 2).
PERMUTE_BYTES_FACTOR = 8.0
#: Collectives of each kind per layer, forward and backward: dispatch + combine, twice.
COLLECTIVES_PER_LAYER = 4


@dataclass(frozen=True)
class MoEDispatch:
    """The dispatch terms of one MoE layer on one rank, per token of the rank's sequence share
    (forward and backward together); see the module docstring for every formula."""

    a2a_bytes_per_token: float
    """Bytes the rank sends in the four EP all-to-alls."""
    a2a_intra_bytes_per_token: float
    """Of those, bytes to peers on the rank's node (NVLink)."""
    a2a_inter_bytes_per_token: float
    """Of those, bytes to peers on other nodes (network)."""
    tp_bytes_per_token: float
    """Bytes the rank sends in the four expert-TP all-gathers / reduce-scatters."""
    permute_bytes_per_token: float
    """Bytes the permute / unpermute copies read and write in device memory."""
    seconds_per_token: float
    """Exposed communication seconds per token (all-to-alls and expert-TP collectives)."""
    seconds: float
    """Exposed latency seconds per micro-batch (one ``p2p_latency_s`` per collective)."""
    permute_s_per_token: float
    """Seconds of the copies per token (memory-bound compute)."""


def moe_dispatch(model: Any, hardware: Any, *, expert_parallel_size: int | None = None,
                 expert_tensor_parallel_size: int | None = None) -> MoEDispatch:
    """The dispatch terms of ``model`` (a :class:`.presets.ModelSpec`) on ``hardware``
    (a :class:`.presets.HardwareSpec`): all zero for a dense model.

    ``expert_parallel_size`` and ``expert_tensor_parallel_size`` override the model's E and ETP
    (ETP None: the model's, whose None is TP).
    """
    ep = int(model.expert_parallel_size if expert_parallel_size is None else expert_parallel_size)
    if ep < 1:
        raise ValueError(f"model {model.name!r}: expert_parallel_size ({ep}) must be >= 1")
    tp = model.tensor_parallel_size
    etp = expert_tensor_parallel_size
    if etp is None:
        etp = getattr(model, "expert_tensor_parallel_size", None) or tp
    if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
        raise ValueError(f"model {model.name!r}: expert_tensor_parallel_size ({etp!r}) must be an integer >= 1")
    if model.num_experts <= 1:
        if ep != 1 or etp != tp:
            raise ValueError(f"model {model.name!r} is dense (num_experts 1): expert_parallel_size "
                             f"({ep}) must be 1 and expert_tensor_parallel_size ({etp}) the TP size ({tp})")
        return MoEDispatch(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if model.num_experts % ep:
        divisors = [d for d in range(1, model.num_experts + 1) if model.num_experts % d == 0]
        raise ValueError(f"model {model.name!r}: expert_parallel_size ({ep}) must divide the "
                         f"{model.num_experts} experts; choose one of {divisors}")
    why = expert_lockstep_refusal(tp, etp, ep)
    if why:
        raise ValueError(f"model {model.name!r}: {why}")
    copy = model.moe_router_topk * model.hidden_size * model.dtype_bytes  # one routed token copy
    ep_members_per_node = max(1, hardware.gpus_per_node // etp)  # EP members sit ETP GPUs apart
    on_node = min(ep, ep_members_per_node)
    a2a_intra = COLLECTIVES_PER_LAYER * copy * (on_node - 1) / ep / tp
    a2a_inter = COLLECTIVES_PER_LAYER * copy * (ep - on_node) / ep / tp
    tp_bytes = COLLECTIVES_PER_LAYER * copy * (etp - 1) / tp
    # NVLink unless expert TP spans nodes; a TP group wider than a node keeps NVLink's rate as before
    tp_bandwidth = (hardware.p2p_bandwidth_intra if etp <= max(hardware.gpus_per_node, tp)
                    else hardware.p2p_bandwidth_inter)
    a2a_s = max(a2a_intra / hardware.p2p_bandwidth_intra, a2a_inter / hardware.p2p_bandwidth_inter)
    collectives = COLLECTIVES_PER_LAYER * ((ep > 1) + (etp > 1))
    permute = PERMUTE_BYTES_FACTOR * copy / tp
    return MoEDispatch(
        a2a_bytes_per_token=a2a_intra + a2a_inter,
        a2a_intra_bytes_per_token=a2a_intra,
        a2a_inter_bytes_per_token=a2a_inter,
        tp_bytes_per_token=tp_bytes,
        permute_bytes_per_token=permute,
        seconds_per_token=a2a_s + tp_bytes / tp_bandwidth,
        seconds=collectives * hardware.p2p_latency_s,
        permute_s_per_token=permute / hardware.memory_bandwidth,
    )


@dataclass(frozen=True)
class DispatchFit:
    """The dispatch terms fitted to measured all-to-alls (``bytescale profile --num-experts``)."""

    seconds_per_token: float
    """``moe_dispatch_s_per_token``: 4 x the fitted seconds per token of one all-to-all."""
    seconds: float
    """``moe_dispatch_s``: 4 x the fitted constant of one all-to-all."""
    samples: tuple[tuple[int, float], ...]
    """(tokens per rank, seconds of one all-to-all) as measured."""
    predicted: tuple[float, ...]


def fit_moe_dispatch(samples: Any) -> DispatchFit:
    """Fit ``seconds = a * tokens + b`` (both >= 0) to timed all-to-alls of one rank's routed
    tokens, and scale to the layer's four (dispatch and combine, forward and backward).

    ``samples``: ``(tokens per rank, seconds of one all-to-all)``, at least 2 distinct token
    counts. The same non-negative least squares as every other fit of the cost model.
    """
    from .least_squares import nonnegative_lstsq, samples_array

    arr = samples_array(samples, "MoE all-to-all samples (tokens, seconds)")
    if len(np.unique(arr[:, 0])) < 2:
        raise ValueError(f"the MoE all-to-all fit needs at least 2 distinct token counts, got "
                         f"{len(arr)} samples at {len(np.unique(arr[:, 0]))}; measure more token counts")
    a, b = nonnegative_lstsq(np.stack([arr[:, 0], np.ones(len(arr))], axis=1), arr[:, 1])
    return DispatchFit(seconds_per_token=COLLECTIVES_PER_LAYER * a, seconds=COLLECTIVES_PER_LAYER * b,
                       samples=tuple((int(n), float(t)) for n, t in arr),
                       predicted=tuple(float(a * n + b) for n in arr[:, 0]))


def a2a_bytes_per_token(*, hidden_size: int, topk: int, element_size: int, expert_parallel_size: int,
                        tensor_parallel_size: int = 1) -> float:
    """``moe_a2a_bytes_per_token``: ``4 k h dtype (E - 1) / (E T)`` (the module docstring)."""
    e = expert_parallel_size
    return COLLECTIVES_PER_LAYER * topk * hidden_size * element_size * (e - 1) / e / tensor_parallel_size
