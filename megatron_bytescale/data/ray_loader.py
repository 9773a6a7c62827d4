"""The Ray remote loader (``--bytescale-dataloader ray``): one planner for the whole job.

ByteScale's loader (paper §7, Fig. 15) takes planning and reading off the training processes:
*reader* actors run the global-batch source and report the lengths of its sequences; one
*planner* actor collects the lengths of step t from every reader, plans it ahead of time, and
every training process fetches the plan and then **only the tokens of its own micro-batches**
from the readers. Actors: :mod:`.ray_actors`. This module is the training process's end:

* :class:`RayLoader` creates the actors (in the first process of the plan group) or finds them
  (every other process, by name, after one broadcast over the plan group), fetches a step, and
  shuts the actors down cleanly;
* :class:`RankTokens` is the token mapping of a step as one rank sees it: the ranges its
  micro-batches need (each zigzag part plus the one token after it, the last label), nothing
  else.

The plans and tokens are the local loader's: the same source, the same planner function (run
in the planner actor), the same validation. :class:`~.hdp_iterator.HDPDataIterator` with
``dataloader="ray"`` uses this class; its retry, resume and prefetch rules are unchanged.

Ray is optional: ``pip install 'megatron_bytescale[ray]'``. Which cluster: ``address`` if
given, else ``RAY_ADDRESS``, else one started by the first process on its node (enough for a
single node; for several nodes run ``ray start --head`` on a CPU node and set ``RAY_ADDRESS``
on every training node).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from .ray_actors import BatchReader, StepPlanner, TokenRange, describe

logger = logging.getLogger(__name__)

RAY_MISSING = (
    "the Ray loader (--bytescale-dataloader ray, dataloader='ray') needs Ray, which is not "
    "installed here: pip install 'megatron_bytescale[ray]' (or use the local loader: "
    "--bytescale-dataloader local)"
)


_SHARED_ENV = ("RAY_AUTH_MODE",)
"""Environment that ``ray.init`` sets in the process that starts a local instance."""
ACTOR_EXIT_TIMEOUT_S = 30.0
"""How long :meth:`RayLoader.close` waits for the stopped actors to leave Ray's list."""


class RayUnavailableError(ImportError):
    """``dataloader='ray'`` was asked for, and Ray cannot be imported."""


class RayLoaderError(RuntimeError):
    """An actor of the Ray loader died or failed; the step cannot be served."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`RayUnavailableError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailableError(RAY_MISSING) from None
    return ray


def check_ray_available() -> None:
    """:class:`RayUnavailableError` if Ray is not installed, without importing it.

    Importing Ray reads its environment once; a process that joins a Ray instance started by
    another must first take that instance's settings (see :class:`RayLoader`)."""
    module = sys.modules.get("ray", False)
    found = module is not None if module is not False else (
        importlib.util.find_spec("ray") is not None)
    if not found:
        raise RayUnavailableError(RAY_MISSING)


@dataclass(frozen=True, kw_only=True)
class RayLoaderOptions:
    """Settings of the Ray loader (the ``--bytescale-ray-*`` flags)."""

    address: Optional[str] = None
    """Ray cluster to join; None: ``RAY_ADDRESS``, else one started by the first process."""
    num_readers: int = 2
    """Reader actors; sequence ``i`` of a global batch is read by reader ``i % num_readers``."""
    lookahead: int = 2
    """Steps the planner actor plans beyond the newest step a process asked for."""
    namespace: str = "megatron_bytescale"
    """Ray namespace of the actors' names."""
    close_timeout_s: float = 30.0
    """At close, how long the first process waits for the others to finish before it stops
    the actors."""

    def __post_init__(self) -> None:
        for name in ("num_readers", "lookahead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Ray loader: {name} ({value!r}) must be an integer >= 1")


class RankTokens(Mapping):
    """The tokens of one step that one rank holds: ``pieces[seq]`` = ``[(start, array)]``.

    ``self[seq]`` is an array of the sequence's planned length whose held ranges are the
    sequence's tokens (the rest is 0 and never read: the micro-batch builder reads only the
    ranges the rank's layout holds). A sequence this rank holds nothing of raises ``KeyError``.
    """

    def __init__(self, lengths: Mapping[int, int],
                 pieces: Mapping[int, Sequence[tuple[int, np.ndarray]]]) -> None:
        self._lengths = dict(lengths)
        self._pieces = {seq: list(p) for seq, p in pieces.items()}
        self._built: dict[int, np.ndarray] = {}

    def __getitem__(self, seq: int) -> np.ndarray:
        if seq not in self._pieces:
            raise KeyError(
                f"sequence {seq}: this rank holds none of its tokens (the Ray loader fetches "
                "only the tokens of this rank's micro-batches)"
            )
        if seq not in self._built:
            pieces = self._pieces[seq]
            dtype = np.result_type(*(p.dtype for _, p in pieces)) if pieces else np.int64
            full = np.zeros(self._lengths[seq], dtype=dtype)
            for start, tokens in pieces:
                full[start:start + len(tokens)] = tokens
            self._built[seq] = full
        return self._built[seq]

    def __iter__(self) -> Iterator[int]:
        return iter(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    @property
    def num_tokens(self) -> int:
        """Tokens fetched for this rank (labels included)."""
        return sum(len(p) for pieces in self._pieces.values() for _, p in pieces)


def rank_token_ranges(plan: Any, hdp_rank: int) -> dict[int, list[tuple[int, int]]]:
    """``{seq: [(start, end), ...]}``: what ``hdp_rank``'s micro-batches read of each sequence.

    Each part the rank's layout holds, plus the token after it (its last label), merged.
    """
    from megatron_bytescale.runtime.layout import layout_for

    wanted: dict[int, list[tuple[int, int]]] = {}
    for index in range(len(plan.ranks[hdp_rank].micro_batches)):
        for slot in layout_for(plan, hdp_rank, index).slots:
            for start, end in slot.parts:
                if end > start:
                    wanted.setdefault(slot.seq, []).append((start, min(end + 1, slot.length)))
    merged: dict[int, list[tuple[int, int]]] = {}
    for seq, spans in wanted.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[seq] = out
    return merged


class RayLoader:
    """This process's end of the Ray loader (see the module docstring).

    Args:
        source: ``start_step -> iterable`` of global batches; it is sent to every reader actor
            (so it must pickle: a function or ``functools.partial``, not a generator).
        planner: ``lengths -> StepPlan``, sent to the planner actor.
        options: :class:`RayLoaderOptions`.
        start_step: the first step (resuming).
        consumer, consumers: this process's rank in the plan group, and the group's size.
        max_held: plans the planner actor may hold at once (lookahead + prefetch + 2).
        broadcast: ``payload -> payload`` from consumer 0 to all (a collective over the plan
            group); None with a single consumer.
    """

    def __init__(self, source: Callable[[int], Any], planner: Callable[[list[int]], Any], *,
                 options: RayLoaderOptions, start_step: int, consumer: int, consumers: int,
                 max_held: int, broadcast: Optional[Callable[[Any], Any]] = None) -> None:
        check_ray_available()
        self.options = options
        self.consumer, self.consumers = int(consumer), int(consumers)
        self._owner = self.consumer == 0
        self._closed = False
        payload: dict[str, Any] = {}
        if self._owner:
            try:
                payload = self._create(source, planner, start_step, max_held)
            except Exception as exc:  # noqa: BLE001 - broadcast, then raised on every process
                payload = {"error": f"{type(exc).__name__}: {exc}"}
        if broadcast is not None:
            payload = broadcast(payload)
        if "error" in payload:
            raise RayLoaderError(f"could not start the Ray loader: {payload['error']}")
        if not self._owner:
            self._join(payload)

    # ---------------------------------------------------------------- set-up

    def _init_ray(self, address: Optional[str]) -> None:
        ray = self._ray
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)

    def _create(self, source, planner, start_step: int, max_held: int) -> dict[str, Any]:
        self._ray = import_ray()
        ray, opts = self._ray, self.options
        self._init_ray(opts.address or os.environ.get("RAY_ADDRESS") or None)
        prefix = f"bytescale-{uuid.uuid4().hex[:12]}"
        names = [f"{prefix}-reader-{i}" for i in range(opts.num_readers)]
        window = max_held + 1
        reader_cls = ray.remote(num_cpus=0)(BatchReader)
        self._readers = [
            reader_cls.options(name=name, namespace=opts.namespace).remote(
                source, start_step=start_step, shard=i, num_shards=opts.num_readers,
                window=window)
            for i, name in enumerate(names)
        ]  # fmt: skip
        planner_cls = ray.remote(num_cpus=0)(StepPlanner)
        self._planner = planner_cls.options(name=f"{prefix}-planner",
                                            namespace=opts.namespace).remote(
            self._readers, planner, start_step=start_step, lookahead=opts.lookahead,
            consumers=self.consumers, max_held=max_held,
        )  # fmt: skip
        self.names = [f"{prefix}-planner", *names]
        logger.info("Ray loader: planner actor and %d reader actors (%s)", len(names), prefix)
        # a Ray instance started here turned on token authentication in this process's
        # environment only; the other processes need the same mode to join it (the token
        # itself is in ~/.ray on this node)
        env = {k: os.environ[k] for k in _SHARED_ENV if k in os.environ}
        return {"address": ray.get_runtime_context().gcs_address, "names": self.names,
                "env": env}

    def _join(self, payload: Mapping[str, Any]) -> None:
        for key, value in payload.get("env", {}).items():
            os.environ.setdefault(key, value)  # before Ray is imported here: it reads them once
        self._ray = import_ray()
        self._init_ray(payload["address"])
        self.names = list(payload["names"])
        get = self._ray.get_actor
        handles = [get(name, namespace=self.options.namespace) for name in self.names]
        self._planner, self._readers = handles[0], handles[1:]

    # ---------------------------------------------------------------- per step

    def fetch(self, step: int, *, attempt: int, done_before: int, hdp_rank: int,
              timeout_s: Optional[float]) -> tuple:
        """Step ``step`` as this rank needs it.

        Returns ``("plan", plan, plan_hash, lengths, seconds, RankTokens)``,
        ``("error", message)``,
        ``("end",)``; raises :class:`RayLoaderError` if the source or an actor failed.
        """
        start = time.perf_counter()
        ref = self._planner.plan.remote(step, self.consumer, attempt, done_before)
        result = self._get(ref, timeout_s, f"step {step}: the plan")
        kind = result[0]
        if kind == "broken":
            raise RayLoaderError(f"Ray loader: {result[1]}")
        if kind != "plan":
            return result[:2]
        _, plan, plan_hash, lengths, plan_s, _ = result
        tokens = self._tokens(step, plan, hdp_rank, timeout_s)
        return ("plan", plan, plan_hash, lengths, plan_s + time.perf_counter() - start, tokens)

    def _tokens(self, step: int, plan: Any, hdp_rank: int,
                timeout_s: Optional[float]) -> RankTokens:
        ranges = rank_token_ranges(plan, hdp_rank)
        by_reader: dict[int, list[TokenRange]] = {}
        for seq, spans in ranges.items():
            by_reader.setdefault(seq % len(self._readers), []).extend(
                (seq, a, b) for a, b in spans)
        refs = {k: self._readers[k].tokens.remote(step, rs) for k, rs in by_reader.items()}
        pieces: dict[int, list[tuple[int, np.ndarray]]] = {}
        for k, ref in refs.items():
            arrays = self._get(ref, timeout_s, f"step {step}: tokens from reader {k}")
            for (seq, a, b), tokens in zip(by_reader[k], arrays):
                if len(tokens) != b - a:
                    raise RayLoaderError(
                        f"Ray loader: step {step}: reader {k} returned {len(tokens)} tokens of "
                        f"sequence {seq} for [{a}, {b}); the source's tokens are shorter than "
                        "its lengths")
                pieces.setdefault(seq, []).append((a, tokens))
        return RankTokens(plan.sequence_lengths(), pieces)

    def _get(self, ref: Any, timeout_s: Optional[float], what: str) -> Any:
        exceptions = self._ray.exceptions
        try:
            return self._ray.get(ref, timeout=timeout_s)
        except exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{what}: nothing from the Ray loader after {timeout_s:g} s (is the cluster "
                "overloaded, or a reader stuck in the source?); raise plan_timeout_s if "
                "planning is legitimately this slow") from None
        except exceptions.RayActorError as exc:
            raise RayLoaderError(
                f"{what}: an actor of the Ray loader died ({describe(exc)}); restart the "
                "job from its last checkpoint") from None
        except exceptions.RayTaskError as exc:
            raise RayLoaderError(f"{what}: {describe(exc)}") from None

    # ---------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Stop the actors (the first process, once the others are done or after
        ``close_timeout_s``); other processes only say they are done. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._planner.release.remote(self.consumer)
            if self._owner:
                waited = self._planner.released.remote(self.options.close_timeout_s)
                self._ray.get(waited, timeout=self.options.close_timeout_s + 5)
        except Exception:  # noqa: BLE001 - the actors are gone already: nothing to wait for
            pass
        if self._owner:
            for actor in [self._planner, *self._readers]:
                try:
                    self._ray.kill(actor)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            self._wait_until_gone(timeout_s=ACTOR_EXIT_TIMEOUT_S)

    def _wait_until_gone(self, *, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until no actor of this loader is listed any more:
        ``ray.kill`` only asks, and a busy machine may take a while to end the process, so a
        job that closed its loader would otherwise still find (and count) the actors."""
        deadline = time.monotonic() + timeout_s
        mine = set(self.names)
        while True:
            try:
                listed = self._ray.util.list_named_actors(all_namespaces=True)
            except Exception:  # noqa: BLE001 - Ray is down: nothing is left to wait for
                return
            if not mine & {a["name"] for a in listed if a.get("namespace") == self.options.namespace}:
                return
            if time.monotonic() >= deadline:
                logger.warning("Ray loader: actors %s still listed %.0f s after they were stopped",
                               sorted(mine & {a["name"] for a in listed}), timeout_s)
                return
            time.sleep(0.05)

