"""megatron_bytescale: ByteScale's Hybrid Data Parallelism (HDP) as a Megatron-LM plugin.

Layers (DESIGN.md §2), dependencies pointing down only:
    planner      numpy only: cost model, Eq. 3, sharding, schedulers, the StepPlan contract
    runtime      torch + planner: HDP group, batched ring P2P, dynamic-ring attention
    data         planner + runtime: length readers, global-batch sampling, plan prefetch
    integration  the only layer that imports megatron.core
Nothing runs on import.
"""

__version__ = "0.1.0"
