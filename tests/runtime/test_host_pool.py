"""The pinned host pool counts what it really pins: power-of-two slabs, carved (host_pool.py).

PyTorch's pinned allocator rounds every block up to a power of two; the pool asks only for
powers of two, so ``capacity_bytes`` equals the bytes pinned (checked against torch's own host
statistics where CUDA exists, against the arithmetic otherwise), and it stays under the host
budget the planner used for Eq. 3.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_bytescale.runtime.host_pool import ALIGN, HostBufferPool, pinned_bytes


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _overlaps(buffers) -> bool:
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers)
    return any(a[1] > b[0] for a, b in zip(spans, spans[1:]))


def test_pinned_bytes_is_torchs_power_of_two_rounding():
    assert [pinned_bytes(n) for n in (1, 2, 3, 4096, 4097, 3 << 20)] == [
        1, 2, 4, 4096, 8192, 4 << 20]  # fmt: skip


def test_slabs_are_powers_of_two_and_capacity_is_their_sum():
    pool = HostBufferPool(pin_memory=False, min_slab_bytes=1 << 16)
    rng = random.Random(3)
    requests = [rng.randint(1, 50_000) for _ in range(40)]
    live = [pool.acquire(n) for n in requests]
    assert all(pinned_bytes(s) == s for s in pool.slab_sizes)
    assert pool.capacity_bytes == sum(pool.slab_sizes) == sum(s.numel() for s in pool._slabs)
    assert not _overlaps(live)
    assert all(b.numel() % ALIGN == 0 for b in live)
    assert pool.in_use_bytes == sum(b.numel() for b in live) <= pool.capacity_bytes
    # one pinned block per request (the old pool) would have pinned each rounded up to a power
    # of two; the slabs pin no more than that
    assert pool.capacity_bytes <= sum(pinned_bytes(max(n, ALIGN)) for n in requests)


def test_buffers_come_back_merged_and_the_pool_stops_growing():
    pool = HostBufferPool(pin_memory=False, min_slab_bytes=1 << 16)
    sizes = [9000, 20000, 700, 31000, 4096, 12345]
    for step in range(5):
        taken = [pool.acquire(n) for n in sizes]  # forward: offload layer by layer
        for b in reversed(taken):  # backward: reload in reverse
            pool.release(b)
        if step == 0:
            first = (pool.capacity_bytes, pool.allocations)
    assert (pool.capacity_bytes, pool.allocations) == first
    assert pool.in_use_bytes == 0 and all(len(f) == 1 for f in pool._free), pool._free


def test_pending_copies_keep_their_extent():
    pool = HostBufferPool(pin_memory=False, min_slab_bytes=1 << 12)
    a = pool.acquire(4096)
    event = _Event()
    pool.release(a, ready=event)
    b = pool.acquire(4096)
    assert not _overlaps([a, b]) and pool.allocations == 2
    event.done = True
    pool.release(b)
    c = pool.acquire(4096)
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr()) and pool.allocations == 2
    with pytest.raises(ValueError, match="not acquired"):
        pool.release(torch.empty(8, dtype=torch.uint8))


def test_the_host_budget_caps_the_slabs():
    limit = 3_000_000  # not a power of two: slabs of 2 MiB + 512 KiB + ... stay under it
    pool = HostBufferPool(pin_memory=False, limit_bytes=limit, min_slab_bytes=1 << 16)
    live = [pool.acquire(200_000) for _ in range(12)]  # 2.4 MB in flight
    assert pool.capacity_bytes <= limit and pool.over_limit_bytes == 0, pool.slab_sizes
    assert all(pinned_bytes(s) == s for s in pool.slab_sizes)
    more = [pool.acquire(400_000) for _ in range(2)]  # past the budget: served, and counted
    assert pool.over_limit_bytes > 0 and pool.capacity_bytes > limit
    assert not _overlaps(live + more)
    with pytest.raises(ValueError, match="limit_bytes"):
        HostBufferPool(pin_memory=False, limit_bytes=0)
    with pytest.raises(ValueError, match="power of two"):
        HostBufferPool(pin_memory=False, min_slab_bytes=3000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_capacity_equals_what_torch_pinned():
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    before = stats().get("allocated_bytes.current", stats().get("reserved_bytes.current", 0))
    pool = HostBufferPool(pin_memory=True)
    held = [pool.acquire(n) for n in (3 << 20, 5 << 20, 100, 1 << 20)]
    after = stats().get("allocated_bytes.current", stats().get("reserved_bytes.current", 0))
    assert after - before == pool.capacity_bytes, (after - before, pool.slab_sizes)
    assert all(b.is_pinned() for b in held)
