"""``testing.host_sync``: the CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``.

The spawned tests (two-level ring, micro-batch loop, iterator step) rely on it to see the host
syncs a GPU would make; here it is shown to catch each kind, and to stay quiet otherwise.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_bytescale.runtime.backends.base import host_to_device
from megatron_bytescale.testing.host_sync import HostSyncError, host_syncs


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.item(),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: int(t),
        lambda t: float(t),
        lambda t: bool(t),
        lambda t: [0, 1][t],
        lambda t: t.cpu(),
        lambda t: t.to("cpu"),
        lambda t: t.to(device="cpu"),
    ],
)
def test_every_read_back_is_refused(read):
    t = torch.ones((), dtype=torch.long)
    with pytest.raises(HostSyncError, match="read Tensor"):
        with host_syncs("raise"):
            read(t)


def test_blocking_copies_to_a_device_count_non_blocking_ones_do_not():
    idx, x = torch.arange(4), torch.zeros(4, 2)
    with host_syncs("count") as seen:
        idx.to(x.device)  # the two-level ring's old per-layer copy
        idx.to(x)
        torch.tensor([1, 2], device=x.device)
        idx.to(x.device, non_blocking=True)
        idx.to(torch.float32)  # a dtype change is no copy to a device
        host_to_device(idx, x.device)  # on CPU: the tensor itself
        x.index_select(0, idx)
    assert [c.split(" at ")[0] for c in seen.calls] == [
        "blocking copy Tensor.to", "blocking copy Tensor.to",
        "blocking copy torch.tensor(device=...)",
    ]  # fmt: skip
    assert all("test_host_sync_guard.py" in c for c in seen.calls)


def test_one_host_copy_is_one_read_and_other_threads_are_not_watched():
    table = torch.arange(6, dtype=torch.uint8).view(2, 3)
    with host_syncs("count") as seen:
        rows = table.cpu().numpy()  # one D2H copy, then host values
        worker = threading.Thread(target=lambda: table.tolist())
        worker.start()
        worker.join()
    assert len(seen.calls) == 1 and seen.calls[0].startswith("read Tensor.cpu")
    assert rows.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_everything_is_restored():
    names = ("item", "tolist", "cpu", "to", "__bool__")
    before = {n: getattr(torch.Tensor, n) for n in names}
    factory = torch.tensor
    with pytest.raises(HostSyncError):
        with host_syncs():
            torch.ones(()).item()
    assert {n: getattr(torch.Tensor, n) for n in names} == before and torch.tensor is factory
    with pytest.raises(ValueError, match="mode"):
        with host_syncs("warn"):
            pass
