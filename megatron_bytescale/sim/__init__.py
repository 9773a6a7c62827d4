"""``bytescale simulate``: cluster-scale what-if from real plans (imports the planner and numpy only).

It plans a global batch with the planner's real schedulers and times the step with the
planner's own model of time (:mod:`megatron_bytescale.planner.estimate` and the cost model),
adding what a training step does after its micro-batches: the gradient reduction, the
optimizer, and the wait for data and plan. Entry points:

* :func:`simulate_step`: one plan -> :class:`StepResult` (step time and where it goes);
* :func:`simulate_variants`: one batch, several systems side by side (:data:`VARIANTS`);
* :func:`run_sweep` / :func:`summarize`: context lengths x steps x variants.
"""

from .overheads import StepOverheads, params_per_rank, parameter_count, preset_overheads
from .step import BREAKDOWN_TERMS, StepResult, simulate_step
from .sweep import Summary, SweepPoint, drop_per_doubling, format_tokens, parse_tokens, run_sweep, summarize
from .variants import ABLATION, VARIANTS, ClusterSetup, Variant, VariantOutcome, parse_variants, simulate_variants

__all__ = [
    "ABLATION",
    "BREAKDOWN_TERMS",
    "ClusterSetup",
    "StepOverheads",
    "StepResult",
    "Summary",
    "SweepPoint",
    "VARIANTS",
    "Variant",
    "VariantOutcome",
    "drop_per_doubling",
    "format_tokens",
    "parameter_count",
    "params_per_rank",
    "parse_tokens",
    "parse_variants",
    "preset_overheads",
    "run_sweep",
    "simulate_step",
    "simulate_variants",
    "summarize",
]
