"""Selective offload (paper §5.2): offload a long sequence only where that shortens the step.

Eq. 3 gives the *fewest* ranks a long sequence may use, by offloading part of its activations.
Fewer ranks cost fewer rank-seconds of ring communication, but each member runs longer (a larger
share) and, with PP, every pipeline of the ring pays that longer micro-batch in its 1F1B fill and
drain; on the H100 preset Alg. 1 with Eq. 3's rings is 2.2-7.4x slower than without offload at the
Fig. 17 PP cells. So offload is a choice, made by the cost model. :func:`unit_options` hands
``balance`` up to two sets of units that differ only in their long sequences:

* ``no-offload``: every long sequence on its offload-free ring D0, except the ones that need
  offload to fit the HDP ranks at all, which keep Eq. 3's ring;
* ``eq3``: every long sequence on Eq. 3's minimal offloaded ring (what ``naive`` + offload runs).

``balance`` then chooses per sequence in each set: widening (:mod:`.widen`) moves any long
sequence slower than the step's target to a wider ring, anywhere from its set's size up to all
HDP ranks, with the smallest offload ratio that ring needs (none from D0 on). Every set is
planned and the fastest plan by the estimate is kept, the offload-free one on a tie. Because
``no-offload`` is exactly the offload-off input, balance with offload allowed is never slower,
by the estimate, than balance with it disallowed, and never slower than ``naive`` with or
without Eq. 3's rings (both fills are candidates).

A third set was tried and left out: per sequence, Eq. 3's ring where it costs fewer
rank-seconds than D0 and stays under the step's per-micro-batch target. It was never the
fastest on the Fig. 17 cells (0-61 % slower than the better of the two sets, DP and PP, both
hardware presets): it mixes ring sizes that align badly and leaves large single units to the greedy.

With a host budget Eq. 3's rings already respect it (:func:`..offload.solve_offload` moves to a
larger ring when a ratio would not fit), and offload-free rings need none, so every set fits.
"""

from __future__ import annotations

from ..sharding import ShardingContext, Unit, shard_batch
from ._common import PlanRequest


def unit_options(request: PlanRequest) -> list[tuple[str, ShardingContext, list[Unit]]]:
    """``(name, context, units)`` per distinct unit set, the offload-free one first.

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
    # the packs of short sequences are the same in both sets: shard only the long ones again
    long_ = [(i, s) for i, s in zip(request.ids, request.lengths) if s >= request.capacity]
    packs = [u for u in eq3 if max(u.lengths) < request.capacity]
    free_all = shard_batch([i for i, _ in long_], [s for _, s in long_], ctx_off) + packs
    forced = [u.ring_size > n for u in free_all]  # only offload fits these on the HDP ranks
    free = [eq3_of[u.seqs] if f else u for u, f in zip(free_all, forced)]
    free_ctx = ctx if any(forced) else ctx_off
    # identical sets are planned once, under the offload-free context when that is one of them
    options, seen = {}, set()
    for name, c, units in (("no-offload", free_ctx, free), ("eq3", ctx, eq3)):
        key = tuple((u.seqs, u.ring_size, u.offload_ratio) for u in units)
        if key not in seen:
            seen.add(key)
            options[name] = (name, c, units)
    return list(options.values())
