"""What a training step costs besides its micro-batches: gradient reduction, optimizer, data wait.

The planner's estimate (:mod:`megatron_bytescale.planner.estimate`) times the micro-batch
phase of a step: every rank's micro-batches, ring communication, offload, pipeline bubbles.
A real step then reduces gradients over the HDP group, steps the optimizer, and, unless the
next plan was prepared during the previous step, waits for its data and its plan. These terms
are the same kind of arithmetic as the cost model's, built from the same links:

* **Gradient reduction** over the HDP group of one (TP rank, PP stage), a ring collective
  (``2 (N - 1)`` steps):

  - all-reduce (plain DDP): every rank sends ``2 (N - 1) / N`` of its gradient bytes;
  - ZeRO-1 (Megatron's distributed optimizer, paper §3.5): a reduce-scatter of the gradients
    and an all-gather of the updated parameters, ``(N - 1) / N`` of each.

  The rate is the cost model's NVLink rate when the whole HDP group sits in one node, else
  its network rate, plus ``p2p_latency_s`` per ring step. With expert parallelism E > 1, or
  an expert-tensor-parallel size P other than TP, the expert weights (``expert_params_per_rank``:
  1/E of the experts, each split over P GPUs) reduce over the expert-data-parallel group instead,
  after the dense ones, as Megatron's separate expert gradient buffer does: the GPUs of a stage
  (N x TP) over the expert group's P x E, i.e. ``N TP / (P E)`` ranks (N / E with P = TP; more
  than N when the expert group lies inside a TP group). It starts when the slowest rank
  has finished its micro-batches and is not overlapped with backward (Megatron without
  ``--overlap-grad-reduce``; with HDP the last bucket cannot start before the slowest rank
  anyway).
* **Optimizer**: ``optimizer_s_per_param`` seconds per parameter this rank updates (all of
  them, or 1/N of them under ZeRO-1). Adam reads and writes about 30 bytes per parameter
  (fp32 master weight, two moments and gradient; bf16 weight), memory-bound.
* **Data and plan wait**: ``load_s`` (reading and preparing the next global batch) plus
  ``plan_s``, the time the cluster's planner takes per step. Both are input parameters, never
  a time measured on the machine that runs the simulator: a simulated step must not change
  with that machine's speed or load (the simulator reports its own planning wall time
  separately, :attr:`.step.StepResult.planner_wall_s`). Without lookahead both are on the
  critical path; with lookahead (the plan of step t + 1 is made while step t trains, paper
  §6 "remote dataloader with CPU prefetch") only the part longer than the step itself is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..planner.cost_model import CostModel

#: H100 SXM HBM3, 3.35 TB/s (datasheet); Adam moves ~30 bytes per parameter (fp32 master
#: weight, exp_avg, exp_avg_sq read and written, fp32 gradient read, bf16 weight written).
ADAM_BYTES_PER_PARAM = 30.0
H100_HBM_BYTES_PER_S = 3.35e12
H100_OPTIMIZER_S_PER_PARAM = ADAM_BYTES_PER_PARAM / H100_HBM_BYTES_PER_S


@dataclass(frozen=True, kw_only=True)
class StepOverheads:
    """The step-level terms of a simulated training step (see the module docstring)."""

    params_per_rank: float = 0.0
    """Parameters one HDP rank holds and reduces: its TP shard of its (largest) PP stage.
    0 leaves the gradient reduction and the optimizer out."""
    grad_bytes_per_param: float = 4.0
    """Bytes per gradient element in the reduction (4: fp32, Megatron's
    ``--accumulate-allreduce-grads-in-fp32``; 2 for bf16 reductions)."""
    param_bytes_per_param: float = 2.0
    """Bytes per parameter all-gathered after a ZeRO-1 step (bf16 weights)."""
    distributed_optimizer: bool = True
    """ZeRO-1 over the HDP group (reduce-scatter + all-gather, optimizer on 1/N of the
    parameters), as the paper runs; False: all-reduce and a full optimizer step per rank."""
    optimizer_s_per_param: float = 0.0
    """Seconds per parameter of one optimizer update (see :data:`H100_OPTIMIZER_S_PER_PARAM`)."""
    load_s: float = 0.0
    """Seconds per step to read and prepare the next global batch, planning excluded."""
    expert_params_per_rank: float = 0.0
    """Of ``params_per_rank``, the expert weights (MoE with expert parallelism: the rank's
    num_experts / E experts, each split over P GPUs); they reduce, and ZeRO-1 shards them, over
    the expert-data-parallel group (:meth:`expert_data_parallel_size`)."""
    expert_parallel_size: int = 1
    """E: the experts are split over E expert-TP groups."""
    tensor_parallel_size: int = 1
    """TP: an HDP rank is TP GPUs (only the expert-data-parallel group's size depends on it)."""
    expert_tensor_parallel_size: int | None = None
    """P: each expert split over P GPUs (Megatron's ``--expert-tensor-parallel-size``); None:
    ``tensor_parallel_size``, Megatron's default."""
    plan_s: float | None = None
    """Seconds the cluster's planner takes per step (a modelled input); None: the ``plan_s``
    given to :func:`.step.simulate_step` (0 unless the caller models it)."""

    def __post_init__(self) -> None:
        for name in ("params_per_rank", "grad_bytes_per_param", "param_bytes_per_param",
                     "optimizer_s_per_param", "load_s"):
            _check_nonnegative(name, getattr(self, name))
        if self.plan_s is not None:
            _check_nonnegative("plan_s", self.plan_s)
        _check_nonnegative("expert_params_per_rank", self.expert_params_per_rank)
        if self.expert_params_per_rank > self.params_per_rank:
            raise ValueError(f"expert_params_per_rank ({self.expert_params_per_rank:g}) must be <= "
                             f"params_per_rank ({self.params_per_rank:g})")
        if isinstance(self.expert_parallel_size, bool) or not isinstance(self.expert_parallel_size, int) \
                or self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size ({self.expert_parallel_size!r}) must be an integer >= 1")
        for name in ("tensor_parallel_size", "expert_tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name == "expert_tensor_parallel_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")

    def expert_data_parallel_size(self, hdp_size: int) -> int:
        """Ranks the expert weights reduce over: ``N TP / (P E)`` (at least 1; module docstring)."""
        etp = self.expert_tensor_parallel_size or self.tensor_parallel_size
        return max(1, int(hdp_size) * self.tensor_parallel_size // (etp * self.expert_parallel_size))

    def _groups(self, hdp_size: int) -> list[tuple[float, int]]:
        """(parameters, ranks of the group they reduce over): dense over N, experts over the
        expert-data-parallel group (N / E with P = TP)."""
        n, edp = int(hdp_size), self.expert_data_parallel_size(hdp_size)
        if edp == n or self.expert_params_per_rank <= 0:
            return [(self.params_per_rank, n)]
        return [(self.params_per_rank - self.expert_params_per_rank, n),
                (self.expert_params_per_rank, edp)]

    def grad_reduce_s(self, hdp_size: int, cost_model: CostModel, *, one_node: bool | None = None) -> float:
        """Seconds of the gradient reduction over ``hdp_size`` ranks (0 for one rank).

        ``one_node``: whether the whole HDP group shares a node (default: ``hdp_size <=
        cost_model.ranks_per_node``), which picks the NVLink or the network rate.
        """
        if int(hdp_size) <= 1 or self.params_per_rank <= 0:
            return 0.0
        if one_node is None:
            one_node = int(hdp_size) <= cost_model.ranks_per_node
        bandwidth = cost_model.p2p_bandwidth_intra if one_node else cost_model.p2p_bandwidth_inter
        total = 0.0
        for params, n in self._groups(hdp_size):
            if n <= 1 or params <= 0:
                continue
            share = (n - 1) / n
            if self.distributed_optimizer:
                volume = share * params * (self.grad_bytes_per_param + self.param_bytes_per_param)
            else:
                volume = 2.0 * share * params * self.grad_bytes_per_param
            total += volume / bandwidth + 2 * (n - 1) * cost_model.p2p_latency_s
        return total

    def optimizer_s(self, hdp_size: int) -> float:
        """Seconds of one optimizer step on one rank."""
        if not self.distributed_optimizer:
            return self.params_per_rank * self.optimizer_s_per_param
        return sum(params / max(1, n) for params, n in self._groups(hdp_size)) * self.optimizer_s_per_param

    def data_wait_s(self, plan_s: float, busy_step_s: float, *, lookahead: bool) -> float:
        """Seconds the step waits for its data and plan: all of ``load_s + plan_s`` without
        lookahead, only what exceeds the step they hide behind (``busy_step_s``) with it."""
        wait = self.load_s + plan_s
        return max(0.0, wait - busy_step_s) if lookahead else wait


def _check_nonnegative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} ({value!r}) must be a finite number >= 0")


def parameter_count(model: Any) -> dict[str, float]:
    """Parameters of a :class:`~megatron_bytescale.planner.presets.ModelSpec`, before TP/PP splits.

    ``per_layer``: QKV and output projections, the SwiGLU MLP (every expert for MoE) plus the
    router, two RMSNorms; ``experts_per_layer``: the experts' share of it (0 for dense models);
    ``embedding`` and ``lm_head``: ``vocab x hidden`` each (untied, as LLaMA/Mistral);
    ``total``.
    """
    h = float(model.hidden_size)
    kv = float(model.kv_dim)
    attention = h * (h + 2.0 * kv) + h * h
    mlp = model.num_experts * 3.0 * h * model.ffn_hidden_size
    router = h * model.num_experts if model.num_experts > 1 else 0.0
    per_layer = attention + mlp + router + 2.0 * h
    embedding = float(model.vocab_size) * h
    return {
        "per_layer": per_layer,
        "experts_per_layer": mlp if model.num_experts > 1 else 0.0,
        "embedding": embedding,
        "lm_head": embedding,
        "total": per_layer * model.num_layers + 2.0 * embedding,
    }


def params_per_rank(model: Any, *, tensor_parallel_size: int, pp_size: int) -> float:
    """Parameters on one GPU of the largest PP stage (its layers plus the embedding or the LM
    head; both when PP = 1), split over TP; with expert parallelism E the rank holds 1 / E of
    the experts, each split over the expert-TP size P (TP by default) instead of TP."""
    counts = parameter_count(model)
    layers = model.num_layers / pp_size
    ends = 2.0 if pp_size == 1 else 1.0
    tp_over_etp = tensor_parallel_size / _expert_tp(model, tensor_parallel_size)  # 1.0 when P = TP
    per_layer = counts["per_layer"] - counts["experts_per_layer"] + expert_params_per_layer(model) * tp_over_etp
    return (per_layer * layers + ends * counts["embedding"]) / tensor_parallel_size


def _expert_tp(model: Any, tensor_parallel_size: int) -> int:
    """P of ``model`` run at ``tensor_parallel_size``: its ``expert_tensor_parallel_size``, else TP."""
    return getattr(model, "expert_tensor_parallel_size", None) or tensor_parallel_size


def expert_params_per_layer(model: Any) -> float:
    """Expert parameters of one layer on one rank before the expert-TP split: 1 / E of the experts."""
    return parameter_count(model)["experts_per_layer"] / getattr(model, "expert_parallel_size", 1)


def preset_overheads(model: Any, *, tensor_parallel_size: int, pp_size: int, **changes: Any) -> StepOverheads:
    """:class:`StepOverheads` of a preset model on H100-class GPUs (ZeRO-1, fp32 reduction)."""
    ep = getattr(model, "expert_parallel_size", 1)
    etp = _expert_tp(model, tensor_parallel_size)
    values: dict[str, Any] = dict(
        params_per_rank=params_per_rank(model, tensor_parallel_size=tensor_parallel_size, pp_size=pp_size),
        expert_params_per_rank=(expert_params_per_layer(model) * model.num_layers / pp_size / etp
                                if ep > 1 or etp != tensor_parallel_size else 0.0),
        expert_parallel_size=ep,
        tensor_parallel_size=tensor_parallel_size,
        expert_tensor_parallel_size=None if etp == tensor_parallel_size else etp,
        optimizer_s_per_param=H100_OPTIMIZER_S_PER_PARAM,
    )
    values.update(changes)
    return StepOverheads(**values)
