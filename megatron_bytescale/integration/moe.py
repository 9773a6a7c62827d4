"""Mixture-of-experts layers under HDP: which MoE settings train, and the router losses.

The MoE layer itself is megatron-core's (router, token dispatcher, experts; built by
:mod:`.layer_spec`): routing is per token, so without token dropping a token's expert output
does not depend on which other tokens share its micro-batch, and an HDP micro-batch (a pack of
short documents, or one member's zigzag share of a ring) routes every token exactly as a
micro-batch holding its document alone would. With expert parallelism 1 the dispatcher never
leaves the rank, so ranks may run different numbers of micro-batches.

The router's *auxiliary* losses are not per token, and megatron-core computes them over the
micro-batch it is given. Under HDP that would make them depend on the plan (which documents
were packed together, how a long one was split over a ring). :func:`install_hdp_router_losses`
gives them one placement-independent meaning instead (docs/moe.md):

* **load-balancing loss** (``moe_router_load_balancing_type="aux_loss"``): megatron-core's
  switch loss of every *document* on its own, weighted by the document's tokens, exactly what
  megatron-core computes for a micro-batch holding that one document with
  ``calculate_per_token_loss=True``. A ring member routes only its share of a long document; the
  per-expert token counts of that document are summed over the ring's members (one small
  exchange per MoE layer on the ring), as megatron-core sums them over its static CP group;
* **z-loss**: per real token (padding rows of a ring slot are left out);
* both are added to the micro-batch's loss *sum* and, like the language-model loss, divided by
  the global batch's loss-token count by ``finalize_model_grads``.

The router's own aux-loss and z-loss paths are switched off on that router (its
``routing_type`` and a private copy of its config) so nothing is counted twice; everything
else (scores, top-k, the dispatcher, the experts) stays megatron-core's.

Refused (each message names its flag): token dropping (``--moe-expert-capacity-factor``: which
tokens an expert drops depends on the micro-batch), the sequence-level and global-batch
aux-loss types and Sinkhorn routing (their groups assume Megatron's static DP x CP
micro-batches), expert bias and input jitter (they count or perturb padding rows), expert
parallelism whose expert groups do not tile the HDP ranks or that runs with virtual pipeline
stages (``HDPParallelLayout``), the all-gather dispatcher with expert parallelism, and expert
tensor- x expert-parallel sizes that do not divide, or are not divided by, the TP size (an
expert group would then hold part of an HDP rank's TP group; ``expert_layout``).

With sequence parallelism (which megatron-core requires for MoE with TP) a TP rank routes only
its share of a micro-batch's rows; the per-expert counts of a document are then summed over
the TP ranks too, so the load-balancing loss still sees whole documents.
"""

from __future__ import annotations

import copy
import logging
from functools import partial
from typing import Any, Optional

import torch

from .expert_layout import expert_lockstep_refusal

logger = logging.getLogger(__name__)

_TAG_EXPERT_COUNTS = 5  # ring traffic uses tags 1-4 (ring_attention, two_level_ring)
SUPPORTED_LOAD_BALANCING = ("aux_loss", "none")


def _single(value: Any) -> Any:
    """Megatron-LM parses some MoE flags with ``nargs='+'``; one value means that value."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def moe_refusals(settings: Any, *, layout_checked: bool = False) -> list[str]:
    """Every reason the MoE settings cannot train under HDP (empty: they can, or no MoE).

    ``settings`` is a ``TransformerConfig`` (``num_moe_experts``) or Megatron-LM's ``args``
    (``num_experts``). Whether the expert sizes make a lockstep block HDP can serve
    (:func:`.expert_layout.expert_lockstep_refusal`) is asked here for the model builder;
    ``layout_checked``: the caller also checks ``HDPParallelLayout`` (the Megatron-LM hooks),
    which asks it with the HDP size, so it is left to that check (one refusal, computed once).
    """
    experts = getattr(settings, "num_moe_experts", None) or getattr(settings, "num_experts", None)
    if not experts:
        return []
    reasons = []
    balancing = _single(getattr(settings, "moe_router_load_balancing_type", "aux_loss"))
    if not isinstance(balancing, str) or balancing not in SUPPORTED_LOAD_BALANCING:
        shown = " ".join(balancing) if isinstance(balancing, (list, tuple)) else balancing
        reasons.append(
            f"--moe-router-load-balancing-type {shown} cannot be combined with --bytescale-hdp: "
            "use aux_loss (computed per document, the same wherever the plan puts it) or none"
        )
    capacity = getattr(settings, "moe_expert_capacity_factor", None)
    if capacity is not None and capacity >= 0:  # megatron-core reads a negative one as unset
        reasons.append(
            f"--moe-expert-capacity-factor {capacity} cannot be combined with --bytescale-hdp: "
            "which tokens an expert drops would depend on the documents the plan packs "
            "together; leave it unset (no token dropping)"
        )
    if getattr(settings, "moe_router_enable_expert_bias", False):
        reasons.append("--moe-router-enable-expert-bias cannot be combined with --bytescale-hdp: "
                       "its token counts would include padding rows; leave it off")
    if getattr(settings, "moe_input_jitter_eps", None):
        reasons.append(f"--moe-input-jitter-eps {settings.moe_input_jitter_eps} cannot be "
                       "combined with --bytescale-hdp; leave it unset")
    if getattr(settings, "add_bias_linear", False) and not getattr(settings, "moe_grouped_gemm",
                                                                   False):
        reasons.append(
            "biased linear layers (the default; --disable-bias-linear turns them off) cannot "
            "run MoE experts one by one (SequentialMLP, no --moe-grouped-gemm): megatron-core "
            "adds an expert's bias in place on a tensor autograd forbids changing; pass "
            "--disable-bias-linear (Mixtral has no biases)"
        )
    tp = getattr(settings, "tensor_model_parallel_size", 1) or 1
    etp = getattr(settings, "expert_tensor_parallel_size", None) or tp  # Megatron: unset = TP
    ep = getattr(settings, "expert_model_parallel_size", 1) or 1
    lockstep = None if layout_checked else expert_lockstep_refusal(tp, etp, ep)
    if lockstep:
        reasons.append(lockstep)
    dispatcher = getattr(settings, "moe_token_dispatcher_type", "alltoall")
    if ep > 1 and dispatcher != "alltoall":
        reasons.append(
            f"--moe-token-dispatcher-type {dispatcher} with --expert-model-parallel-size {ep} "
            "cannot be combined with --bytescale-hdp: megatron-core's all-gather dispatcher "
            "gathers equal row counts from every rank of the expert group, and HDP micro-batches "
            "differ in length; use --moe-token-dispatcher-type alltoall"
        )
    return reasons


def check_moe_config(config: Any) -> None:
    """Raise ValueError (one line per reason) if HDP cannot train these MoE settings."""
    reasons = moe_refusals(config)
    if reasons:
        raise ValueError("; ".join(reasons))


def install_hdp_router_losses(model: torch.nn.Module) -> int:
    """Give every top-k router of ``model`` the HDP aux-loss and z-loss; returns how many.

    Called once when the model is built (``ByteScaleGPTModel`` does it). Routers without an
    aux loss or z-loss get no hook.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    count = 0
    for module in model.modules():
        if not isinstance(module, TopKRouter):
            continue
        check_moe_config(module.config)
        aux_coeff = float(module.get_aux_loss_coeff("aux_loss"))
        z_coeff = module.config.moe_z_loss_coeff
        if not aux_coeff and not z_coeff:
            continue
        module.routing_type = "none"  # megatron-core's own aux loss: off on this router
        own = copy.copy(module.config)  # z-loss: off in a private copy, read by this router only
        own.moe_z_loss_coeff = None
        module.config = own
        module.register_forward_hook(
            partial(_router_losses_hook, aux_coeff=aux_coeff, z_coeff=float(z_coeff or 0.0))
        )
        # every router logs its losses each step, also on a rank that ran no micro-batch:
        # megatron-core's log reduction is a collective over the ranks that hold the layer
        setattr(module, _LOG_ATTRIBUTE, {name: None for name, coeff in
                                         (("load_balancing_loss", aux_coeff), ("z_loss", z_coeff))
                                         if coeff})
        count += 1
    logger.debug("HDP router losses (per-document aux loss, per-token z-loss) on %d routers",
                 count)
    return count


def _router_losses_hook(router: torch.nn.Module, args: tuple, output: Any, *,
                        aux_coeff: float, z_coeff: float) -> Any:
    if not (router.training and torch.is_grad_enabled()):
        return output
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from .groups import installed_hdp_manager

    manager = installed_hdp_manager()
    bound = manager.bound if manager is not None else None
    if bound is None:
        raise RuntimeError(
            "the HDP router losses need the micro-batch bound to the HDP group manager; train "
            "through run_hdp_step / the patched Megatron-LM loop"
        )
    probs, routing_map = output
    logits = router.gating(args[0]).view(-1, router.config.num_moe_experts)
    row_offset, tp_group = 0, None
    if getattr(router.config, "sequence_parallel", False) and manager.tp_size > 1:
        # sequence parallelism: this TP rank routes only its contiguous share of the row
        from megatron.core import parallel_state

        row_offset = parallel_state.get_tensor_model_parallel_rank() * logits.size(0)
        tp_group = parallel_state.get_tensor_model_parallel_group()
    aux, z = router_loss_parts(logits, bound.layout, topk=router.topk,
                               score_function=router.score_function, aux_coeff=aux_coeff,
                               z_coeff=z_coeff, hdp=manager.hdp, row_offset=row_offset,
                               tp_group=tp_group)
    _remember_for_log(router, aux_coeff=aux_coeff, z_coeff=z_coeff, aux=aux, z=z)
    return MoEAuxLossAutoScaler.apply(probs, aux + z), routing_map


_LOG_ATTRIBUTE = "_bytescale_router_loss_log"


def _remember_for_log(router: torch.nn.Module, *, aux_coeff: float, z_coeff: float,
                      aux: torch.Tensor, z: torch.Tensor) -> None:
    """Add this micro-batch's router-loss sums (without their coefficients) to the router's
    running totals, which :func:`record_router_loss_logs` hands to Megatron's log tracker."""
    log = getattr(router, _LOG_ATTRIBUTE)
    for name, coeff, value in (("load_balancing_loss", aux_coeff, aux), ("z_loss", z_coeff, z)):
        if coeff:
            part = value.detach() / coeff
            log[name] = part if log.get(name) is None else log[name] + part


def record_router_loss_logs(model_chunks: Any, *, scale: float) -> int:
    """Hand the step's HDP router losses to megatron-core's MoE log tracker; returns how many
    (router, loss) values were recorded.

    Megatron-LM logs ``load_balancing_loss`` and ``z_loss`` from that tracker. Under HDP the
    routers' own loss paths are off (:func:`install_hdp_router_losses`), so without this the
    log reads 0. Each value recorded is this rank's share of ``sum over documents of tokens x
    aux(document) / coeff`` (z-loss: ``sum over tokens of logsumexp^2``) times ``scale``, with
    the group that completes the sum: the HDP ranks of this stage (ring members hold shares of a
    document), and their TP ranks too with sequence parallelism (each holds its rows' share).
    Megatron sums the values over that group and the pipeline stages, multiplies by
    ``1 / num_microbatches`` and averages over the MoE layers, so with ``scale =
    num_microbatches / tokens of the global batch`` the log shows the token-weighted mean over
    the global batch's documents of what megatron-core logs for one document alone.
    Every router with an HDP loss records each step, zero where no micro-batch reached it (a
    rank may run none), since megatron-core's reduction is a collective. The totals are reset.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    recorded = 0
    for chunk in chunks:
        for module in chunk.modules():
            log = getattr(module, _LOG_ATTRIBUTE, None) if isinstance(module, TopKRouter) else None
            if not log:
                continue
            config = module.config
            with_tp = getattr(config, "sequence_parallel", False) and \
                parallel_state.get_tensor_model_parallel_world_size() > 1
            group = (parallel_state.get_tensor_and_data_parallel_group() if with_tp
                     else parallel_state.get_data_parallel_group())
            num_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
            for name, value in log.items():
                if value is None:  # no micro-batch reached this router: it still takes part
                    value = torch.zeros((), device=module.weight.device)
                save_to_aux_losses_tracker(name, value * scale, module.layer_number, num_layers,
                                           reduce_group=group, reduce_group_has_dp=True)
                recorded += 1
                log[name] = None
    return recorded


def router_losses(logits: torch.Tensor, layout: Any, *, topk: int, score_function: str,
                  aux_coeff: float, z_coeff: float, hdp: Optional[Any] = None,
                  row_offset: int = 0, tp_group: Optional[Any] = None) -> torch.Tensor:
    """This micro-batch's share of the HDP router losses, as a *sum*: the load-balancing and
    z-loss parts of :func:`router_loss_parts` added."""
    aux, z = router_loss_parts(logits, layout, topk=topk, score_function=score_function,
                               aux_coeff=aux_coeff, z_coeff=z_coeff, hdp=hdp,
                               row_offset=row_offset, tp_group=tp_group)
    return aux + z


def router_loss_parts(logits: torch.Tensor, layout: Any, *, topk: int, score_function: str,
                      aux_coeff: float, z_coeff: float, hdp: Optional[Any] = None,
                      row_offset: int = 0, tp_group: Optional[Any] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """This micro-batch's share of the HDP router losses, as *sums* (never averaged here):
    ``(load-balancing part, z-loss part)``, each with its coefficient.

    ``logits`` are the router's ``[rows, experts]`` logits of the micro-batch in ``layout``'s
    buffer order. Load balancing: for every slot (document), megatron-core's switch loss over
    the document's tokens held here, with the per-expert counts of the *whole* document (summed
    over the ring when it is shared) and its full length, times that length. Summed over the
    ring members this is ``length x aux(document)``, what megatron-core adds for a micro-batch
    holding the document alone. z-loss: ``z_coeff x sum of logsumexp(logits)^2`` over real rows.

    With sequence parallelism a TP rank holds rows ``row_offset ..`` of the micro-batch only:
    it adds the losses of those rows, and the per-expert counts are summed over ``tp_group``
    (the TP ranks' shares of the row) as well as over the ring, so every rank uses the whole
    document's counts; summed over the TP ranks (Megatron all-reduces the router's gradient
    over them) this is the loss of the whole row.
    """
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
        z_loss_func,
    )

    experts = logits.size(-1)
    z_total = logits.new_zeros((), dtype=torch.float32)
    aux_total = logits.new_zeros((), dtype=torch.float32)
    held = logits.size(0)
    real = []  # each slot's real rows held here, as indices into ``logits``
    for s in layout.slots:
        start = min(max(s.offset, row_offset), row_offset + held)
        end = max(min(s.offset + s.num_real, row_offset + held), start)
        real.append(torch.arange(start - row_offset, end - row_offset, device=logits.device))
    if z_coeff and layout.slots:
        rows = torch.cat(real)
        if rows.numel():
            z_total = z_total + z_loss_func(logits[rows], z_coeff) * rows.numel()
    if aux_coeff and layout.slots:
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, topk, score_function)
        counts = torch.stack([routing_map[r].sum(dim=0) for r in real]).to(torch.float32)
        if tp_group is not None:
            counts = tp_sum(counts, tp_group)
        if len(layout.ring.members) > 1:
            counts = ring_sum(counts, layout.ring, hdp)
        for index, (slot, r) in enumerate(zip(layout.slots, real)):
            if not r.numel():
                continue
            aux = switch_load_balancing_loss_func(
                probs=scores[r], tokens_per_expert=counts[index], total_num_tokens=slot.length,
                topk=topk, num_experts=experts, moe_aux_loss_coeff=aux_coeff)
            aux_total = aux_total + aux * slot.length
    return aux_total, z_total


def tp_sum(tensor: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """``tensor`` summed over the TP ranks of ``tp_group`` (integer-valued counts: exact, so
    every TP rank holds identical numbers)."""
    import torch.distributed as dist

    total = tensor.clone()
    dist.all_reduce(total, group=tp_group)
    return total


def ring_sum(tensor: torch.Tensor, ring: Any, hdp: Any) -> torch.Tensor:
    """``tensor`` summed over the members of ``ring`` (every member gets the same sum).

    ``size - 1`` shifts around the ring on the HDP ring group; the partial sums are added in
    ring order starting from each member's own value, so with integer-valued counts (exact in
    fp32) every member holds identical numbers.
    """
    from megatron_bytescale.runtime.ring_comm import RingComm

    if hdp is None:
        raise RuntimeError("summing over a ring needs the HDP group")
    comm = RingComm(hdp, ring, tag=_TAG_EXPERT_COUNTS)
    total = tensor.clone()
    moving = tensor.contiguous()
    for _ in range(len(ring.members) - 1):
        received = comm.send_recv(moving)
        comm.commit()
        comm.wait()
        total = total + received
        moving = received
    return total
