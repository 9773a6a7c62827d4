"""The paper's evaluation setups and reported numbers (ByteScale §8, paper.md §7), as data.

Everything here is quoted from the paper (``[P]`` in ``reference/paper.md``, ``[F]`` for figure
readings) except where a comment says it is our reading. The paper hides its hardware; the
setups use the hardware preset fitted to the paper's own measurements
(:data:`megatron_bytescale.planner.presets.PAPER_FIT`, ``scripts/fit_network.py``; the
H100 datasheet preset with ``hardware="h100"``) and the preset TP/PP of every model
(:mod:`megatron_bytescale.planner.presets`), which the reproduction states.
"""

from __future__ import annotations

from typing import Any

from ..planner.presets import model_spec, preset_cost_model
from .overheads import preset_overheads
from .variants import ClusterSetup

K, M = 2**10, 2**20

#: Fig. 17 panels: model preset -> GPUs. ">12,000" for 8x22B: we take 12,288 (192 HDP ranks
#: at TP 8 x PP 8), which is also why its panels stop at 1M (2M needs 256 ranks of 8K).
FIG17_GPUS: dict[str, int] = {
    "llama-7b": 1024, "llama-13b": 2048, "llama-30b": 4096,
    "llama-70b": 8192, "mistral-8x7b": 8192, "mistral-8x22b": 12288,
}
FIG17_CONTEXTS: tuple[int, ...] = (256 * K, 512 * K, 1 * M, 2 * M)
FIG17_MAX_CONTEXT: dict[str, int] = {"mistral-8x22b": 1 * M}
#: §8.2: DP-Balance for the models trained with HDP + TP, PP-Balance with HDP + TP + PP.
DP_BALANCE_MODELS = ("llama-7b", "llama-13b", "llama-30b")
PP_BALANCE_MODELS = ("llama-70b", "mistral-8x7b", "mistral-8x22b")
#: §8.2: HDP balance over the baseline at 2M on GitHub, per group of models.
GITHUB_2M_SPEEDUP = {"DP-Balance": (6.21, 7.89), "PP-Balance": (3.42, 4.28)}
#: §8.2: the largest speedup on Byted (any model, any context) and overall.
BYTED_MAX_SPEEDUP = 4.26
MAX_SPEEDUP = 7.89
#: §8.2: average throughput drop per doubling of the context.
DROP_PER_DOUBLING = {"static": 2.0, "naive": 1.23, "balance": 1.08}
GLOBAL_TOKENS = 32 * M
CAPACITY = 8 * K
"""C = 8K tokens per rank: the case study puts a 312K sequence on 39 ranks (312K / 8K)."""

#: §8.3 case study: LLaMA-7B, 2M context, 1,024 GPUs, Byted (Fig. 18).
CASE_STUDY: dict[str, Any] = {
    "model": "llama-7b", "gpus": 1024, "context": 2 * M, "dataset": "byted",
    "static_step_s": 8 * 60 + 40, "naive_step_s": 4 * 60 + 32, "balance_step_s": 2 * 60 + 37,
    "speedup": 3.3, "naive_fastest_rank_s": 60 + 41, "naive_rank_min_s": 60, "naive_rank_max_s": 279,
    "naive_rank_std_s": 68, "static_comm_fraction": 0.976, "static_micro_batches_per_rank": 8,
    "naive_over_balance": 2.3,
}
#: Fig. 18 [F] per ring step: the baseline's CP-256 rings (8K tokens per rank: a 32 MiB K/V
#: block of LLaMA-7B at TP 1) compute 304-307 us and exchange 406-423 us; naive's 312K sequence
#: on 39 ranks computes 2.8-4.4 ms and exchanges 1.4-1.9 ms per step.
FIG18: dict[str, tuple[float, float]] = {
    "static_p2p_step_s": (406e-6, 423e-6), "static_compute_step_s": (304e-6, 307e-6),
    "naive_compute_step_s": (2.8e-3, 4.4e-3), "naive_p2p_step_s": (1.4e-3, 1.9e-3),
}
FIG18_NAIVE_SEQUENCE = 312 * K
"""The naive example sequence of Fig. 18, on 312K / 8K = 39 ranks."""
#: The hardware preset of every simulated figure (fitted to the numbers above).
PAPER_HARDWARE = "paper-fit"
#: §8.5 ablation (Fig. 20), cumulative speedup over MegaScale in the case-study setup.
ABLATION_SPEEDUP: dict[str, float] = {
    "static": 1.00, "naive": 1.59, "naive+offload": 2.01, "balance": 3.69, "balance+lookahead": 3.89,
}


def paper_setup(model: str, gpus: int | None = None, *, hardware: str = PAPER_HARDWARE,
                expert_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                **cost_model_changes: Any) -> ClusterSetup:
    """The cluster of a Fig. 17 panel: ``gpus`` (default the paper's) split into HDP ranks of
    the preset's TP x PP, C = 8K, the ``hardware`` preset (default the one fitted to the paper)
    with ``cost_model_changes`` applied (e.g. ``p2p_bandwidth_inter``), ZeRO-1 gradient
    reduction and Adam. No planning time is modelled (``StepOverheads.plan_s`` 0).
    ``expert_parallel_size`` > 1 (MoE presets): the all-to-all dispatch in the cost model and
    the expert weights reduced over the expert-data-parallel groups; the paper's MoE runs are
    "HDP + TP + PP", so its figures use 1. ``expert_tensor_parallel_size`` (None: the preset's
    TP) splits each expert over that many GPUs (:mod:`..planner.moe_cost`); plans for the setup
    keep ``spec.expert_lockstep_size`` HDP ranks in step (E with ETP = TP)."""
    spec = model_spec(model, expert_parallel_size=expert_parallel_size,
                      expert_tensor_parallel_size=expert_tensor_parallel_size)
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    gpus = FIG17_GPUS[model] if gpus is None else gpus
    if gpus % (tp * pp):
        raise ValueError(f"{gpus} GPUs do not split into TP {tp} x PP {pp} replicas of {model}")
    cm = preset_cost_model(model, hardware, expert_parallel_size=expert_parallel_size,
                           expert_tensor_parallel_size=expert_tensor_parallel_size)
    if cost_model_changes:
        cm = cm.with_(**cost_model_changes)
    return ClusterSetup(
        hdp_size=gpus // (tp * pp), capacity=CAPACITY, cost_model=cm, pp_size=pp,
        tensor_parallel_size=tp, overheads=preset_overheads(spec, tensor_parallel_size=tp, pp_size=pp),
    )
