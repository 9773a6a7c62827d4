"""The step plan: the contract between planner, runtime, tools and tests (DESIGN.md §4).

A plan says, for one global batch, which tokens every HDP rank trains in which micro-batch, with
which ring and offload ratio, and in which order. It is plain data: frozen dataclasses that
round-trip through JSON, carry a content hash that ranks compare (D7), and check their own
invariants in :meth:`StepPlan.validate`.

Terms:
    ring       the ordered tuple of HDP ranks that carry one micro-batch together; size 1 means
               a local micro-batch that never communicates.
    order      a global number per ring micro-batch; every rank runs its micro-batches in
               increasing order, which makes the dynamic rings deadlock-free without barriers
               (D5). With pipeline parallelism the members also hold it at the same local index.
    seqs       the sequences the ring carries, in local buffer order (the same on every member).
    pieces     this rank's real tokens of those sequences: the whole sequence on a ring of size
               1, the zigzag share (parts i and 2N-1-i, see :mod:`.zigzag`) on a larger ring.
               Any contiguous split into 2N parts is valid (the planner cuts parts of
               ceil(L / 2N) tokens); the runtime pads every part to the largest one.
    chunk      ``(i, k)`` on a ring micro-batch split along the pipeline into k causal chunks
               (Seq1F1B-style, docs/pipeline.md): chunk i carries positions
               ``[floor(i L / k), floor((i + 1) L / k))`` of every sequence (:func:`.causal_chunks`),
               zigzagged over the ring on its own; the k chunks have consecutive orders and sit
               at consecutive local indices on every member. None (the default, and not written
               to JSON, so older plans keep their hash) for an unsplit micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping

from .inputs import loads_json
from .zigzag import Span, causal_chunks, zigzag_split, zigzag_split_from_shares

PLAN_VERSION = 1

MAX_SEQUENCE_LENGTH = 2**40
"""The longest sequence the planner accepts (1.1e12 tokens): far beyond any context, and small
enough that lengths, their sums and squares stay exact in int64 and finite in float64."""


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the invariant and the ids involved."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sequence:
    """One sequence (document) of the global batch."""

    id: int
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Real tokens ``[start, end)`` of sequence ``seq`` held by one rank."""

    seq: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatch:
    """One micro-batch as one rank sees it: the ring, the sequences it carries, this rank's share."""

    order: int
    ring: tuple[int, ...]
    offload_ratio: float = 0.0
    seqs: tuple[int, ...]
    pieces: tuple[Piece, ...]
    chunk: tuple[int, int] | None = None

    @property
    def ring_size(self) -> int:
        return len(self.ring)

    @property
    def num_tokens(self) -> int:
        """Real tokens this rank holds in this micro-batch."""
        return sum(p.end - p.start for p in self.pieces)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    """The micro-batches of one HDP rank, in the order it runs them."""

    rank: int
    micro_batches: tuple[MicroBatch, ...]


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What the cost model predicts for a plan (not part of the content hash)."""

    step_time_s: float
    rank_time_s: tuple[float, ...]
    p2p_bytes: int
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The plan of one training step over ``hdp_size`` HDP ranks of ``capacity`` tokens each.

    ``layers_per_stage`` (l in Eq. 3) is needed to check the memory budget of micro-batches
    that offload activations; ``align`` is the zigzag padding alignment.
    ``virtual_pipeline_size`` (v): model chunks per pipeline stage of the interleaved 1F1B
    schedule (1: plain 1F1B); it changes the estimate (:mod:`.pipeline_floor`), not the rings.
    It is written to JSON only when above 1, so plans without it keep their hash.
    ``ep_size`` (E): HDP ranks per expert group (Megatron's expert-parallel size when its
    expert tensor-parallel size is the TP size; in general ``ETP x EP / TP``, or 1 when an
    expert group lies inside one TP group); HDP ranks ``g*E .. g*E+E-1`` form expert group g,
    whose ranks meet in the MoE all-to-all of every micro-batch. With E > 1 a ring micro-batch
    sits at the same local index (its *slot*) on every member, and every rank of an expert
    group runs as many slots as the busiest of them (:func:`expert_slots`; a rank with nothing
    to train in a slot runs an empty micro-batch). Written to JSON only when above 1.
    """

    hdp_size: int
    capacity: int
    pp_size: int = 1
    scheduler: str
    sequences: tuple[Sequence, ...]
    ranks: tuple[RankPlan, ...]
    layers_per_stage: int = 1
    align: int = 1
    estimate: Estimate | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    virtual_pipeline_size: int = 1
    ep_size: int = 1

    # ------------------------------------------------------------------ queries
    def sequence_lengths(self) -> dict[int, int]:
        return {s.id: s.length for s in self.sequences}

    @property
    def total_tokens(self) -> int:
        return sum(s.length for s in self.sequences)

    def micro_batch_counts(self) -> list[int]:
        return [len(r.micro_batches) for r in self.ranks]

    def ring_sizes(self) -> list[int]:
        """Size of every distinct ring micro-batch (one entry per order number)."""
        seen: dict[int, int] = {}
        for r in self.ranks:
            for mb in r.micro_batches:
                seen.setdefault(mb.order, mb.ring_size)
        return [seen[k] for k in sorted(seen)]

    def zigzag_splits(self) -> Mapping[int, tuple[Span, ...]]:
        """The parts of every sequence as the plan's pieces state them, by sequence id.

        ``2N`` ranges per sequence on a ring of N (``((0, length),)`` on a ring of size 1), the
        same on every rank: the runtime sizes and fills its buffers from them. Computed once per
        plan. Raises :class:`PlanError` if a sequence's pieces are not a contiguous zigzag split
        (:meth:`validate` reports it with more context).
        """
        return self._zigzag_splits

    def chunk_zigzag_splits(self) -> Mapping[tuple[int, int], tuple[Span, ...]]:
        """The parts of every chunk of a split micro-batch, by ``(sequence id, chunk index)``.

        Like :meth:`zigzag_splits`, but relative to the chunk's start in its sequence: the
        ``2N`` ranges tile ``[0, chunk length)``. Sequences of unsplit micro-batches are not in
        it (and chunked ones are not in :meth:`zigzag_splits`).
        """
        return self._chunk_splits

    @cached_property
    def _zigzag_splits(self) -> dict[int, tuple[Span, ...]]:
        return self._splits(chunked=False)  # type: ignore[return-value]

    @cached_property
    def _chunk_splits(self) -> dict[tuple[int, int], tuple[Span, ...]]:
        return self._splits(chunked=True)  # type: ignore[return-value]

    def _splits(self, *, chunked: bool) -> dict[Any, tuple[Span, ...]]:
        lengths = self.sequence_lengths()
        shares: dict[Any, dict[int, list[Span]]] = defaultdict(dict)
        ring_of: dict[Any, tuple[int, ...]] = {}
        span_of: dict[Any, Span] = {}
        for rank_plan in self.ranks:
            for mb in rank_plan.micro_batches:
                if (mb.chunk is not None) != chunked:
                    continue
                position = mb.ring.index(rank_plan.rank) if rank_plan.rank in mb.ring else -1
                for sid in mb.seqs:
                    key = sid if mb.chunk is None else (sid, mb.chunk[0])
                    if sid not in lengths:
                        raise PlanError(f"pieces name unknown sequence {sid}")
                    ring_of[key] = mb.ring
                    span_of[key] = (
                        (0, lengths[sid]) if mb.chunk is None
                        else causal_chunks(lengths[sid], mb.chunk[1])[mb.chunk[0]]
                    )
                    shares[key].setdefault(position, [])
                for piece in mb.pieces:
                    key = piece.seq if mb.chunk is None else (piece.seq, mb.chunk[0])
                    shift = span_of[key][0] if key in span_of else 0
                    shares[key].setdefault(position, []).append((piece.start - shift, piece.end - shift))
        splits: dict[Any, tuple[Span, ...]] = {}
        for key, by_position in shares.items():
            ring = ring_of.get(key, ())
            if key not in span_of:
                raise PlanError(f"pieces name sequence {key} outside their micro-batch's seqs")
            a, b = span_of[key]
            what = f"sequence {key}" if not chunked else f"sequence {key[0]} chunk {key[1]}"
            try:
                splits[key] = zigzag_split_from_shares(
                    b - a, [by_position.get(p, []) for p in range(len(ring))]
                )
            except ValueError as exc:
                raise PlanError(f"{what} on ring {list(ring)}: {exc}") from None
        return splits

    # ------------------------------------------------------------------ JSON
    def to_dict(self, *, with_estimate: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "hdp_size": self.hdp_size,
            "capacity": self.capacity,
            "pp_size": self.pp_size,
            "scheduler": self.scheduler,
            "layers_per_stage": self.layers_per_stage,
            **({"virtual_pipeline_size": self.virtual_pipeline_size} if self.virtual_pipeline_size != 1 else {}),
            **({"ep_size": self.ep_size} if self.ep_size != 1 else {}),
            "align": self.align,
            "sequences": [{"id": s.id, "length": s.length} for s in self.sequences],
            "ranks": [
                {
                    "rank": r.rank,
                    "micro_batches": [
                        {
                            "order": mb.order,
                            "ring": list(mb.ring),
                            "offload_ratio": mb.offload_ratio,
                            "seqs": list(mb.seqs),
                            "pieces": [
                                {"seq": p.seq, "start": p.start, "end": p.end} for p in mb.pieces
                            ],
                            **({"chunk": list(mb.chunk)} if mb.chunk is not None else {}),
                        }
                        for mb in r.micro_batches
                    ],
                }
                for r in self.ranks
            ],
        }
        if with_estimate and self.estimate is not None:
            out["estimate"] = {
                "step_time_s": self.estimate.step_time_s,
                "rank_time_s": list(self.estimate.rank_time_s),
                "p2p_bytes": self.estimate.p2p_bytes,
                **dict(self.estimate.extra),
            }
        if with_estimate and self.meta:
            out["meta"] = dict(self.meta)
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepPlan":
        """Build a plan from :meth:`to_dict` output; malformed input raises :class:`PlanError`.

        Integer fields must be JSON integers: ``1.5``, ``true`` or ``"01"`` would otherwise be
        read as some other plan than the one written (``int(1.5) == 1``, ``tuple("01")``).
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"malformed plan: expected a JSON object, got {type(data).__name__}")
        try:
            version = _as_int(data.get("version", PLAN_VERSION), "version")
            if version != PLAN_VERSION:
                raise PlanError(f"plan version {version} is not supported (expected {PLAN_VERSION})")
            ranks = tuple(
                RankPlan(
                    rank=_as_int(r["rank"], f"ranks[{i}].rank"),
                    micro_batches=tuple(
                        _micro_batch_from_dict(mb, f"ranks[{i}].micro_batches[{j}]")
                        for j, mb in enumerate(_as_list(r["micro_batches"], f"ranks[{i}].micro_batches"))
                    ),
                )
                for i, r in enumerate(_as_list(data["ranks"], "ranks"))
            )
            est = data.get("estimate")
            estimate = None
            if est is not None:
                known = {"step_time_s", "rank_time_s", "p2p_bytes"}
                if not isinstance(est, Mapping):
                    raise PlanError(f"malformed plan: estimate must be an object, got {type(est).__name__}")
                estimate = Estimate(
                    step_time_s=_as_seconds(est["step_time_s"], "estimate.step_time_s"),
                    rank_time_s=tuple(_as_seconds(x, f"estimate.rank_time_s[{k}]") for k, x in
                                      enumerate(_as_list(est["rank_time_s"], "estimate.rank_time_s"))),
                    p2p_bytes=_as_int(est["p2p_bytes"], "estimate.p2p_bytes"),
                    extra={k: v for k, v in est.items() if k not in known},
                )
                if estimate.p2p_bytes < 0:
                    raise PlanError(f"malformed plan: estimate.p2p_bytes ({estimate.p2p_bytes}) must be >= 0")
            scheduler = data["scheduler"]
            if not isinstance(scheduler, str):
                raise PlanError(f"malformed plan: scheduler must be a string, got {scheduler!r:.60}")
            meta = data.get("meta", {})
            if not isinstance(meta, Mapping):
                raise PlanError(f"malformed plan: meta must be an object, got {type(meta).__name__}")
            return cls(
                version=version,
                hdp_size=_as_int(data["hdp_size"], "hdp_size"),
                capacity=_as_int(data["capacity"], "capacity"),
                pp_size=_as_int(data.get("pp_size", 1), "pp_size"),
                scheduler=scheduler,
                layers_per_stage=_as_int(data.get("layers_per_stage", 1), "layers_per_stage"),
                virtual_pipeline_size=_as_int(data.get("virtual_pipeline_size", 1), "virtual_pipeline_size"),
                ep_size=_as_int(data.get("ep_size", 1), "ep_size"),
                align=_as_int(data.get("align", 1), "align"),
                sequences=tuple(
                    Sequence(id=_as_int(s["id"], f"sequences[{k}].id"),
                             length=_as_int(s["length"], f"sequences[{k}].length"))
                    for k, s in enumerate(_as_list(data["sequences"], "sequences"))
                ),
                ranks=ranks,
                estimate=estimate,
                meta=_checked_meta(meta, data["sequences"]),
            )
        except PlanError:
            raise
        except KeyError as exc:
            raise PlanError(f"malformed plan: missing field {exc}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"malformed plan: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> "StepPlan":
        try:
            data = loads_json(text, "plan")  # nesting depth and number sizes bounded
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ hash
    def content_hash(self) -> str:
        """SHA-256 of the canonical JSON of everything but the estimate and meta (D7)."""
        canonical = json.dumps(
            self.to_dict(with_estimate=False), sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    # ------------------------------------------------------------------ checks
    def validate(self) -> "StepPlan":
        """Check every invariant of DESIGN.md §4; raise :class:`PlanError` naming the first broken one."""
        _validate(self)
        return self


def _as_int(value: Any, where: str) -> int:
    """A JSON integer (bool and float refused: they would silently become another plan)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"malformed plan: {where} must be an integer, got {value!r}")
    return int(value)


def _as_number(value: Any, where: str) -> float:
    """A JSON number (a string such as "0" or a bool is refused, not converted; the range is
    :meth:`StepPlan.validate`'s to check)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PlanError(f"malformed plan: {where} must be a number, got {value!r:.60}")
    return float(value)


def _as_seconds(value: Any, where: str) -> float:
    """A JSON number of seconds: finite and >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < float("inf"):
        raise PlanError(f"malformed plan: {where} must be a finite number of seconds >= 0, got {value!r:.60}")
    return float(value)


def _checked_meta(meta: Mapping[str, Any], sequences: Any) -> dict[str, Any]:
    """``meta`` with its overlong record checked: ``dropped`` lists distinct ids of sequences
    that are not in the plan, ``dropped_tokens`` and ``truncated_tokens`` are counts."""
    out = dict(meta)
    if "dropped" in out:
        dropped = [_as_int(x, "meta.dropped") for x in _as_list(out["dropped"], "meta.dropped")]
        if len(set(dropped)) != len(dropped):
            raise PlanError("malformed plan: meta.dropped names a sequence twice")
        planned = {s["id"] for s in sequences}
        both = sorted(set(dropped) & planned)
        if both:
            raise PlanError(f"malformed plan: meta.dropped names sequences {both[:5]} that the plan "
                            "trains; a dropped sequence is not in the plan")
    for name in ("dropped_tokens", "truncated_tokens"):
        if name in out and _as_int(out[name], f"meta.{name}") < 0:
            raise PlanError(f"malformed plan: meta.{name} ({out[name]}) must be >= 0")
    return out


def _as_list(value: Any, where: str) -> list[Any]:
    """A JSON array (a string or object would be iterated character by character / by key)."""
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"malformed plan: {where} must be a list, got {type(value).__name__}")
    return list(value)


def _micro_batch_from_dict(mb: Mapping[str, Any], where: str) -> MicroBatch:
    if not isinstance(mb, Mapping):
        raise PlanError(f"malformed plan: {where} must be an object, got {type(mb).__name__}")
    pieces = _as_list(mb["pieces"], f"{where}.pieces")
    seqs = mb["seqs"] if "seqs" in mb else _seqs_of(pieces)
    chunk = None
    if mb.get("chunk") is not None:
        pair = _as_list(mb["chunk"], f"{where}.chunk")
        if len(pair) != 2:
            raise PlanError(f"malformed plan: {where}.chunk must be [index, count], got {pair!r:.60}")
        chunk = (_as_int(pair[0], f"{where}.chunk"), _as_int(pair[1], f"{where}.chunk"))
    return MicroBatch(
        order=_as_int(mb["order"], f"{where}.order"),
        ring=tuple(_as_int(x, f"{where}.ring") for x in _as_list(mb["ring"], f"{where}.ring")),
        offload_ratio=_as_number(mb.get("offload_ratio", 0.0), f"{where}.offload_ratio"),
        seqs=tuple(_as_int(x, f"{where}.seqs") for x in _as_list(seqs, f"{where}.seqs")),
        pieces=tuple(
            Piece(seq=_as_int(p["seq"], f"{where}.pieces[{k}].seq"),
                  start=_as_int(p["start"], f"{where}.pieces[{k}].start"),
                  end=_as_int(p["end"], f"{where}.pieces[{k}].end"))
            for k, p in enumerate(pieces)
        ),
        chunk=chunk,
    )


def _seqs_of(pieces: Iterable[Mapping[str, Any]]) -> list[int]:
    out: list[int] = []
    for p in pieces:
        s = int(p["seq"])
        if s not in out:
            out.append(s)
    return out


def resident_tokens(num_tokens: int, offload_ratio: float, layers_per_stage: int) -> float:
    """Token-equivalents of activations kept on the device (Eq. 3's numerator, per rank).

    Two layers stay resident; of the other ``l - 2`` layers the fraction ``1 - r`` stays.
    """
    l = layers_per_stage
    if l <= 2 or offload_ratio <= 0.0:
        return float(num_tokens)
    return num_tokens * (2 + (1.0 - offload_ratio) * (l - 2)) / l


def check_virtual_pipeline(vpp: Any, pp_size: int, layers_per_stage: int) -> None:
    """Raise :class:`PlanError` unless ``vpp`` virtual stages per stage can split the stage:
    an integer >= 1, above 1 only with ``pp_size`` > 1, dividing ``layers_per_stage``."""
    if isinstance(vpp, bool) or not isinstance(vpp, numbers.Integral) or vpp < 1:
        raise PlanError(f"virtual_pipeline_size ({vpp!r}) must be an integer >= 1")
    if vpp > 1 and pp_size < 2:
        raise PlanError(f"virtual_pipeline_size {vpp} needs pipeline parallelism (pp_size is {pp_size}); "
                        "use 1 without PP")
    if layers_per_stage % vpp:
        raise PlanError(f"virtual_pipeline_size {vpp} does not divide the {layers_per_stage} layers of a "
                        "pipeline stage; pick a divisor of it")


def _validate(plan: StepPlan) -> None:
    if plan.hdp_size < 1:
        raise PlanError(f"hdp_size ({plan.hdp_size}) must be >= 1")
    if plan.capacity < 1:
        raise PlanError(f"capacity ({plan.capacity}) must be >= 1")
    if plan.pp_size < 1:
        raise PlanError(f"pp_size ({plan.pp_size}) must be >= 1")
    if plan.align < 1 or plan.layers_per_stage < 1:
        raise PlanError(f"align ({plan.align}) and layers_per_stage ({plan.layers_per_stage}) must be >= 1")
    check_virtual_pipeline(plan.virtual_pipeline_size, plan.pp_size, plan.layers_per_stage)
    if len(plan.ranks) != plan.hdp_size:
        raise PlanError(f"plan has {len(plan.ranks)} rank entries for hdp_size {plan.hdp_size}")
    if plan.ep_size < 1 or plan.hdp_size % plan.ep_size:
        raise PlanError(f"ep_size ({plan.ep_size}) must be >= 1 and divide hdp_size ({plan.hdp_size})")
    lengths: dict[int, int] = {}
    for s in plan.sequences:
        if s.id in lengths:
            raise PlanError(f"sequence id {s.id} appears twice")
        if s.length < 1:
            raise PlanError(f"sequence {s.id}: length {s.length} must be >= 1")
        lengths[s.id] = s.length

    # order -> (ring, offload, seqs, {member: local index})
    rings: dict[int, tuple[tuple[int, ...], float, tuple[int, ...], dict[int, int]]] = {}
    covered: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    seq_order: dict[int, int] = {}
    chunk_of: dict[int, tuple[int, int] | None] = {}
    for idx, rp in enumerate(plan.ranks):
        if rp.rank != idx:
            raise PlanError(f"rank entry {idx} says rank {rp.rank}; entries must be in rank order")
        last_order = None
        for local, mb in enumerate(rp.micro_batches):
            where = f"rank {idx} micro-batch {local} (order {mb.order})"
            if last_order is not None and mb.order <= last_order:
                raise PlanError(f"{where}: orders must increase on a rank (previous {last_order})")
            last_order = mb.order
            ring = mb.ring
            if not ring or len(set(ring)) != len(ring):
                raise PlanError(f"{where}: ring {list(ring)} must be non-empty with distinct ranks")
            if any(not 0 <= m < plan.hdp_size for m in ring):
                raise PlanError(f"{where}: ring {list(ring)} names a rank outside [0, {plan.hdp_size})")
            if idx not in ring:
                raise PlanError(f"{where}: rank {idx} is not a member of its ring {list(ring)}")
            if not 0.0 <= mb.offload_ratio <= 1.0:
                raise PlanError(f"{where}: offload_ratio {mb.offload_ratio} must be in [0, 1]")
            if not mb.seqs:
                raise PlanError(f"{where}: carries no sequence")
            if mb.chunk is not None:
                _check_chunk_field(mb, where)
            if chunk_of.setdefault(mb.order, mb.chunk) != mb.chunk:
                raise PlanError(f"{where}: chunk {mb.chunk} differs from another member's {chunk_of[mb.order]}")
            prev = rings.get(mb.order)
            if prev is None:
                rings[mb.order] = (ring, mb.offload_ratio, mb.seqs, {idx: local})
            else:
                pring, poff, pseqs, members = prev
                if ring != pring:
                    raise PlanError(f"{where}: ring {list(ring)} differs from another member's {list(pring)}")
                if mb.offload_ratio != poff or mb.seqs != pseqs:
                    raise PlanError(f"{where}: offload ratio or sequences differ between ring members")
                members[idx] = local
            group = mb.order if mb.chunk is None else mb.order - mb.chunk[0]  # a split one: chunk 0
            for sid in mb.seqs:
                if sid not in lengths:
                    raise PlanError(f"{where}: unknown sequence {sid}")
                if seq_order.setdefault(sid, group) != group:
                    raise PlanError(
                        f"sequence {sid}: pieces sit in micro-batches of orders "
                        f"{seq_order[sid]} and {mb.order}; one sequence belongs to one ring micro-batch "
                        f"(or to the chunks of one split micro-batch)"
                    )
            _check_piece_order(mb, where)
            for p in mb.pieces:
                covered[p.seq].append((p.start, p.end, idx))
            resident = resident_tokens(mb.num_tokens, mb.offload_ratio, plan.layers_per_stage)
            if resident > plan.capacity + 1e-9:
                raise PlanError(
                    f"{where}: {mb.num_tokens} tokens with offload ratio {mb.offload_ratio} keep "
                    f"{resident:.1f} token-equivalents resident, over capacity {plan.capacity}"
                )

    for order, (ring, _, _, members) in rings.items():
        if set(members) != set(ring):
            missing = sorted(set(ring) - set(members))
            raise PlanError(f"order {order}: ring members {missing} have no such micro-batch")
        if plan.pp_size > 1 and len(set(members.values())) != 1:
            raise PlanError(
                f"order {order}: with pp_size {plan.pp_size} ring members must hold the micro-batch "
                f"at the same local index, got {dict(sorted(members.items()))}"
            )
        if plan.ep_size > 1 and len(set(members.values())) != 1:
            raise PlanError(
                f"order {order}: with ep_size {plan.ep_size} ring members must hold the micro-batch "
                f"at the same local index (slot), got {dict(sorted(members.items()))}: the expert "
                "all-to-all of a slot would wait on a ring member still in another slot"
            )

    _check_chunk_groups(rings, chunk_of, lengths)

    for sid in covered:
        if sid not in lengths:
            raise PlanError(f"pieces name unknown sequence {sid}")
    for sid, length in lengths.items():
        spans = sorted(covered.get(sid, []))
        pos = 0
        for start, end, rank in spans:
            if start != pos:
                what = "overlap" if start < pos else "are missing"
                raise PlanError(f"sequence {sid}: tokens {min(start, pos)}-{max(start, pos) - 1} {what} (rank {rank})")
            pos = end
        if pos != length:
            raise PlanError(f"sequence {sid}: tokens {pos}-{length - 1} are in no piece")
    plan.zigzag_splits()  # every token once: now the pieces must be a contiguous zigzag split
    plan.chunk_zigzag_splits()  # ... of the whole sequence, or of each chunk of a split one


def _check_chunk_field(mb: MicroBatch, where: str) -> None:
    chunk = mb.chunk
    if chunk is None or len(chunk) != 2 or not 0 <= chunk[0] < chunk[1] or chunk[1] < 2:
        raise PlanError(f"{where}: chunk {chunk} must be (index, count) with count >= 2 and "
                        f"0 <= index < count; leave it unset on an unsplit micro-batch")
    if mb.offload_ratio != 0.0:
        raise PlanError(f"{where}: chunk {chunk[0]} of {chunk[1]} has offload ratio "
                        f"{mb.offload_ratio}; the chunks of a split micro-batch do not offload, use 0")


def _check_chunk_groups(
    rings: Mapping[int, tuple[tuple[int, ...], float, tuple[int, ...], dict[int, int]]],
    chunk_of: Mapping[int, tuple[int, int] | None],
    lengths: Mapping[int, int],
) -> None:
    """The k chunks of a split micro-batch: consecutive orders, one ring, consecutive local
    indices on every member, and chunk i carries exactly the sequences with tokens in it."""
    for order, chunk in chunk_of.items():
        if chunk is None:
            continue
        i, k = chunk
        first = order - i
        ring, _, seqs, members = rings[order]
        for j in range(k):
            other = first + j
            if chunk_of.get(other) != (j, k):
                found = "missing" if other not in chunk_of else f"chunk {chunk_of[other]}"
                raise PlanError(
                    f"order {order} is chunk {i} of {k}, so order {other} must be chunk {j} of {k}, "
                    f"but it is {found}; the chunks of a split micro-batch have consecutive orders"
                )
            oring, _, _, omembers = rings[other]
            if oring != ring:
                raise PlanError(f"order {other} (chunk {j} of {k}) runs on ring {list(oring)}, order "
                                f"{order} (chunk {i}) on {list(ring)}; all chunks share one ring")
            for member, local in members.items():
                if omembers.get(member) != local - i + j:
                    raise PlanError(
                        f"rank {member} holds chunk {i} of {k} (order {order}) at local index {local} "
                        f"but chunk {j} (order {other}) at {omembers.get(member)}; the chunks must sit "
                        f"at consecutive local indices"
                    )
        group_seqs = rings[first + k - 1][2]  # every sequence has tokens in the last chunk
        want = tuple(s for s in group_seqs
                     if s in lengths and causal_chunks(lengths[s], k)[i][1] > causal_chunks(lengths[s], k)[i][0])
        if seqs != want:
            raise PlanError(f"order {order} (chunk {i} of {k}) carries sequences {list(seqs)}, expected "
                            f"{list(want)} (those of the last chunk with tokens in chunk {i}, same order)")


def expert_slots(plan: StepPlan, rank: int) -> int:
    """Slots HDP rank ``rank`` runs: the most micro-batches any rank of its expert group runs
    (its own count when ``ep_size`` is 1). Slots past its own micro-batches are empty: the rank
    still joins its group's expert all-to-alls in them, with zero tokens."""
    e = plan.ep_size
    first = rank - rank % e
    return max(len(plan.ranks[r].micro_batches) for r in range(first, first + e))


def _check_piece_order(mb: MicroBatch, where: str) -> None:
    """Pieces are non-empty, name the micro-batch's sequences, and follow their order."""
    rank_of = {sid: i for i, sid in enumerate(mb.seqs)}
    last = -1
    for p in mb.pieces:
        if p.seq not in rank_of:
            raise PlanError(f"{where}: piece of sequence {p.seq}, which is not in seqs {list(mb.seqs)}")
        if not p.start < p.end:
            raise PlanError(f"{where}: piece [{p.start}, {p.end}) of sequence {p.seq} is empty")
        if rank_of[p.seq] < last:
            raise PlanError(
                f"{where}: pieces {[(q.seq, q.start, q.end) for q in mb.pieces]} do not follow "
                f"the order of seqs {list(mb.seqs)}"
            )
        last = rank_of[p.seq]


def build_ring_micro_batches(
    *,
    order: int,
    ring: Iterable[int],
    seqs: Iterable[int],
    lengths: Mapping[int, int],
    align: int = 1,
    offload_ratio: float = 0.0,
    splits: Mapping[int, Iterable[Span]] | None = None,
    chunk: tuple[int, int] | None = None,
) -> dict[int, MicroBatch]:
    """The micro-batch of every member of ``ring`` carrying ``seqs`` (zigzag shares).

    ``splits`` states the 2N parts of a sequence (default: the planner's :func:`zigzag_split`).
    ``chunk`` ``(i, k)``: build chunk i of the micro-batch split into k causal chunks instead
    (only the sequences with tokens in it; ``splits`` then relative to the chunk's start).
    """
    ring_t = tuple(int(r) for r in ring)
    seqs_t = tuple(int(s) for s in seqs)
    n = len(ring_t)
    start = {sid: 0 for sid in seqs_t}
    size = {sid: lengths[sid] for sid in seqs_t}
    if chunk is not None:
        spans = {sid: causal_chunks(lengths[sid], chunk[1])[chunk[0]] for sid in seqs_t}
        seqs_t = tuple(sid for sid in seqs_t if spans[sid][1] > spans[sid][0])
        start = {sid: spans[sid][0] for sid in seqs_t}
        size = {sid: spans[sid][1] - spans[sid][0] for sid in seqs_t}
    parts = {
        sid: tuple((a + start[sid], b + start[sid]) for a, b in
                   ((splits or {}).get(sid) or zigzag_split(size[sid], n, align)))
        for sid in seqs_t
    }
    out: dict[int, MicroBatch] = {}
    for pos, rank in enumerate(ring_t):
        held = (pos,) if n == 1 else (pos, 2 * n - 1 - pos)
        pieces = tuple(
            Piece(seq=sid, start=parts[sid][k][0], end=parts[sid][k][1])
            for sid in seqs_t
            for k in held
            if parts[sid][k][1] > parts[sid][k][0]
        )
        out[rank] = MicroBatch(
            order=order, ring=ring_t, offload_ratio=offload_ratio, seqs=seqs_t, pieces=pieces,
            chunk=chunk,
        )
    return out


class PlanBuilder:
    """Collects ring micro-batches in run order and assembles a :class:`StepPlan`.

    Call :meth:`add` in the global order the ranks must follow; order numbers are assigned
    0, 1, 2, ... in that sequence, so every rank's list is increasing by construction.
    """

    def __init__(
        self,
        *,
        hdp_size: int,
        capacity: int,
        lengths: Mapping[int, int],
        align: int = 1,
    ) -> None:
        self.hdp_size = hdp_size
        self.capacity = capacity
        self.lengths = dict(lengths)
        self.align = align
        self.per_rank: list[list[MicroBatch]] = [[] for _ in range(hdp_size)]
        self._next_order = 0

    def add(
        self,
        ring: Iterable[int],
        seqs: Iterable[int],
        offload_ratio: float = 0.0,
        *,
        splits: Mapping[int, Iterable[Span]] | None = None,
        num_chunks: int = 1,
    ) -> int:
        """Append one ring micro-batch to every member's list; returns its (first) order number.

        ``splits`` optionally states a sequence's 2N zigzag parts (any contiguous split).
        ``num_chunks`` > 1 splits it along the pipeline: k micro-batches, chunks 0..k-1 of one
        ring with consecutive orders (each chunk zigzagged with the planner's split).
        """
        if num_chunks < 1:
            raise ValueError(f"num_chunks ({num_chunks}) must be >= 1")
        if num_chunks > 1 and splits:
            raise ValueError("splits cannot be given for a micro-batch split into chunks")
        first = self._next_order
        ring, seqs = tuple(ring), tuple(seqs)
        for i in range(num_chunks):
            order = self._next_order
            self._next_order += 1
            for rank, mb in build_ring_micro_batches(
                order=order,
                ring=ring,
                seqs=seqs,
                lengths=self.lengths,
                align=self.align,
                offload_ratio=offload_ratio,
                splits=splits,
                chunk=(i, num_chunks) if num_chunks > 1 else None,
            ).items():
                self.per_rank[rank].append(mb)
        return first

    def build(
        self,
        *,
        scheduler: str,
        pp_size: int = 1,
        ep_size: int = 1,
        layers_per_stage: int = 1,
        sequences: Iterable[Sequence] | None = None,
        estimate: Estimate | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> StepPlan:
        seqs = (
            tuple(sequences)
            if sequences is not None
            else tuple(Sequence(id=i, length=n) for i, n in self.lengths.items())
        )
        return StepPlan(
            hdp_size=self.hdp_size,
            capacity=self.capacity,
            pp_size=pp_size,
            ep_size=ep_size,
            scheduler=scheduler,
            sequences=seqs,
            ranks=tuple(
                RankPlan(rank=r, micro_batches=tuple(mbs)) for r, mbs in enumerate(self.per_rank)
            ),
            layers_per_stage=layers_per_stage,
            align=self.align,
            estimate=estimate,
            meta=dict(meta or {}),
        )
