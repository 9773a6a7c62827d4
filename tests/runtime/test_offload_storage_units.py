"""`OffloadedStorage` piece by piece, with a stand-in owner that records every call.

The layer-level tests (test_runtime_offload_storage.py) see only what a toy model's backward
reads: bytes that reach the host twice, a tail re-cloned for nothing, a host buffer larger than
asked for, a buffer released before its copy has finished, or a device argument dropped (all
of which are wrong only on a GPU or only for memory) pass them. Here the owner's pool, copies
and device accounting are recorded, so each of those is a failed assertion. The ``meta``
device stands in for a GPU: a tensor built without its device lands on the CPU, and mixing the
two raises.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bytescale.runtime.offload_storage import OffloadedStorage, SavedActivation, storage_bytes


class Owner:
    """The few things OffloadedStorage asks of its ActivationOffloader, recorded."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.acquired: list[int] = []  # sizes asked of the host pool
        self.released: list[tuple[torch.Tensor, object]] = []  # (buffer, the event it waits for)
        self.tracked: list[torch.Tensor] = []
        self.untracked: list[torch.Tensor] = []
        self.events: list[object] = []
        self.pool = SimpleNamespace(acquire=self._acquire, release=self._release)
        self.transfers = SimpleNamespace(to_host=self._copy, to_device=self._copy, wait=lambda e: None)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        self.acquired.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _release(self, buffer: torch.Tensor, ready: object = None) -> None:
        self.released.append((buffer, ready))

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, **kw) -> object:
        if src.device.type != "meta" and dst.device.type != "meta":
            dst.copy_(src)
        event = object()
        self.events.append(event)
        return event

    def track_storage(self, tensor: torch.Tensor) -> None:
        self.tracked.append(tensor)

    def untrack_storage(self, tensor: torch.Tensor) -> None:
        if tensor is None:
            raise AssertionError("untrack_storage(None)")
        self.untracked.append(tensor)


def micro_batch(device: str = "cpu") -> SimpleNamespace:
    counters = SimpleNamespace(offloaded_bytes=0, offloaded_tensors=0, reloaded_bytes=0, on_demand_reloads=0)
    return SimpleNamespace(owner=Owner(device), counters=counters, reload_layer=lambda *a, **k: None)


def layout(record: OffloadedStorage) -> list[tuple[int, int, str]]:
    return sorted((p.start, p.end, "host" if p.on_host else "tail") for p in record.pieces)


def values(n: int = 64) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 1.5 + 1.0  # 4 bytes per element


def test_storage_bytes_is_a_flat_byte_view_on_the_storages_device():
    data = values(8)
    flat = storage_bytes(data.untyped_storage(), data.device)
    assert flat.shape == (32,) and flat.dtype == torch.uint8 and flat.data_ptr() == data.data_ptr()
    meta = torch.empty(8, device="meta")
    assert storage_bytes(meta.untyped_storage(), meta.device).device.type == "meta"


def test_is_storage_tells_two_live_storages_apart():
    a, b = values(8), values(8)
    record = OffloadedStorage(micro_batch(), a.untyped_storage(), layer=0)
    assert record.is_storage(a.untyped_storage())
    assert record.is_storage(a[2:].untyped_storage())  # a view of the same storage
    assert not record.is_storage(b.untyped_storage())


def test_unheld_bytes_counts_only_the_gaps_inside_the_span():
    data = values(64)  # 256 bytes
    record = OffloadedStorage(micro_batch(), data.untyped_storage(), layer=0)
    record.cover(data[4:8], host_bytes=0)  # a tail over bytes [16, 32)
    record.cover(data[25:50], host_bytes=0)  # [100, 200)
    assert layout(record) == [(16, 32, "tail"), (100, 200, "tail")]
    assert record.unheld_bytes(0, 64) == 16 + 32  # [0, 16) and [32, 64)
    assert record.unheld_bytes(0, 50) == 16 + 18  # a piece after the span adds nothing
    assert record.unheld_bytes(0, 16) == 16
    assert record.unheld_bytes(16, 32) == 0
    assert record.unheld_bytes(120, 256) == 56  # a piece before the span adds nothing


def test_a_tail_that_a_later_view_wants_on_the_host_is_copied_out_once():
    data = values(64)
    raw = storage_bytes(data.untyped_storage(), data.device).clone()
    mb = micro_batch()
    owner = mb.owner
    record = OffloadedStorage(mb, data.untyped_storage(), layer=0)
    first = data[0:32]  # bytes [0, 128), all kept on the device
    record.cover(first, host_bytes=0)
    assert layout(record) == [(0, 128, "tail")] and owner.acquired == []
    old_tail = record.pieces[0].tail
    second = data[16:48]  # bytes [64, 192): its first 64 on the host
    record.cover(second, host_bytes=64)
    # [64, 128) left the old tail for the host; [0, 64) and [128, 192) stay in two tails
    assert layout(record) == [(0, 64, "tail"), (64, 128, "host"), (128, 192, "tail")]
    assert owner.acquired == [64]  # one host buffer, exactly the bytes asked for
    assert len(owner.untracked) == 1 and owner.untracked[0] is old_tail
    assert mb.counters.offloaded_bytes == 64 and mb.counters.offloaded_tensors == 1
    for p in record.pieces:  # every piece holds the storage's own bytes
        held = p.host if p.on_host else p.tail
        assert torch.equal(held, raw[p.start:p.end]), (p.start, p.end)
    data.zero_()  # the original may be reused once offloaded: only the pieces count now
    record.reload()
    assert mb.counters.reloaded_bytes == 64
    rebuilt = [record.view(t.dtype, tuple(t.shape), t.stride(), t.storage_offset() * 4) for t in (first, second)]
    assert torch.equal(rebuilt[0], values(64)[0:32]) and torch.equal(rebuilt[1], values(64)[16:48])
    assert rebuilt[0].untyped_storage().data_ptr() == rebuilt[1].untyped_storage().data_ptr()


@pytest.mark.parametrize("first, second, host_bytes", [
    ((32, 64), (0, 32), 128),  # a tail that starts where the new host bytes end
    ((0, 32), (32, 64), 128),  # a tail that ends where the new host bytes start
    ((0, 64), (16, 32), 0),  # no host bytes asked: a tail across the span stays whole
])
def test_tails_outside_the_new_host_bytes_are_left_alone(first, second, host_bytes):
    data = values(64)
    mb = micro_batch()
    record = OffloadedStorage(mb, data.untyped_storage(), layer=0)
    record.cover(data[first[0]:first[1]], host_bytes=0)
    before = [(p.start, p.end, p.tail) for p in record.pieces]
    record.cover(data[second[0]:second[1]], host_bytes=host_bytes)
    assert mb.owner.untracked == []
    kept = [(p.start, p.end, p.tail) for p in record.pieces if not p.on_host]
    assert len(kept) == len(before) and all(k[2] is b[2] for k, b in zip(kept, before))


def test_views_rebuild_with_their_stride_and_an_offset_past_the_first_bytes():
    data = values(64)
    mb = micro_batch()
    record = OffloadedStorage(mb, data.untyped_storage(), layer=0)
    late = data[40:64].view(4, 6).t()  # bytes [160, 256), strided (1, 6)
    record.cover(late, host_bytes=96)  # all on the host
    expected = late.clone()
    data.zero_()
    record.reload()
    assert record.full.numel() == 256 - 128  # from the aligned base below byte 160, nothing more
    view = record.view(late.dtype, tuple(late.shape), late.stride(), late.storage_offset() * 4)
    assert view.stride() == (1, 6) and torch.equal(view, expected)


def test_make_resident_releases_each_host_buffer_after_its_copy_and_reads_the_original():
    data = values(64)
    mb = micro_batch()
    owner = mb.owner
    record = OffloadedStorage(mb, data.untyped_storage(), layer=0)
    record.cover(data[0:32], host_bytes=64)  # [0, 64) host, [64, 128) tail
    host = [p for p in record.pieces if p.on_host][0]
    tail = [p for p in record.pieces if not p.on_host][0].tail
    record.make_resident(data)
    assert len(owner.released) == 1
    buffer, ready = owner.released[0]
    assert buffer is host.buffer and ready is host.event and ready is not None
    assert len(owner.untracked) == 1 and owner.untracked[0] is tail
    assert not record.needs_reload and record.pieces == []
    view = record.view(torch.float32, (8,), (1,), 16 * 4)
    assert view.data_ptr() == data[16:].data_ptr()


def test_every_buffer_and_view_lives_on_the_owners_device():
    """On the meta device (a stand-in for a GPU) nothing may fall back to the CPU."""
    data = torch.empty(64, device="meta")
    mb = micro_batch("meta")
    record = OffloadedStorage(mb, data.untyped_storage(), layer=0)
    record.cover(data[0:32], host_bytes=64)
    assert all(p.tail.device.type == "meta" for p in record.pieces if not p.on_host)
    record.reload()
    assert record.full.device.type == "meta"
    assert record.view(torch.float32, (8,), (1,), 0).device.type == "meta"
    kept = OffloadedStorage(micro_batch("meta"), data.untyped_storage(), layer=0)
    kept.make_resident(data)
    assert kept.full.device.type == "meta"


def test_a_kept_activation_untracks_only_what_it_tracked():
    mb = micro_batch()
    untracked = SavedActivation(mb, values(8), layer=0, tracked=False)
    del untracked
    assert mb.owner.tracked == [] and mb.owner.untracked == []
    tracked = SavedActivation(mb, values(8), layer=0, tracked=True)
    del tracked
    assert len(mb.owner.tracked) == 1 and len(mb.owner.untracked) == 1
