"""Eq. 3: the offload ratio r and the ring size D(s) of a long sequence (paper §5.2, paper.md §4.3).

For a sequence of s >= C tokens on a stage of l layers::

    argmin_r  D(s)
    s.t.  D(s) = ceil( (2 * Act(s) + (1 - r) * (l - 2) * Act(s)) / (l * Act(C)) )
          T(s) >= Act(s) * r / min(B_d2h, B_h2d)                  (transfer hidden by compute)
          1 >= r >= min(1, l * Act(C) / ((l - 2) * Act(s)))      (offload at all only if it saves a rank)

Two layers' activations always stay on the device, the other l - 2 keep the fraction 1 - r;
l * Act(C) is one rank's budget. How we solve it:

1. ``r_max = min(1, T(s) * B / Act(s))`` from the overlap constraint; ``r_lb`` the lower bound.
   If offload is off, l <= 2 (nothing can leave the device) or ``r_max < r_lb``: r = 0.
2. Without offload, ``D0 = ceil(Act(s) / Act(C))``. With offload, D runs upwards from
   ``D(r_max)``; for each D the smallest ratio that reaches it is
   ``max(r_lb, r_eq3(D), r_tok(D))`` where ``r_eq3`` inverts Eq. 3 and ``r_tok`` makes the
   largest member's real zigzag share fit: ``resident_tokens(share, r, l) <= C`` (exactly what
   :meth:`StepPlan.validate` checks, so Act's intercept or padding can never produce a plan the
   validator rejects). The first D whose ratio is <= r_max wins: it is the minimal D, and the
   ratio is the smallest that gives it (least PCIe traffic; the paper leaves the choice open).
3. If no D below D0 works, offload saves no rank: r = 0, D = D0 (bumped until the share fits).

Host memory (``CostModel.host_memory_bytes``, the budget per rank): a member that offloads r of
its share fills ``r * (l - 2) * Act(share)`` bytes of host memory per micro-batch, and up to
``in_flight`` micro-batches hold theirs at once (1 without pipeline parallelism; with PP the
first stage keeps ``pp_size`` forwards in flight under 1F1B). A ratio whose host memory would
exceed the budget is not a solution: :func:`minimal_ratio_for_ring` returns None for it, so the
solver moves on to a larger ring that needs less (and :func:`fits_at_all` rejects a sequence
that only fits by breaking the budget). The runtime counts the same bytes: its pinned pool
carves the offloaded tensors out of power-of-two slabs (what PyTorch really pins) kept under
this budget (``runtime/host_pool.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cost_model import CostModel
from .plan import resident_tokens
from .zigzag import zigzag_chunk

_EPS = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadDecision:
    """Eq. 3's answer for one sequence."""

    ring_size: int
    offload_ratio: float
    ring_size_without_offload: int
    overlap_ok: bool = True
    """False only when a ratio above the overlap bound had to be used to fit the ranks there are."""


def max_zigzag_share(length: int, ring_size: int, align: int = 1) -> int:
    """Real tokens of the fullest member when ``length`` is zigzag-split over ``ring_size``.

    Part k holds ``clip(length - k * chunk, 0, chunk)`` real tokens (padding sits at the end).
    Part lengths never grow with k, so the fullest member is either position N-1 (parts N-1, N)
    or position 0 (parts 0 and 2N-1) when more than half the parts are padding.
    """
    if ring_size == 1:
        return int(length)
    chunk = zigzag_chunk(length, ring_size, align)

    def part(k: int) -> int:
        return max(0, min(chunk, length - k * chunk))

    n = ring_size
    return max(part(0) + part(2 * n - 1), part(n - 1) + part(n))


def max_zigzag_share_array(lengths: np.ndarray, ring_size: np.ndarray, align: int = 1) -> np.ndarray:
    """Vectorised :func:`max_zigzag_share`."""
    s = np.asarray(lengths, dtype=np.int64)
    n = np.asarray(ring_size, dtype=np.int64)
    parts = 2 * n
    chunk = -(-s // parts)
    chunk = -(-chunk // align) * align

    def part(k: np.ndarray) -> np.ndarray:
        return np.clip(s - k * chunk, 0, chunk)

    out = np.maximum(part(0) + part(parts - 1), part(n - 1) + part(n))
    return np.where(n == 1, s, out)


def fits_on_ring(length: int, ring_size: int, *, capacity: int, layers: int, offload_ratio: float, align: int = 1) -> bool:
    """Whether every member's real share respects the capacity (the validator's check)."""
    share = max_zigzag_share(length, ring_size, align)
    return resident_tokens(share, offload_ratio, layers) <= capacity + _EPS


def ring_size_without_offload(length: int, *, capacity: int, cost_model: CostModel, layers: int, align: int = 1) -> int:
    """D0 = ceil(Act(s) / Act(C)), bumped until the fullest zigzag share holds <= C tokens."""
    act_s = cost_model.activation_bytes(length)
    act_c = cost_model.activation_bytes(capacity)
    d = max(1, math.ceil(act_s / act_c - _EPS))
    d = max(d, -(-length // capacity))  # a member can never hold more than C real tokens
    # from ceil(length / align) ranks on, every part is one align-sized chunk and a member holds
    # at most min(align, length) real tokens, whatever the ring size: search no further
    last = max(d, -(-length // align))
    while not fits_on_ring(length, d, capacity=capacity, layers=layers, offload_ratio=0.0, align=align):
        if d >= last:
            raise ValueError(no_ring_fits(length, capacity, align))
        d += 1
    return d


def ring_sizes_without_offload(lengths: Sequence[int], *, capacity: int, cost_model: CostModel, layers: int,
                               align: int = 1) -> list[int]:
    """:func:`ring_size_without_offload` of every length at once (the same sizes, the same
    error): sharding sizes thousands of long sequences per step, and the scalar search's cost
    model and zigzag calls per sequence were a sizeable part of it.

    The search starts at ``ceil(s / C)`` alone: ``Act`` is linear with an intercept >= 0 (the
    cost model refuses a negative one), so ``Act(s) / Act(C)`` never exceeds ``s / C``."""
    s = np.asarray(lengths, dtype=np.int64)
    if not len(s):
        return []
    d = -(-s // capacity)
    last = np.maximum(d, -(-s // align))
    while True:
        short = max_zigzag_share_array(s, d, align) > capacity + _EPS  # resident_tokens at r = 0
        if not short.any():
            return d.tolist()
        if (short & (d >= last)).any():  # the scalar search raises, for the first such length
            for n in s.tolist():
                ring_size_without_offload(n, capacity=capacity, cost_model=cost_model, layers=layers, align=align)
        d = d + short


def host_bytes_per_member(length: int, ring_size: int, offload_ratio: float, *, layers: int,
                          cost_model: CostModel, align: int = 1) -> float:
    """Host bytes the fullest member of the ring fills when it offloads ``offload_ratio`` of one
    micro-batch: ``r * (l - 2) * Act(share)`` (two layers always stay on the device)."""
    if offload_ratio <= 0.0 or layers <= 2:
        return 0.0
    share = max_zigzag_share(length, ring_size, align)
    return float(offload_ratio) * (layers - 2) * cost_model.activation_bytes(share)


def fits_host_memory(length: int, ring_size: int, offload_ratio: float, *, layers: int,
                     cost_model: CostModel, align: int = 1, in_flight: int = 1) -> bool:
    """Whether ``in_flight`` such micro-batches fit the cost model's host budget per rank."""
    budget = cost_model.host_memory_bytes
    if budget is None:
        return True
    need = in_flight * host_bytes_per_member(length, ring_size, offload_ratio, layers=layers,
                                             cost_model=cost_model, align=align)
    return need <= budget * (1.0 + _EPS)


def no_ring_fits(length: int, capacity: int, align: int) -> str:
    """Why a sequence fits no ring at all (only when align > capacity)."""
    return (
        f"a sequence of {length} tokens fits no ring: every zigzag part is padded to a multiple "
        f"of align ({align}) tokens, more than the capacity ({capacity}); use an align <= the "
        "capacity"
    )


def minimal_ratio_for_ring(
    length: int, ring_size: int, *, capacity: int, cost_model: CostModel, layers: int, align: int = 1,
    in_flight: int = 1,
) -> float | None:
    """Smallest r in [r_lb, 1] with which ``length`` fits on ``ring_size`` ranks (Eq. 3 and the
    zigzag share); 0.0 if no offload is needed, None if even r = 1 does not fit or the smallest
    ratio needs more host memory than the budget (``in_flight`` micro-batches at once)."""
    if fits_on_ring(length, ring_size, capacity=capacity, layers=layers, offload_ratio=0.0, align=align):
        if ring_size >= math.ceil(cost_model.activation_bytes(length) / cost_model.activation_bytes(capacity) - _EPS):
            return 0.0
    if layers <= 2:
        return None
    act_s = cost_model.activation_bytes(length)
    act_c = cost_model.activation_bytes(capacity)
    l = layers
    r_lb = min(1.0, l * act_c / ((l - 2) * act_s))
    r_eq3 = 1.0 - (ring_size * l * act_c / act_s - 2.0) / (l - 2)
    share = max_zigzag_share(length, ring_size, align)
    r_tok = 1.0 - (capacity * l / share - 2.0) / (l - 2)
    r = max(0.0, r_lb, r_eq3, r_tok)
    if r > 1.0 + _EPS:
        return None
    r = min(1.0, r)
    # guard against rounding: the validator compares resident_tokens with C + 1e-9
    for _ in range(64):
        if resident_tokens(share, r, l) <= capacity + _EPS and _eq3_ring_size(act_s, act_c, r, l) <= ring_size:
            if not fits_host_memory(length, ring_size, r, layers=l, cost_model=cost_model,
                                    align=align, in_flight=in_flight):
                return None
            return r
        r = min(1.0, np.nextafter(r, 2.0) + 1e-12)
    return None


def _eq3_ring_size(act_s: float, act_c: float, r: float, l: int) -> int:
    return max(1, math.ceil((2.0 * act_s + (1.0 - r) * (l - 2) * act_s) / (l * act_c) - _EPS))


def solve_offload(
    length: int,
    *,
    capacity: int,
    layers: int,
    cost_model: CostModel,
    align: int = 1,
    offload: bool = True,
    max_ring_size: int | None = None,
    in_flight: int = 1,
    without_offload: int | None = None,
) -> OffloadDecision:
    """Eq. 3 for one sequence of ``length >= capacity`` tokens (shorter ones get D = 1, r = 0).

    ``max_ring_size`` (the HDP size) only matters when the overlap-feasible answer does not fit:
    then the smallest ratio that fits ``max_ring_size`` ranks is used (``overlap_ok=False``; the
    cost model charges the exposed transfer). Callers check :func:`max_fitting_length` first to
    reject sequences that cannot fit at all. ``in_flight``: micro-batches whose offloaded
    activations share a rank's host memory at once (the host budget, module docstring).
    ``without_offload``: :func:`ring_size_without_offload` of ``length`` when the caller has it.
    """
    d0 = (ring_size_without_offload(length, capacity=capacity, cost_model=cost_model, layers=layers, align=align)
          if without_offload is None else without_offload)
    if length < capacity or not offload or layers <= 2 or d0 == 1:
        return OffloadDecision(ring_size=d0, offload_ratio=0.0, ring_size_without_offload=d0)
    act_s = cost_model.activation_bytes(length)
    act_c = cost_model.activation_bytes(capacity)
    l = layers
    r_max = min(1.0, cost_model.layer_time(length) * cost_model.offload_bandwidth / act_s)
    r_lb = min(1.0, l * act_c / ((l - 2) * act_s))
    best: OffloadDecision | None = None
    if r_max >= r_lb:
        for d in range(_eq3_ring_size(act_s, act_c, r_max, l), d0):
            r = minimal_ratio_for_ring(length, d, capacity=capacity, cost_model=cost_model, layers=l,
                                       align=align, in_flight=in_flight)
            if r is not None and r <= r_max + _EPS:
                best = OffloadDecision(ring_size=d, offload_ratio=r, ring_size_without_offload=d0)
                break
    if best is None:
        best = OffloadDecision(ring_size=d0, offload_ratio=0.0, ring_size_without_offload=d0)
    if max_ring_size is not None and best.ring_size > max_ring_size:
        r = minimal_ratio_for_ring(length, max_ring_size, capacity=capacity, cost_model=cost_model,
                                   layers=l, align=align, in_flight=in_flight)
        if r is not None:
            best = OffloadDecision(
                ring_size=max_ring_size, offload_ratio=r, ring_size_without_offload=d0,
                overlap_ok=r <= r_max + _EPS,
            )
    return best


def fits_at_all(length: int, *, capacity: int, layers: int, cost_model: CostModel, max_ring_size: int,
                offload: bool, align: int = 1, in_flight: int = 1) -> bool:
    """Whether ``length`` fits on ``max_ring_size`` ranks at all (full offload if allowed, within
    the host budget)."""
    if offload and layers > 2:
        r = minimal_ratio_for_ring(length, max_ring_size, capacity=capacity, cost_model=cost_model,
                                   layers=layers, align=align, in_flight=in_flight)
        return r is not None
    return fits_on_ring(length, max_ring_size, capacity=capacity, layers=layers, offload_ratio=0.0, align=align) and (
        math.ceil(cost_model.activation_bytes(length) / cost_model.activation_bytes(capacity) - _EPS) <= max_ring_size
    )


def max_fitting_length(*, capacity: int, layers: int, cost_model: CostModel, max_ring_size: int,
                       offload: bool, align: int = 1, in_flight: int = 1) -> int:
    """The longest sequence :func:`fits_at_all` accepts (binary search; fitting is monotone)."""
    lo, hi = 0, max(1, capacity) * max_ring_size * max(1, layers) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits_at_all(mid, capacity=capacity, layers=layers, cost_model=cost_model,
                       max_ring_size=max_ring_size, offload=offload, align=align, in_flight=in_flight):
            lo = mid
        else:
            hi = mid
    return lo
