"""The two actor roles of the Ray loader: readers and the planner (paper §7, Fig. 15).

Plain classes, made Ray actors by :mod:`.ray_loader` (``ray.remote(cls)``), so this module does
not import Ray, and an actor process imports numpy and the planner only (no torch).

* :class:`BatchReader` (the paper's *server*): runs the job's global-batch source, a function
  ``start_step -> iterable`` of global batches, from the step the job starts at; reports the
  lengths of its shard of every batch's sequences (sequence ``i`` belongs to reader
  ``i % num_readers``) and serves token ranges of that shard. It holds the last ``window``
  batches only.
* :class:`StepPlanner` (the *scheduler*, one per job): collects the lengths of step ``t`` from
  every reader, plans it (validated and proven deadlock-free, as the local loader does) and
  keeps the result until every consumer (training process) has trained past it. It plans
  ``lookahead`` steps beyond the newest step any consumer asked for, in a thread of its own,
  so a consumer asking for step ``t`` normally finds it planned; it never holds more than
  ``max_held`` plans (a bounded queue: planning waits for the slowest consumer).

Results are tuples (picklable, small): ``("plan", plan, plan_hash, lengths, plan_s, attempt)``
(the content hash is computed here once, not on every rank: ~0.2 s at 16,384 ranks),
``("error", message, attempt)`` when the planner raised (a consumer asks again with the next
``attempt`` to have it planned again: nothing is skipped), ``("end",)`` after the last batch,
and ``("broken", message)`` when the source or a reader failed (no later step can come).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from megatron_bytescale.planner.order import check_deadlock_free

Source = Callable[[int], Iterable[Any]]
"""``start_step -> iterable`` of global batches (``GlobalBatch`` or lists of token sequences)."""

TokenRange = tuple[int, int, int]
"""``(seq, start, end)``: tokens ``[start, end)`` of sequence ``seq`` of a step's batch."""


class BatchReader:
    """One shard of the global batches (see the module docstring)."""

    def __init__(self, source: Source, *, start_step: int, shard: int, num_shards: int,
                 window: int) -> None:
        self._source, self._start = source, int(start_step)
        self.shard, self.num_shards, self.window = int(shard), int(num_shards), int(window)
        self._it: Optional[Iterator[Any]] = None
        self._next = self._start  # the step the source yields next
        self._held: OrderedDict[int, tuple[tuple[int, ...], Any]] = OrderedDict()
        self._end: Optional[int] = None

    def lengths(self, step: int) -> Optional[tuple[int, dict[int, int]]]:
        """``(number of sequences, {seq: length} of this shard)`` of ``step``; None at the end.

        Steps are read in order (the planner asks for each once, in order); reading ``step``
        drops the batches older than ``step - window + 1``. An exception of the source is
        raised to the caller.
        """
        step = int(step)
        held = self._batch(step)
        if held is None:
            return None
        lengths, _ = held
        mine = {seq: n for seq, n in enumerate(lengths) if seq % self.num_shards == self.shard}
        return len(lengths), mine

    def tokens(self, step: int, ranges: Sequence[TokenRange]) -> list[np.ndarray]:
        """The tokens of ``ranges`` (sequences of this shard) of a batch this reader holds."""
        step = int(step)
        if step not in self._held:
            raise LookupError(
                f"reader {self.shard}: step {step} is not held (it holds steps "
                f"{list(self._held) or 'none'}); the training processes drifted more than "
                f"{self.window} steps apart, or asked for a step that was never planned"
            )
        _, tokens_by_seq = self._held[step]
        out, cached = [], (-1, None)
        for seq, start, end in ranges:  # ranges of one sequence come together: read it once
            if seq % self.num_shards != self.shard:
                raise LookupError(f"reader {self.shard}: sequence {seq} is not in this shard")
            if cached[0] != seq:
                cached = (seq, tokens_by_seq[seq])
            out.append(np.asarray(cached[1][start:end]))
        return out

    def _batch(self, step: int) -> Optional[tuple[tuple[int, ...], Any]]:
        if step in self._held:
            return self._held[step]
        if step < self._next:
            raise LookupError(f"reader {self.shard}: step {step} was dropped already")
        if self._it is None:
            self._it = iter(self._source(self._start))
        while self._next <= step:
            if self._end is not None:
                return None
            try:
                batch = next(self._it)
            except StopIteration:
                self._end = self._next
                return None
            lengths, tokens_by_seq = _lengths_and_tokens(batch)
            self._held[self._next] = (lengths, tokens_by_seq)
            self._next += 1
            while self._held and next(iter(self._held)) <= self._next - 1 - self.window:
                self._held.popitem(last=False)
        return self._held[step]


class StepPlanner:
    """The single planner of a job (see the module docstring); an asyncio actor."""

    def __init__(self, readers: Sequence[Any], planner: Callable[[list[int]], Any], *,
                 start_step: int, lookahead: int, consumers: int, max_held: int) -> None:
        self._readers = list(readers)
        self._planner = planner
        self._next = int(start_step)  # the next step to plan
        self._lookahead, self._consumers = int(lookahead), int(consumers)
        self._max_held = max(int(max_held), 1)
        self._wanted = int(start_step) - 1  # the newest step a consumer asked for
        self._results: dict[int, tuple] = {}
        self._done: dict[int, int] = {}  # consumer -> steps it has trained (never asks again)
        self._ready: dict[int, asyncio.Event] = {}
        self._replan: dict[int, int] = {}  # step -> attempt a consumer asked to plan anew
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._stopped_at: Optional[int] = None  # first step that is "end" or "broken"
        self._released: set[int] = set()
        self._all_released = asyncio.Event()
        self.planned = 0  # plans made (for tests of the bound)
        self.max_held_seen = 0

    async def plan(self, step: int, consumer: int, attempt: int = 0,
                   done_before: Optional[int] = None) -> tuple:
        """The result for ``step`` (see the module docstring), waiting until it is planned.

        ``attempt`` > the attempt of a stored planning error asks for ``step`` to be planned
        again (the consumer's retry of a failed step). ``done_before``: the consumer will
        never ask for a step before this one again (the steps it has trained); a result is
        dropped once every consumer is past it.
        """
        step, consumer, attempt = int(step), int(consumer), int(attempt)
        self._start()
        if done_before is not None:
            self._done[consumer] = max(self._done.get(consumer, 0), int(done_before))
            self._drop_finished()
        if self._stopped_at is not None and step > self._stopped_at:
            return self._results[self._stopped_at]
        held = self._results.get(step)
        if held is not None and held[0] == "error" and attempt > held[2]:
            del self._results[step]
            self._ready[step] = asyncio.Event()
            self._replan[step] = attempt
        elif held is None and step < self._next and step not in self._ready:
            return ("broken", f"step {step} is no longer held: every consumer had moved past "
                              "it (a consumer asked for a step it had reported trained)")
        self._wanted = max(self._wanted, step)
        self._poke()
        while True:
            await self._event(step).wait()
            result = self._results.get(step)
            if result is not None:
                return result
            if step not in self._ready:  # dropped meanwhile: only a consumer behind all others
                return ("broken", f"step {step} is no longer held")

    def _drop_finished(self) -> None:
        """Drop the results of the steps every consumer is past (frees room to plan ahead)."""
        if len(self._done) < self._consumers:
            return
        floor = min(self._done.values())
        for step in [s for s in self._results if s < floor and s != self._stopped_at]:
            del self._results[step]
            self._ready.pop(step, None)
            self._replan.pop(step, None)
        self._poke()

    async def release(self, consumer: int) -> None:
        """``consumer`` is done (closed its iterator): it asks for nothing more."""
        self._released.add(int(consumer))
        if len(self._released) >= self._consumers:
            self._all_released.set()

    async def released(self, timeout_s: float) -> bool:
        """Wait until every consumer is done, at most ``timeout_s``; whether they all are."""
        try:
            await asyncio.wait_for(self._all_released.wait(), timeout=float(timeout_s))
        except asyncio.TimeoutError:
            return False
        return True

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks."""
        return {"planned": self.planned, "held": len(self._results),
                "max_held_seen": self.max_held_seen, "next": self._next}

    # ---------------------------------------------------------------- planning loop

    def _start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _event(self, step: int) -> asyncio.Event:
        return self._ready.setdefault(step, asyncio.Event())

    async def _loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            replans = [s for s in self._replan if s not in self._results]
            if replans:
                step = min(replans)
                attempt = self._replan.pop(step)
            elif (self._stopped_at is None and self._next <= self._wanted + self._lookahead
                  and len(self._results) < self._max_held):
                step, attempt = self._next, 0
            else:
                self._wake.clear()
                await self._wake.wait()
                continue
            result = await self._plan_step(loop, step, attempt)
            if step == self._next:
                self._next += 1
            self._results[step] = result
            self.max_held_seen = max(self.max_held_seen, len(self._results))
            if result[0] in ("end", "broken"):
                self._stopped_at = step
            self._event(step).set()

    async def _plan_step(self, loop: asyncio.AbstractEventLoop, step: int, attempt: int) -> tuple:
        try:
            return await self._read_and_plan(loop, step, attempt)
        except Exception as exc:  # noqa: BLE001 - never leave the consumers waiting for a step
            return ("broken", f"step {step}: the planner actor failed: {describe(exc)}")

    async def _read_and_plan(self, loop: asyncio.AbstractEventLoop, step: int,
                             attempt: int) -> tuple:
        start = time.perf_counter()
        try:
            shards = await asyncio.gather(*(r.lengths.remote(step) for r in self._readers))
        except Exception as exc:  # noqa: BLE001 - a reader failed (its source raised, or it died)
            return ("broken", f"step {step}: reading the global batch failed: {describe(exc)}")
        if any(s is None for s in shards):
            return ("end",)
        lengths = _merge_shards(step, shards)
        if isinstance(lengths, str):
            return ("broken", lengths)
        try:
            plan, plan_hash = await loop.run_in_executor(None, _checked_plan, self._planner,
                                                         lengths)
        except Exception as exc:  # noqa: BLE001 - handed to the consumers, raised there
            return ("error", f"{type(exc).__name__}: {exc}", attempt)
        self.planned += 1
        return ("plan", plan, plan_hash, tuple(lengths), time.perf_counter() - start, attempt)


def describe(exc: BaseException) -> str:
    """``Type: first line`` of an exception, unwrapping Ray's task errors to their cause."""
    cause = getattr(exc, "cause", None) or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def _checked_plan(planner: Callable[[list[int]], Any], lengths: list[int]) -> tuple[Any, str]:
    """The plan, validated and proven deadlock-free (what ``HDPDataIterator`` does locally),
    and its content hash."""
    plan = planner(lengths).validate()
    check_deadlock_free(plan)
    return plan, plan.content_hash()


def _merge_shards(step: int, shards: Sequence[tuple[int, dict[int, int]]]) -> list[int] | str:
    """Every reader's lengths as one list in sequence order, or a message if they disagree."""
    counts = {n for n, _ in shards}
    if len(counts) != 1:
        return (f"step {step}: the readers see different global batches ({sorted(counts)} "
                "sequences); the source must give every reader the same batches")
    lengths = [0] * counts.pop()
    seen = 0
    for _, mine in shards:
        for seq, n in mine.items():
            lengths[seq] = int(n)
            seen += 1
    if seen != len(lengths):
        return f"step {step}: the readers reported {seen} of {len(lengths)} sequence lengths"
    return lengths


def _lengths_and_tokens(batch: Any) -> tuple[tuple[int, ...], Any]:
    """``(lengths, tokens_by_seq)`` of a ``GlobalBatch`` or a list of token sequences."""
    lengths = getattr(batch, "lengths", None)
    if lengths is not None:
        return tuple(int(n) for n in lengths), batch.tokens_by_seq
    sequences = list(batch)
    return tuple(len(s) for s in sequences), sequences
