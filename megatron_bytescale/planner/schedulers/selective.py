"""Selective offload (paper §5.2): offload a long sequence only where that shortens the step.

Eq. 3 gives the *fewest* ranks a long sequence may use, by offloading part of its activations.
Fewer ranks cost fewer rank-seconds of ring communication, but each member runs longer (a larger
share) and, with PP, every pipeline of the ring pays that longer micro-batch in its 1F1B fill and
drain. So offload is a per-sequence choice, not a mode: :func:`unit_options` hands ``balance``
up to three sets of units that differ only in their long sequences, and ``balance`` plans each
and keeps the fastest by the cost model (widening may still give any of them more ranks):

* ``eq3``: every long sequence on Eq. 3's minimal offloaded ring (what ``naive`` + offload runs);
* ``no-offload``: every long sequence on its offload-free ring D0 (the offload-off plan), except
  the ones that need offload to fit the HDP ranks at all, which keep Eq. 3's ring;
* ``selective``: per sequence, Eq. 3's ring only if it costs fewer rank-seconds than D0 *and*
  its member time stays under the step's per-micro-batch target (the lower bound over the
  pipelines' stage count, as in widening), so it lowers the work bound without raising the
  critical path; D0 otherwise.

With a host budget Eq. 3's rings already respect it (:func:`..offload.solve_offload` moves to a
larger ring when a ratio would not fit), and offload-free rings need none, so every set fits.
Because ``no-offload`` is exactly the offload-off input, balance with offload allowed is never
slower, by the estimate, than balance with it disallowed.
"""

from __future__ import annotations

from ..sharding import ShardingContext, Unit, shard_batch
from ._common import PlanRequest


def unit_options(request: PlanRequest) -> list[tuple[str, ShardingContext, list[Unit]]]:
    """``(name, context, units)`` per distinct unit set, the likeliest winner first.

    Without offload (or when Eq. 3 offloads nothing) there is one set; the offload-free set is
    planned with the offload-off context, so it is the very input ``balance`` gets with offload
    off."""
    ctx = request.sharding_context()
    eq3 = shard_batch(request.ids, request.lengths, ctx)
    if not request.offload or not any(u.offload_ratio > 0 for u in eq3):
        return [("eq3" if request.offload else "no-offload", ctx, eq3)]
    n = request.hdp_size
    ctx_off = request.sharding_context(offload=False)
    eq3_of = {u.seqs: u for u in eq3}
    free_all = shard_batch(request.ids, request.lengths, ctx_off)
    forced = [u.ring_size > n for u in free_all]  # only offload fits these on the HDP ranks
    free = [eq3_of[u.seqs] if f else u for u, f in zip(free_all, forced)]
    free_ctx = ctx if any(forced) else ctx_off
    target = sum(u.work for u in free) / n / request.pp_size
    selective = []
    for u in free:
        e = eq3_of[u.seqs]
        pick = e.offload_ratio > 0 and e is not u and e.work < u.work and e.time <= target
        selective.append(e if pick else u)
    # identical sets are planned once, under the offload-free context when that is one of them
    options, seen = {}, set()
    for name, c, units in (("no-offload", free_ctx, free), ("eq3", ctx, eq3), ("selective", ctx, selective)):
        key = tuple((u.seqs, u.ring_size, u.offload_ratio) for u in units)
        if key not in seen:
            seen.add(key)
            options[name] = (name, c, units)
    return [options[k] for k in ("selective", "no-offload", "eq3") if k in options]
