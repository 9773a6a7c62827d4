"""Which HDP ranks a MoE layer's expert group ties together: the planner's pure arithmetic
(:mod:`megatron_bytescale.planner.expert_layout`), imported here for the integration modules
that check Megatron's groups against it (the planner imports no torch or megatron, so the
functions live there and this module only re-exports them)."""

from __future__ import annotations

from megatron_bytescale.planner.expert_layout import expert_lockstep_refusal, expert_lockstep_size

__all__ = ["expert_lockstep_refusal", "expert_lockstep_size"]
