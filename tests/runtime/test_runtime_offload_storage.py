"""Offload by storage: views that share a storage are copied once, reloaded once, rebuilt.

megatron-core's attention saves its output ``[s, np, hn]`` and ``linear_proj`` saves the
``[s, 1, h]`` view of it: two saved tensors, one storage. The toy layer below has that pair
(``tanh`` saves its result, the ``Linear`` the 2-D view of it). Expectations are written from
the shapes (bytes = rows x H x 4), and the storages that backward reads are looked at through
autograd's own saved-tensor attributes, not through the offloader.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from megatron_bytescale.runtime import ActivationOffloader
from megatron_bytescale.runtime.offload_streams import HostEvent, HostStreamOps
from offload_cases import LoggedStream

T, H, HEADS, L = 64, 32, 4, 4  # 4 layers, the last 2 resident: layers 0 and 1 offloadable


class AttentionProjection(torch.nn.Module):
    """The attention output and linear_proj's view of it, as in megatron-core."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x.view(T, HEADS, H // HEADS))  # saves its result: [s, np, hn]
        return x + self.proj(out.view(T, 1, H))  # saves out's [s, h] view (same storage)


def make_layers(n: int = L) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(AttentionProjection() for _ in range(n))


def forward(layers, x0, offloader, ratio):
    x = x0.clone().requires_grad_()
    context = offloader.micro_batch(ratio, num_tokens=T) if offloader else torch.enable_grad()
    with context:
        h = x * 1.0  # an embedding's output: not a leaf
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    return x, loss


def gradients(layers, x0, offloader, ratio):
    for p in layers.parameters():
        p.grad = None
    x, loss = forward(layers, x0, offloader, ratio)
    loss.backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


def saved_pairs(loss) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, last first: (tanh's saved result, the projection's saved input), unpacked."""
    results, inputs, seen, todo = [], [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "TanhBackward0":
            results.append(node._saved_result)
        if type(node).__name__ == "AddmmBackward0":
            inputs.append(node._saved_mat1)
        todo.extend(n for n, _ in node.next_functions)
    assert len(results) == len(inputs) == L
    pairs = []
    for r in results:
        match = [i for i in inputs if torch.equal(i.reshape(-1), r.reshape(-1))]
        assert len(match) == 1
        pairs.append((r, match[0]))
    return pairs


@pytest.fixture(scope="module")
def x0():
    return torch.randn(T, 1, H, generator=torch.Generator().manual_seed(3))


def offloaded_rows(ratio: float, rows: int) -> int:
    """The independent formula: the fewest whole rows holding at least ratio * rows."""
    exact = Fraction(ratio).limit_denominator(10**6) * rows
    return -(-exact.numerator // exact.denominator)


@pytest.mark.parametrize("ratio", [1.0, 0.37, 1 / 3])
def test_a_storage_saved_through_two_views_is_copied_and_reloaded_once(x0, ratio):
    layers = make_layers()
    reference = gradients(layers, x0, None, ratio)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = gradients(layers, x0, offloader, ratio)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference)), "gradients must be bit-identical"
    stats = offloader.end_step()
    per_layer = offloaded_rows(ratio, T) * H * 4  # the attention output's rows, once
    assert stats.offloaded_bytes == stats.reloaded_bytes == (L - 2) * per_layer
    assert stats.offloaded_tensors == L - 2  # one D2H copy per storage
    assert stats.prefetched_reloads == L - 2 and stats.on_demand_reloads == 0
    assert offloader.resident_bytes == 0


@pytest.mark.parametrize("ratio", [1.0, 0.37])
def test_backward_reads_both_views_from_one_reloaded_storage(x0, ratio):
    layers = make_layers()
    _, reference_loss = forward(layers, x0, None, ratio)
    expected = [(r.clone(), i.clone()) for r, i in saved_pairs(reference_loss)]
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    _, loss = forward(layers, x0, offloader, ratio)
    pairs = saved_pairs(loss)  # unpacks: reloads every offloaded storage
    storages = set()
    for (result, flat), (want_result, want_flat) in zip(pairs, expected):
        assert torch.equal(result, want_result) and torch.equal(flat, want_flat)
        assert result.shape == (T, HEADS, H // HEADS) and flat.shape == (T, H)
        assert result.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        storages.add(result.untyped_storage().data_ptr())
        # the rebuilt storage holds the tensor once (not a copy per view)
        assert result.untyped_storage().nbytes() == T * H * 4
    assert len(storages) == L
    loss.backward()
    stats = offloader.end_step()
    assert stats.offloaded_bytes == stats.reloaded_bytes == (L - 2) * offloaded_rows(ratio, T) * H * 4


class SharedRegion(torch.nn.Module):
    """Saves two views of one fresh storage ``y`` [T, 1, H]: the first half rows (no token
    dimension: it goes whole by the running fraction) and then all of ``y`` (token rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        top = torch.sin(y[: T // 2])  # saves the view y[:T/2]
        return torch.cat([top, y[T // 2:]]) * torch.cos(y)  # cos saves y; mul saves both


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_each_byte_of_a_shared_storage_goes_to_the_host_once(x0, ratio):
    """A byte goes to the host when any view's rows ask for it, and only once."""
    layers = torch.nn.ModuleList([SharedRegion() for _ in range(3)])  # layer 0 offloadable
    reference = gradients(layers, x0, None, ratio)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = gradients(layers, x0, offloader, ratio)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    row = H * 4
    y_rows = max(T // 2, offloaded_rows(ratio, T))  # the half view whole, y's rows: the union
    own = 2 * offloaded_rows(ratio, T)  # cat's and cos's outputs: storages of their own
    assert stats.offloaded_bytes == stats.reloaded_bytes == (y_rows + own) * row


class MakesY(torch.nn.Module):
    def __init__(self, box: list) -> None:
        super().__init__()
        self.box = box

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x * 0.5)  # exp saves its result y
        self.box.append(y)
        return x + y


class UsesY(MakesY):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.box.pop().view(T, 1, H)  # saves a view of y


def test_a_view_kept_resident_keeps_its_whole_storage_resident(x0):
    """Layer 0 offloads ``y``; the last layer (never offloaded) saves a view of it. Offloading
    would free nothing while that view holds the storage: every view reads the original, the
    host copy is dropped and nothing is reloaded."""
    box: list = []
    layers = torch.nn.ModuleList([MakesY(box), torch.nn.Identity(), torch.nn.Identity(),
                                  UsesY(box)])
    reference = gradients(layers, x0, None, 1.0)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = gradients(layers, x0, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    assert stats.offloaded_bytes == T * H * 4  # copied before the resident view came
    assert stats.reloaded_bytes == 0 and stats.prefetched_reloads + stats.on_demand_reloads == 0
    assert offloader.pool.in_use_bytes == 0 and offloader.resident_bytes == 0


class ReusesAnAddress(torch.nn.Module):
    """Saves ``a``, a tensor over a buffer's memory, lets ``a``'s storage die, then saves ``b``:
    a new storage at the same address (as the caching allocator hands out a freed block again
    within one forward). ``torch.frombuffer`` makes the reuse certain: both storages are views
    of ``memory``, not of blocks the allocator may or may not reuse."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = bytearray(T * H * 4)
        self.values: list[torch.Tensor] = []
        self.addresses: list[int] = []

    def _over_memory(self, seed: int) -> torch.Tensor:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that a bytearray is writable
            t = torch.frombuffer(self.memory, dtype=torch.float32).view(T, 1, H)
        t.copy_(torch.randn(T, 1, H, generator=torch.Generator().manual_seed(seed)))
        self.values.append(t.clone())
        self.addresses.append(t.untyped_storage().data_ptr())
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = (x * self._over_memory(1)).sum()  # mul saves a (needed for x's gradient)
        # a is gone: its storage died (the offloader holds only its host copy)
        second = (x * self._over_memory(2)).sum()  # b: same address, another storage
        return first + second


def test_a_new_storage_at_a_freed_storages_address_is_offloaded_on_its_own():
    """Storages are told apart by identity, not only address: ``b`` (at the address of ``a``,
    which died in the same forward) gets its own copy and backward reads ``b``'s values, not
    those of ``a``'s copy."""
    layer = ReusesAnAddress()
    layers = torch.nn.ModuleList([layer, torch.nn.Identity(), torch.nn.Identity()])  # layer 0 offloadable
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with offloader.micro_batch(1.0, num_tokens=T):
        loss = layers[0](x * 1.0)
    assert layer.addresses[0] == layer.addresses[1]  # the case under test happened
    loss.backward()
    a, b = layer.values
    assert not torch.equal(a, b)
    assert torch.equal(x.grad, a + b), "backward must read each storage's own values"
    stats = offloader.end_step()
    assert stats.offloaded_tensors == 2 and stats.offloaded_bytes == stats.reloaded_bytes == 2 * T * H * 4
    assert stats.prefetched_reloads + stats.on_demand_reloads == 2


# ------------------------------------------------------------- the CUDA stream path's ordering
class Recorder(HostStreamOps):
    """Host stand-ins that log every stream operation (the order the CUDA path would run)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self._compute = LoggedStream(self.log, "compute")
        self._names = iter(("d2h", "h2d"))
        self.events = 0

    def new_stream(self):
        return LoggedStream(self.log, next(self._names))

    def new_event(self, *, timing: bool = False):
        self.events += 1
        return _LoggedEvent(self.log, f"e{self.events}")

    def record_stream(self, tensor, stream) -> None:
        self.log.append(("record_stream", stream.name, tensor.untyped_storage().data_ptr()))


class _LoggedEvent(HostEvent):
    def __init__(self, log, name) -> None:
        super().__init__()
        self.log, self.name = log, name

    def record(self, stream=None) -> None:
        super().record(stream)
        self.log.append(("record", stream.name, self.name))


def test_the_stream_path_copies_a_shared_storage_once_and_orders_its_reload(x0):
    """With the CUDA path's ordering (host stand-ins that log it): one D2H copy per storage
    that protects the original storage, one H2D copy that waits for it, and the compute stream
    waits for that copy before either view is used."""
    layers = make_layers(3)  # layer 0 offloadable
    ops = Recorder()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0, stream_ops=ops)
    x, loss = forward(layers, x0, offloader, 1.0)
    d2h = [e for e in ops.log if e[:2] == ("record", "d2h")]
    assert len(d2h) == 1  # layer 0's attention output, once for both views
    i = ops.log.index(d2h[0])
    assert ops.log[i - 1][:2] == ("record_stream", "d2h")  # the source storage is protected
    assert ("wait_stream", "d2h", "compute") in ops.log[:i]
    loss.backward()
    h2d = [e for e in ops.log if e[:2] == ("record", "h2d")]
    assert len(h2d) == 1
    j = ops.log.index(h2d[0])
    assert ("wait_event", "h2d", d2h[0][2]) in ops.log[i:j]  # the host copy is complete first
    waits = [k for k, e in enumerate(ops.log) if e == ("wait_event", "compute", h2d[0][2])]
    assert len(waits) == 1 and waits[0] > j  # the compute stream waited, once, for both views
    stats = offloader.end_step()
    assert stats.offloaded_bytes == stats.reloaded_bytes == T * H * 4
