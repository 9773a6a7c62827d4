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

Loaders (``dataloader``): ``"local"`` reads and plans on each rank as above; ``"ray"`` is
ByteScale's remote loader (:mod:`.ray_loader`): reader actors run the source, one planner actor
plans every step ahead for all ranks, and each rank fetches the plan and only its own
micro-batches' tokens (``HDPStep.global_batch.tokens_by_seq`` then holds only those). Same
plans and tokens; the retry, resume and timeout rules above hold for both.

Sources: anything iterable that yields :class:`GlobalBatch` objects or plain lists of token
sequences (sequence id = index), or a function ``start_step -> iterable`` that yields the
batches from global step ``start_step`` on. Token access goes through
``GlobalBatch.tokens_by_seq``, a mapping, so a source backed by a Megatron indexed dataset can
hand in a lazy mapping that reads only the sequences this rank's pieces touch.

Resuming (checkpoints): steps carry their *global* index (``HDPStep.index``), and
:meth:`HDPDataIterator.state_dict` is ``{"next_step": k}``, the number of steps handed to the
training loop so far. Batches read or planned ahead in the background, or a batch whose
planning failed, are not counted: they were never trained, so a resumed iterator reads them
again. :meth:`~HDPDataIterator.load_state_dict` (or ``start_step=k``) positions the source at
step k: a function source is called with k (cheap when it can seek, e.g. by walking document
lengths as :func:`~megatron_bytescale.integration.megatron_lm_data.budget_batches` does); an
iterable is read from its start and its first k batches are dropped. Megatron-LM's
``--load`` resumes through the same ``start_step`` (the steps that the checkpoint's
``consumed_train_samples`` add up to), so both paths agree on the step index.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import torch
import torch.distributed as dist

from megatron_bytescale.planner.order import check_deadlock_free
from megatron_bytescale.planner.plan import MicroBatch, StepPlan
from megatron_bytescale.runtime.backends.base import host_to_device

from .batch import GlobalBatch, TokenSequence
from .batch_sources import BatchSource, checked_step, is_one_shot, open_source, ray_source
from .plan_worker import PlanWorker

if TYPE_CHECKING:
    from megatron_bytescale.runtime import HDPGroup, MicroBatchTensors

    from .ray_loader import RayLoader, RayLoaderOptions

logger = logging.getLogger(__name__)

PlanMode = Literal["every_rank", "rank0_broadcast"]
Planner = Callable[[list[int]], StepPlan]
Loader = Literal["local", "ray"]
STATE_VERSION = 1


DEFAULT_PLAN_TIMEOUT_S = 600.0
_FAILED_HASH = "00" * 32
"""What a rank whose planner raised contributes to the plan-hash exchange."""


class PlanMismatchError(RuntimeError):
    """HDP ranks computed different plans for the same step."""


class PlanningError(RuntimeError):
    """Another HDP rank (rank 0 under ``rank0_broadcast``) could not plan this step."""


@dataclass(frozen=True, kw_only=True)
class HDPStep:
    """One planned training step as this HDP rank sees it."""

    index: int
    plan: StepPlan
    plan_hash: str
    hdp_rank: int
    global_batch: GlobalBatch
    """The step's global batch. With the Ray loader its ``tokens_by_seq`` holds only the
    tokens this rank's micro-batches read (a ``RankTokens``)."""
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
        source: yields :class:`GlobalBatch` objects or lists of token sequences from step 0,
            or is a function ``start_step -> iterable`` of them from step ``start_step`` on;
            every rank must see the same global batches (the same deterministic source on
            every rank).
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
        start_step: global index of the first step (resuming after ``start_step`` trained
            steps; see the module docstring). Same as ``load_state_dict({"next_step": k})``.
        dataloader: ``"local"`` or ``"ray"`` (the remote loader; the source must then be a
            function ``start_step -> iterable`` that pickles, or a list).
        ray_options: settings of the Ray loader (:class:`~.ray_loader.RayLoaderOptions`).
    """

    def __init__(
        self,
        source: BatchSource,
        *,
        planner: Planner,
        hdp: "HDPGroup",
        plan_mode: PlanMode = "every_rank",
        check_plan_hash: bool = True,
        device: Optional[torch.device | str] = None,
        prefetch: int = 1,
        plan_group: Optional[dist.ProcessGroup] = None,
        plan_timeout_s: Optional[float] = DEFAULT_PLAN_TIMEOUT_S,
        start_step: int = 0,
        dataloader: Loader = "local",
        ray_options: Optional["RayLoaderOptions"] = None,
    ) -> None:
        if dataloader not in ("local", "ray"):
            raise ValueError(f"dataloader ({dataloader!r}) must be 'local' or 'ray'")
        if dataloader == "ray":
            source = ray_source(source)
            if plan_mode != "every_rank":
                raise ValueError(
                    f"plan_mode {plan_mode!r} does not apply to the Ray loader, whose one "
                    "planner actor plans for every rank; use plan_mode 'every_rank'"
                )
        if plan_mode not in ("every_rank", "rank0_broadcast"):
            raise ValueError(f"plan_mode ({plan_mode!r}) must be 'every_rank' or 'rank0_broadcast'")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch ({prefetch!r}) must be an integer >= 0")
        if plan_timeout_s is not None and not (
            isinstance(plan_timeout_s, (int, float)) and plan_timeout_s > 0
        ):
            raise ValueError(f"plan_timeout_s ({plan_timeout_s!r}) must be > 0 seconds or None")
        self._origin = source
        self._source: Iterator[Any] = iter(())
        self._planner = planner
        self.hdp = hdp
        self.plan_mode = plan_mode
        self.check_plan_hash = check_plan_hash
        self.device = device if device is not None else hdp.device
        self._step = 0
        self._started = False  # the source has been read from (a one-shot one cannot rewind)
        self.plan_group = plan_group
        background = plan_mode == "every_rank" or _group_size(self._agreement_group()) == 1
        self.prefetch = prefetch if background else 0
        self.plan_timeout_s = plan_timeout_s
        self._worker: PlanWorker | None = None
        self._pending: deque[Future] = deque()
        self._retry: Any = None  # what failed to become a step: planned again next
        self.dataloader = dataloader
        self.ray_options = ray_options
        self._remote: Optional["RayLoader"] = None
        self._fetch_next = 0  # the Ray loader's next step to ask for
        self._broken: BaseException | None = None  # the source failed or planning timed out
        self._seek(checked_step(start_step, "start_step"))

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to resume this iterator: ``{"next_step": k, "version": 1}``.

        ``k`` counts the steps handed out by ``next()`` (save it after the step's optimizer
        step, with the model). Prefetched batches and a batch whose planning failed are not
        in it: a resumed iterator reads them again, so none is lost or trained twice.
        """
        return {"version": STATE_VERSION, "next_step": self._step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at step ``state["next_step"]`` (from :meth:`state_dict`).

        Call it before the first ``next()`` (any source), or at any time when the source is a
        function or a re-iterable collection (a list): batches already read or planned ahead
        are dropped and the source is positioned anew.

        Raises:
            ValueError: ``state`` is not a state of this iterator, or the source is a one-shot
                iterator that has already been read.
        """
        if not isinstance(state, Mapping) or "next_step" not in state:
            raise ValueError(
                f"load_state_dict: expected the dict of HDPDataIterator.state_dict() "
                f"({{'version': {STATE_VERSION}, 'next_step': k}}), got {state!r}"
            )
        if state.get("version", STATE_VERSION) != STATE_VERSION:
            raise ValueError(
                f"load_state_dict: state version {state.get('version')!r}; this iterator "
                f"reads version {STATE_VERSION}"
            )
        step = checked_step(state["next_step"], "next_step")
        if self._started and is_one_shot(self._origin):
            raise ValueError(
                "load_state_dict: the source is a one-shot iterator (a generator?) that has "
                "already been read, so it cannot go back to step "
                f"{step}; build a new HDPDataIterator on a fresh source and call "
                "load_state_dict before its first next(), or pass a function "
                "start_step -> iterable as the source"
            )
        self.close()
        self._retry, self._broken = None, None
        self._seek(step)

    def _seek(self, step: int) -> None:
        """Position the source so that its next batch is global step ``step``."""
        self._fetch_next = step
        if self.dataloader == "local":  # (the Ray loader's readers seek the source themselves)
            self._source = open_source(self._origin, step)
        self._step = step

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
        batch, plan, plan_s, plan_hash = planned.batch, planned.plan, planned.plan_s, planned.hash
        if planned.error is not None:
            self._retry = planned.retry  # the next call plans this batch again: nothing is skipped
            self._report_failure(planned.error)
            raise planned.error
        if plan.hdp_size != self.hdp.size:
            self._retry = planned.retry
            raise ValueError(
                f"the planner made a plan for {plan.hdp_size} HDP ranks, the HDP group has "
                f"{self.hdp.size}"
            )
        if self.check_plan_hash:
            try:
                check_plan_hashes(plan_hash, self._agreement_group(), step=self._step)
            except (PlanMismatchError, PlanningError):
                self._retry = planned.retry  # every rank keeps the batch, so they stay in step
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
        if self._remote is not None:
            self._remote.close()
            self._remote = None

    def __del__(self) -> None:  # best effort: do not leave a thread behind
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _next_planned(self) -> "_Planned | None":
        """The next batch and its plan (or its planning error); None at the end of the data."""
        try:
            if self.dataloader == "ray" and self._remote is None:
                self._remote = self._connect_ray()
            if self._retry is not None:
                job = self._retry_job(self._retry)
                return self._wait(self._background().submit(job)) if self.prefetch else job()
            self._started = True
            if not self.prefetch:
                return self._next_job()()
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
            self._pending.append(worker.submit(self._next_job()))

    def _next_job(self) -> Callable[[], "_Planned | None"]:
        """Reads and plans the next batch (local), or fetches the next step (Ray)."""
        if self.dataloader == "ray":
            step, self._fetch_next = self._fetch_next, self._fetch_next + 1
            return functools.partial(self._fetch_remote, step, 0, self._step)
        return functools.partial(self._read_and_plan, self._source)  # this source, even if reseeked

    def _retry_job(self, retry: Any) -> Callable[[], "_Planned"]:
        if isinstance(retry, _RemoteRetry):
            return functools.partial(self._fetch_remote, retry.step, retry.attempt + 1, self._step)
        return functools.partial(self._plan_batch, retry)

    def _connect_ray(self) -> "RayLoader":
        """Create (first process of the plan group) or join the Ray loader's actors."""
        from .ray_loader import RayLoader, RayLoaderOptions

        options = self.ray_options or RayLoaderOptions()
        group = self._agreement_group()
        consumers = _group_size(group)

        def broadcast(payload: Any) -> Any:
            box = [payload]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            return box[0]

        return RayLoader(
            self._origin, self._planner, options=options, start_step=self._fetch_next,
            consumer=0 if consumers == 1 else dist.get_rank(group), consumers=consumers,
            max_held=options.lookahead + self.prefetch + 2,
            broadcast=broadcast if consumers > 1 else None,
        )  # fmt: skip

    def _fetch_remote(self, step: int, attempt: int, done_before: int) -> "_Planned | None":
        """Step ``step`` from the Ray loader: its plan and this rank's tokens."""
        assert self._remote is not None
        result = self._remote.fetch(step, attempt=attempt, done_before=done_before,
                                    hdp_rank=self.hdp.rank, timeout_s=self.plan_timeout_s)
        if result[0] == "end":
            return None
        retry = _RemoteRetry(step=step, attempt=attempt)
        if result[0] == "error":
            error = PlanningError(f"step {step}: the Ray loader's planner could not plan the "
                                  f"global batch: {result[1]}")
            return _Planned(batch=None, plan=None, plan_s=0.0, error=error, retry=retry)
        # the planner actor hashed the plan once for every rank; the ranks' hash check then
        # proves they train the same step (and attempt) of the one plan
        _, plan, plan_hash, lengths, seconds, tokens = result
        batch = GlobalBatch(lengths=lengths, tokens_by_seq=tokens,
                            meta={"batch": step, "loader": "ray"})
        return _Planned(batch=batch, plan=plan, plan_s=seconds, hash=plan_hash, retry=retry)

    def _read_and_plan(self, source: Iterator[Any]) -> "_Planned | None":
        """Next global batch of ``source`` and its plan (None when the source is exhausted)."""
        start = time.perf_counter()
        try:
            batch = next(source)
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
            return _Planned(batch=batch, plan=None, plan_s=time.perf_counter() - start,
                            error=exc, retry=batch)
        # the hash costs ~0.2 s at 16,384 ranks: here it is off the critical path too
        return _Planned(batch=batch, plan=plan, plan_s=time.perf_counter() - start,
                        hash=plan.content_hash(), retry=batch)

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


@dataclass(frozen=True, kw_only=True)
class _Planned:
    """A batch, its plan (None if planning failed), seconds spent, the planning error, the
    plan's hash, and what to plan again if the step is not handed out."""

    batch: Optional[GlobalBatch]
    plan: Optional[StepPlan]
    plan_s: float
    error: Optional[BaseException] = None
    hash: str = ""
    retry: Any = None


@dataclass(frozen=True, kw_only=True)
class _RemoteRetry:
    """A Ray-loader step that was not handed out: ask for it again, as the next attempt."""

    step: int
    attempt: int


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
    # built on the host, copied without blocking, gathered into one table, read back ONCE
    mine = host_to_device(torch.frombuffer(bytearray.fromhex(plan_hash), dtype=torch.uint8),
                          device)  # fmt: skip
    table = torch.empty((size, mine.numel()), dtype=torch.uint8, device=device)
    dist.all_gather(list(table.unbind(0)), mine, group=group)
    rows = table.cpu().numpy()
    hashes = [row.tobytes().hex() for row in rows]
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
