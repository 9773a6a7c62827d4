"""Overlapped gradient reduction and parameter gathering when ranks run different micro-batches.

Megatron's DDP with ``overlap_grad_reduce`` starts a bucket group's reduce-scatter/all-reduce
from the backward hooks of the last micro-batch, as soon as all its gradients are ready, and
``finish_grad_sync`` then waits for every group. That assumes every data-parallel rank runs the
same micro-batches. Under HDP a rank may run none (its hooks never fire, and Megatron asserts
"Communication call has not been issued for this bucket") or learn its "all gradients ready"
counts in a different step than the others, and collectives on one communicator must be issued
in the same order on every rank or they mismatch (NCCL hangs, gloo mixes buckets).

:func:`install_ordered_grad_sync` makes the order fixed: bucket group ``i`` is issued only after
groups ``0 .. i-1`` (Megatron's own bucket order, which backward readiness follows), so a group
that becomes ready early waits for its predecessors, and ``finish_grad_sync`` first issues, in
order, every group that backward did not (all of them on a rank without micro-batches). Every
rank thus issues the same collectives in the same order; overlap with backward is kept wherever
readiness follows the bucket order, which it does for a GPT.

With ``overlap_param_gather`` (distributed optimizer) the updated parameters are all-gathered by
forward pre-hooks of the next step, bucket group by bucket group. A rank without micro-batches
runs no forward, so :func:`gather_params_without_forward` issues and completes those gathers in
the order the pre-hooks would (the last group first, as Megatron chains them).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_bytescale_ordered_grad_sync"


class OrderedGradSync:
    """Issues a DDP model's bucket-group reductions in one fixed order (see the module docstring).

    Installed on a Megatron ``DistributedDataParallel`` instance: it replaces the bound
    ``start_grad_sync`` of each bucket group and wraps the model's ``finish_grad_sync`` and
    ``zero_grad_buffer``. Idempotent per model (:func:`install_ordered_grad_sync`).
    """

    def __init__(self, ddp_model: Any) -> None:
        self.groups = list(ddp_model.bucket_groups) + list(ddp_model.expert_parallel_bucket_groups)
        self._start = [group.start_grad_sync for group in self.groups]
        self._ready = [False] * len(self.groups)
        self._force = [False] * len(self.groups)
        self._next = 0
        for index, group in enumerate(self.groups):
            group.start_grad_sync = functools.partial(self.request, index)
        finish, zero = ddp_model.finish_grad_sync, ddp_model.zero_grad_buffer

        @functools.wraps(finish)
        def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
            self.flush(force_all_reduce=bool(kwargs.get("force_all_reduce", False)))
            return finish(*args, **kwargs)

        @functools.wraps(zero)
        def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:
            result = zero(*args, **kwargs)
            self.reset()
            return result

        ddp_model.finish_grad_sync = finish_grad_sync
        ddp_model.zero_grad_buffer = zero_grad_buffer

    @property
    def issued(self) -> int:
        """How many bucket groups have been issued this step."""
        return self._next

    def request(self, index: int, force_all_reduce: bool = False) -> None:
        """Bucket group ``index`` is ready: issue it and every ready successor, in order."""
        if index < self._next:
            return  # already issued this step (Megatron asks again in its first step)
        self._ready[index] = True
        self._force[index] = self._force[index] or bool(force_all_reduce)
        while self._next < len(self.groups) and self._ready[self._next]:
            self._start[self._next](force_all_reduce=self._force[self._next])
            self._next += 1

    def flush(self, force_all_reduce: bool = False) -> None:
        """Issue, in order, every bucket group backward did not (all on an idle rank)."""
        for index in range(self._next, len(self.groups)):
            self.request(index, force_all_reduce)

    def reset(self) -> None:
        """A new step: nothing issued yet."""
        self._ready = [False] * len(self.groups)
        self._force = [False] * len(self.groups)
        self._next = 0


def install_ordered_grad_sync(ddp_model: Any) -> OrderedGradSync | None:
    """Make ``ddp_model``'s overlapped reduction safe for HDP; None without overlap.

    Call once after building Megatron's ``DistributedDataParallel`` (``wrap_for_hdp`` and the
    HDP schedule do); later calls return the installed instance.
    """
    ddp_config = getattr(ddp_model, "ddp_config", None)
    if ddp_config is None or not ddp_config.overlap_grad_reduce:
        return None
    installed = getattr(ddp_model, _ATTRIBUTE, None)
    if installed is None:
        installed = OrderedGradSync(ddp_model)
        setattr(ddp_model, _ATTRIBUTE, installed)
        logger.info(
            "overlapped gradient reduction: %d bucket groups issued in a fixed order on every "
            "HDP rank", len(installed.groups),
        )  # fmt: skip
    return installed


def gather_params_without_forward(ddp_model: Any) -> None:
    """Issue and complete this step's parameter all-gathers on a rank that runs no forward.

    Needed with ``overlap_param_gather``: the other ranks gather from their forward pre-hooks,
    last bucket group first; an idle rank must take part in the same collectives in the same
    order. A no-op without ``overlap_param_gather``.
    """
    if not getattr(ddp_model, "use_forward_hook", False):
        return
    for groups in (ddp_model.bucket_groups, ddp_model.expert_parallel_bucket_groups):
        for group in reversed(list(groups)):
            group.finish_param_sync()
