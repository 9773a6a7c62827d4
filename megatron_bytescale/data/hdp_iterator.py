"""The HDP data iterator: global batches in, this rank's planned micro-batches out.

ByteScale plans a whole global batch at once (every rank must know every ring), so the unit
this iterator hands to the schedule is a *step*, not a micro-batch: :class:`HDPStep` holds
the step's plan, this rank's micro-batch count (which differs between ranks under the
balance scheduler), the number of loss tokens of the whole global batch (the token-level loss
denominator, DESIGN.md D6) and a lazily built stream of this rank's ``MicroBatchTensors`` in
plan order.

Planning (D7) happens in one of two modes:

* ``every_rank``: each rank plans the same lengths with the same deterministic planner; no
  communication is needed to agree.
* ``rank0_broadcast``: rank 0 of the plan group plans and broadcasts the plan's JSON; useful
  when planning is expensive or could differ between ranks (library versions, a timing-based
  cost model).

In both modes every rank then all-gathers the plan's 32-byte content hash and stops with an
error naming the disagreeing ranks if the hashes differ, before any rank trains on the plan.
The *plan group* is every process by default: with tensor or pipeline parallelism there is
one HDP group per (TP rank, stage), and all TP ranks and stages of a model replica must run the
same row of the same plan (DESIGN.md D11), so agreement is checked across the whole world.
A rank whose planner raised takes part in that exchange with an empty hash, so the other ranks
stop too (naming it) instead of waiting for it in a later collective; under
``rank0_broadcast`` rank 0 broadcasts its planning error instead of a plan.

Errors never lose a batch: when planning a global batch fails, ``next()`` raises, and the next
call plans *the same* batch again (it raises again if the planner still fails), so no batch is
ever skipped silently. A data source that raised cannot be resumed: every later call raises its
error again. Background planning runs on a daemon thread, and the training thread waits at most
``plan_timeout_s`` for a plan, so a planner or source that never returns stops the job with a
``TimeoutError`` instead of hanging it (and cannot keep the interpreter from exiting).

Planning off the critical path (the paper's prefetching loader, §7): in ``every_rank`` mode the
iterator reads and plans the next ``prefetch`` global batches on a background thread while
the current step trains, from length metadata only; the step then only waits for a plan that
is not ready yet (``HDPStep.plan_wait_s``). ``rank0_broadcast`` plans in the main thread,
because its broadcast is a collective that must not interleave with the training's own.

Sources: anything iterable that yields :class:`GlobalBatch` objects or plain lists of token
sequences (sequence id = index). Token access goes through ``GlobalBatch.tokens_by_seq``, a
mapping, so a source backed by a Megatron indexed dataset can hand in a lazy mapping that
reads only the sequences this rank's pieces touch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist

from megatron_bytescale.planner.order import check_deadlock_free
from megatron_bytescale.planner.plan import MicroBatch, StepPlan

from .plan_worker import PlanWorker

if TYPE_CHECKING:
    from megatron_bytescale.runtime import HDPGroup, MicroBatchTensors

logger = logging.getLogger(__name__)

PlanMode = Literal["every_rank", "rank0_broadcast"]
Planner = Callable[[list[int]], StepPlan]
TokenSequence = Union[Sequence[int], torch.Tensor, Any]  # list, tensor or numpy array


DEFAULT_PLAN_TIMEOUT_S = 600.0
_FAILED_HASH = "00" * 32
"""What a rank whose planner raised contributes to the plan-hash exchange."""


class PlanMismatchError(RuntimeError):
    """HDP ranks computed different plans for the same step."""


class PlanningError(RuntimeError):
    """Another HDP rank (rank 0 under ``rank0_broadcast``) could not plan this step."""


@dataclass(frozen=True, kw_only=True)
class GlobalBatch:
    """One global batch: sequence ``i`` has ``lengths[i]`` tokens, ``tokens_by_seq[i]``."""

    lengths: tuple[int, ...]
    tokens_by_seq: Mapping[int, TokenSequence] | Sequence[TokenSequence]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_sequences(cls, sequences: Sequence[TokenSequence], **meta: Any) -> "GlobalBatch":
        """A global batch of in-memory token sequences."""
        seqs = list(sequences)
        return cls(lengths=tuple(len(s) for s in seqs), tokens_by_seq=seqs, meta=meta)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True, kw_only=True)
class HDPStep:
    """One planned training step as this HDP rank sees it."""

    index: int
    plan: StepPlan
    plan_hash: str
    hdp_rank: int
    global_batch: GlobalBatch
    global_loss_tokens: int
    _build: Callable[[int], "MicroBatchTensors"] = field(repr=False)
    plan_s: float = 0.0
    """Seconds spent reading the global batch and planning it (on whichever thread did it)."""
    plan_wait_s: float = 0.0
    """Seconds the training thread waited for this step's plan (0 when prefetch hid it)."""

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        """This rank's planned micro-batches, in run order."""
        return self.plan.ranks[self.hdp_rank].micro_batches

    @property
    def num_micro_batches(self) -> int:
        """How many micro-batches this rank runs this step (0 is possible)."""
        return len(self.micro_batches)

    @property
    def total_tokens(self) -> int:
        """Real tokens of the whole global batch."""
        return self.plan.total_tokens

    def micro_batch_tensors(self) -> Iterator["MicroBatchTensors"]:
        """This rank's micro-batches as tensors, built one at a time in plan order."""
        for local_index in range(self.num_micro_batches):
            yield self._build(local_index)


def loss_tokens_of(lengths: Iterable[int]) -> int:
    """Loss tokens of a global batch: every token but the last of each sequence has a label.

    Labels are the next token of the *original* sequence, so a sequence of n tokens carries
    n - 1 loss tokens however it is split over ranks.
    """
    return sum(max(0, int(n) - 1) for n in lengths)


class HDPDataIterator:
    """Plans each global batch of ``source`` and yields this rank's :class:`HDPStep`.

    Args:
        source: yields :class:`GlobalBatch` objects or lists of token sequences; every rank
            must see the same global batches (the same deterministic source on every rank).
        planner: ``lengths -> StepPlan`` (e.g. a configured ``planner.schedulers.make_plan``).
        hdp: the runtime's ``HDPGroup`` (Megatron's data-parallel group under HDP).
        plan_mode: ``"every_rank"`` or ``"rank0_broadcast"`` (see the module docstring).
        check_plan_hash: all-gather and compare plan hashes every step.
        device: where micro-batch tensors are built (None: the HDP group's device, i.e. the
            current GPU under NCCL and the CPU under gloo).
        prefetch: global batches read and planned ahead on a background thread
            (``every_rank`` mode only; 0 plans in the training thread).
        plan_group: the process group whose ranks must all train on the same plan (the
            broadcast and hash check run over it); default every process (the world group),
            which covers the TP ranks and pipeline stages of every model replica.
        plan_timeout_s: the longest the training thread waits for a background plan (reading
            the global batch included) before raising ``TimeoutError``; None waits forever.
    """

    def __init__(
        self,
        source: Iterable[GlobalBatch | Sequence[TokenSequence]],
        *,
        planner: Planner,
        hdp: "HDPGroup",
        plan_mode: PlanMode = "every_rank",
        check_plan_hash: bool = True,
        device: Optional[torch.device | str] = None,
        prefetch: int = 1,
        plan_group: Optional[dist.ProcessGroup] = None,
        plan_timeout_s: Optional[float] = DEFAULT_PLAN_TIMEOUT_S,
    ) -> None:
        if plan_mode not in ("every_rank", "rank0_broadcast"):
            raise ValueError(f"plan_mode ({plan_mode!r}) must be 'every_rank' or 'rank0_broadcast'")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch ({prefetch!r}) must be an integer >= 0")
        if plan_timeout_s is not None and not (
            isinstance(plan_timeout_s, (int, float)) and plan_timeout_s > 0
        ):
            raise ValueError(f"plan_timeout_s ({plan_timeout_s!r}) must be > 0 seconds or None")
        self._source = iter(source)
        self._planner = planner
        self.hdp = hdp
        self.plan_mode = plan_mode
        self.check_plan_hash = check_plan_hash
        self.device = device if device is not None else hdp.device
        self._step = 0
        self.plan_group = plan_group
        background = plan_mode == "every_rank" or _group_size(self._agreement_group()) == 1
        self.prefetch = prefetch if background else 0
        self.plan_timeout_s = plan_timeout_s
        self._worker: PlanWorker | None = None
        self._pending: deque[Future] = deque()
        self._retry: GlobalBatch | None = None  # a batch whose planning failed: planned next
        self._broken: BaseException | None = None  # the source failed or planning timed out

    def __iter__(self) -> "HDPDataIterator":
        return self

    def __next__(self) -> HDPStep:
        if self._broken is not None:
            raise self._broken
        wait0 = time.perf_counter()
        planned = self._next_planned()
        plan_wait_s = time.perf_counter() - wait0
        if planned is None:
            self.close()
            raise StopIteration
        batch, plan, plan_s, error = planned
        if error is not None:
            self._retry = batch  # the next call plans this batch again: nothing is skipped
            self._report_failure(error)
            raise error
        if plan.hdp_size != self.hdp.size:
            self._retry = batch
            raise ValueError(
                f"the planner made a plan for {plan.hdp_size} HDP ranks, the HDP group has "
                f"{self.hdp.size}"
            )
        plan_hash = plan.content_hash()
        if self.check_plan_hash:
            try:
                check_plan_hashes(plan_hash, self._agreement_group(), step=self._step)
            except (PlanMismatchError, PlanningError):
                self._retry = batch  # every rank keeps the batch, so they stay in step
                raise
        self._retry = None
        step = HDPStep(
            index=self._step,
            plan=plan,
            plan_hash=plan_hash,
            hdp_rank=self.hdp.rank,
            global_batch=batch,
            global_loss_tokens=loss_tokens_of(s.length for s in plan.sequences),
            _build=self._builder(plan, batch),
            plan_s=plan_s,
            plan_wait_s=plan_wait_s if self.prefetch else plan_s,
        )
        self._step += 1
        return step

    def close(self) -> None:
        """Stop the background planner (pending plans are dropped; never blocks for long)."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __del__(self) -> None:  # best effort: do not leave a thread behind
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _next_planned(self) -> "_Planned | None":
        """The next batch and its plan (or its planning error); None at the end of the data."""
        try:
            if self._retry is not None:
                batch = self._retry
                if self.prefetch:
                    return self._wait(self._background().submit(lambda: self._plan_batch(batch)))
                return self._plan_batch(batch)
            if not self.prefetch:
                return self._read_and_plan()
            self._fill_pipeline()
            planned = self._wait(self._pending.popleft())
            if planned is not None:
                self._fill_pipeline()
            return planned
        except Exception as exc:  # the source raised or nothing came in time: no resuming
            self._broken = exc
            self.close()
            raise

    def _wait(self, future: Future) -> "_Planned | None":
        try:
            return future.result(timeout=self.plan_timeout_s)
        except FutureTimeoutError:
            raise TimeoutError(
                f"step {self._step}: no plan after {self.plan_timeout_s:g} s: reading the global "
                "batch or planning it never returned (the planner thread is abandoned; it is a "
                "daemon thread). If planning is legitimately this slow, raise plan_timeout_s"
            ) from None

    def _report_failure(self, error: BaseException) -> None:
        """Let the other ranks know this rank could not plan, instead of leaving them waiting."""
        group = self._agreement_group()
        if self.check_plan_hash and self.plan_mode == "every_rank" and _group_size(group) > 1:
            try:
                check_plan_hashes(_FAILED_HASH, group, step=self._step)
            except (PlanMismatchError, PlanningError):
                pass  # the other ranks planned: they raise naming this rank; this one raises its own

    def _background(self) -> "PlanWorker":
        if self._worker is None:
            self._worker = PlanWorker(name="bytescale-plan")
        return self._worker

    def _fill_pipeline(self) -> None:
        worker = self._background()
        while len(self._pending) < self.prefetch:
            # one worker: batches are read and planned strictly in order
            self._pending.append(worker.submit(self._read_and_plan))

    def _read_and_plan(self) -> "_Planned | None":
        """Next global batch and its plan (None when the source is exhausted)."""
        start = time.perf_counter()
        try:
            batch = next(self._source)
        except StopIteration:
            return None
        if not isinstance(batch, GlobalBatch):
            batch = GlobalBatch.from_sequences(batch)
        return self._plan_batch(batch, start)

    def _plan_batch(self, batch: GlobalBatch, start: float | None = None) -> "_Planned":
        """``batch`` with its plan, or with the exception its planning raised."""
        start = time.perf_counter() if start is None else start
        try:
            plan = self._plan(list(batch.lengths))
        except Exception as exc:  # noqa: BLE001 - handed to the training thread, raised there
            return batch, None, time.perf_counter() - start, exc
        return batch, plan, time.perf_counter() - start, None

    def _checked_plan(self, lengths: list[int]) -> StepPlan:
        """The planner's plan, validated and proven deadlock-free before any rank trains on it.

        ``validate()`` alone already implies deadlock freedom (orders increase on every rank;
        with PP, ring members share the local index). The simulation costs 2-30 ms per plan
        with PP = 1 at 1,024-16,384 ranks, on the planning thread, and turns a broken
        validator (or a future PP schedule) into an error naming the stuck ranks instead of a
        hang (docs/testing.md).
        """
        plan = self._planner(lengths).validate()
        check_deadlock_free(plan)
        return plan

    def _agreement_group(self) -> Optional[dist.ProcessGroup]:
        """The plan group (None: a single process, nothing to agree on)."""
        if self.plan_group is not None:
            return self.plan_group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def _plan(self, lengths: list[int]) -> StepPlan:
        group = self._agreement_group()
        if self.plan_mode == "every_rank" or _group_size(group) == 1:
            return self._checked_plan(lengths)
        payload: list[Any] = [None]
        error: Exception | None = None
        if dist.get_rank(group) == 0:
            try:
                payload[0] = {"plan": self._checked_plan(lengths).to_json()}
            except Exception as exc:  # noqa: BLE001 - broadcast, then raised on every rank
                error = exc
                payload[0] = {"error": f"{type(exc).__name__}: {exc}"}
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        if error is not None:
            raise error
        if "error" in payload[0]:
            raise PlanningError(
                f"step {self._step}: rank 0 could not plan the global batch: "
                f"{payload[0]['error']}"
            )
        return StepPlan.from_json(payload[0]["plan"])

    def _builder(self, plan: StepPlan, batch: GlobalBatch) -> Callable[[int], "MicroBatchTensors"]:
        from megatron_bytescale.runtime import build_micro_batch

        tokens = PlannedTokens(batch.tokens_by_seq, plan.sequence_lengths())

        def build(local_index: int) -> "MicroBatchTensors":
            return build_micro_batch(plan, self.hdp, local_index, tokens, device=self.device)

        return build


_Planned = tuple[GlobalBatch, Optional[StepPlan], float, Optional[BaseException]]
"""A batch, its plan (None if planning failed), seconds spent, and the planning error."""


class PlannedTokens(Mapping):
    """The tokens of each planned sequence, cut to the length the plan gives it.

    The planner may truncate an overlong sequence (``overlong="truncate"``) or drop it; the
    micro-batch builder wants exactly the planned tokens. Reads go to the source lazily, so a
    source backed by files only loads the sequences this rank's pieces touch.
    """

    def __init__(
        self,
        source: Mapping[int, TokenSequence] | Sequence[TokenSequence],
        lengths: Mapping[int, int],
    ):
        self._source = source
        self._lengths = dict(lengths)

    def __getitem__(self, seq: int) -> Any:
        if seq not in self._lengths:
            raise KeyError(seq)
        tokens = self._source[seq]
        length = self._lengths[seq]
        return tokens[:length] if len(tokens) != length else tokens

    def __iter__(self) -> Iterator[int]:
        return iter(self._lengths)

    def __len__(self) -> int:
        return len(self._lengths)


def check_plan_hashes(
    plan_hash: str, group: "dist.ProcessGroup | HDPGroup | None", *, step: int = 0
) -> None:
    """All-gather the plan hash over ``group``; raise on every rank if they differ.

    ``group`` is a process group (the world: every TP rank and stage too) or an ``HDPGroup``
    (its ranks are then named as HDP ranks); None means one process. Every rank sees every
    hash, so every rank raises the same error and none is left waiting in a later collective.
    """
    label = "ranks"
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group, label = group.group, "HDP ranks"  # an HDPGroup
    size = _group_size(group)
    if size == 1:
        return
    device = collective_device(group)
    mine = torch.tensor(list(bytes.fromhex(plan_hash)), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    hashes = [bytes(t.cpu().tolist()).hex() for t in gathered]
    if len(set(hashes)) == 1:
        return
    by_hash: dict[str, list[int]] = {}
    for rank, h in enumerate(hashes):
        by_hash.setdefault(h, []).append(rank)
    failed = by_hash.pop(_FAILED_HASH, None)
    if failed is not None:
        raise PlanningError(
            f"step {step}: {label} {failed} could not plan the global batch (their planner "
            "raised; see their error); this rank stops with them"
        )
    groups = "; ".join(f"{label} {ranks} have {h[:12]}" for h, ranks in by_hash.items())
    raise PlanMismatchError(
        f"step {step}: the ranks planned different steps ({groups}). Planning must be "
        "deterministic on every rank: check that all ranks read the same global batch and use "
        "the same cost model, or plan on rank 0 with --bytescale-plan-mode rank0_broadcast"
    )


def collective_device(group: Any) -> torch.device:
    """The device a collective on ``group`` needs its tensors on (NCCL: the current GPU)."""
    from megatron_bytescale.runtime.hdp_group import collective_device as runtime_device

    return runtime_device(group)


def _group_size(group: "dist.ProcessGroup | None") -> int:
    return 1 if group is None else dist.get_world_size(group)
