"""Activation offload, tested for classes of bugs rather than single cases (CPU, one process).

* **Fractional ratios**: ratios such as 1/3, 0.37 and 0.9 on row counts they do not divide;
  the bytes expected are written from an independent formula (the fewest whole rows holding
  at least ``r`` of them, in exact fractions), so rounding down, rounding to nearest or an
  off-by-one in the row count fails here even where 0.25 / 0.5 / 1 on 64 rows agree.
* **Reload order by stall counting**: stand-in events complete only once the backward has
  moved on by one layer (a backward pre-hook on every layer ticks a clock), as a real H2D copy
  finishes while the next layer computes. A reload started for the wrong layer, or too late,
  makes the compute stream wait on an incomplete event (a stall); one started too early
  arrives more than one layer ahead. Both are counted.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from megatron_bytescale.runtime import ActivationOffloader
from megatron_bytescale.runtime.offload_streams import HostEvent, HostStream, HostStreamOps
from offload_cases import TokenLayer

H, L = 16, 6  # the last 2 layers stay resident: layers 0..3 offload


ROW_BYTES = (10 * H + 2) * 4


def make_layers(n: int = L) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(TokenLayer(H) for _ in range(n))


def rows_offloaded(ratio: float, rows: int) -> int:
    """Independent of the code under test: ceil(r * rows) in exact arithmetic, r read as the
    decimal it was written as (0.37 is 37/100)."""
    exact = Fraction(ratio).limit_denominator(10**6) * rows
    return -(-exact.numerator // exact.denominator)


def step(layers, offloader, ratio, rows, seed=1):
    """Forward + backward of one micro-batch of ``rows`` tokens; returns the gradients."""
    for p in layers.parameters():
        p.grad = None
    x = torch.randn(rows, 1, H, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    context = offloader.micro_batch(ratio, num_tokens=rows) if offloader else torch.enable_grad()
    with context:
        h = x * 1.0
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    loss.backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("rows", [61, 50])
@pytest.mark.parametrize("ratio", [1 / 3, 0.37, 0.9, 0.05])
def test_fractional_ratios_offload_the_rows_an_exact_ceiling_gives(ratio, rows):
    layers = make_layers()
    reference = step(layers, None, ratio, rows)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = step(layers, offloader, ratio, rows)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    k = rows_offloaded(ratio, rows)
    assert 0 < k <= rows and (k - 1) < ratio * rows <= k + 1e-9  # the formula's own sanity
    assert stats.offloaded_bytes == stats.reloaded_bytes == (L - 2) * k * ROW_BYTES
    # Eq. 3: two layers stay whole, the other l - 2 keep their rows - k rows, plus the loss's h
    peak = rows * H * 4 + 2 * rows * ROW_BYTES + (L - 2) * (rows - k) * ROW_BYTES
    assert stats.peak_resident_bytes == peak


@pytest.mark.parametrize("ratio", [1 / 3, 0.37, 0.9])
def test_fractional_ratios_without_a_token_dimension_track_the_running_fraction(ratio):
    """Whole tensors (no token count given): after each tensor the bytes offloaded so far are
    the fewest whole tensors reaching ``r`` of the bytes seen so far."""
    layers = make_layers()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    x = torch.randn(50, 1, H).requires_grad_()
    with offloader.micro_batch(ratio):
        h = x * 1.0
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    loss.backward()
    # the saved tensors of one offloadable layer, in the order autograd saves them
    sizes = [50 * H, 50, 50, 50 * H, 50 * 4 * H, 50 * 4 * H]
    seen = moved = 0
    for size in sizes * (L - 2):
        seen += size * 4
        if moved < Fraction(ratio).limit_denominator(10**6) * seen:
            moved += size * 4
    assert offloader.end_step().offloaded_bytes == moved


# ------------------------------------------------------------------ reload order, by stalls
class Clock:
    """Counts layers whose backward has started (backward pre-hooks)."""

    def __init__(self, layers) -> None:
        self.ticks = 0
        for layer in layers:
            layer.register_full_backward_pre_hook(self._tick)

    def _tick(self, module, grad_output):
        self.ticks += 1


class LaggingEvent(HostEvent):
    """An H2D copy's event is complete once the backward moved on by a layer; D2H ones at once."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.issued, self.stream = clock, None, None

    def record(self, stream=None) -> None:
        super().record(stream)
        self.issued, self.stream = self.clock.ticks, getattr(stream, "name", None)

    def query(self) -> bool:
        return self.issued is not None and (self.stream != "h2d" or self.clock.ticks > self.issued)


class ComputeStream(HostStream):
    def __init__(self, clock: Clock) -> None:
        super().__init__("compute")
        self.clock, self.lags, self.stalls = clock, [], 0

    def wait_event(self, event) -> None:
        if getattr(event, "stream", None) == "h2d":
            self.lags.append(self.clock.ticks - event.issued)  # layers between start and use
            self.stalls += not event.query()


class LaggingOps(HostStreamOps):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self._compute = ComputeStream(clock)
        self._names = iter(("d2h", "h2d"))

    def new_stream(self) -> HostStream:
        return HostStream(next(self._names))

    def new_event(self, *, timing: bool = False) -> HostEvent:
        return HostEvent() if timing else LaggingEvent(self.clock)


@pytest.mark.parametrize("keep", [2, 3])
@pytest.mark.parametrize("ratio", [1.0, 0.37])
def test_every_reload_starts_exactly_one_layer_before_its_use(ratio, keep):
    layers = make_layers()
    clock = Clock(layers)
    ops = LaggingOps(clock)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0, stream_ops=ops,
                                    keep_resident_layers=keep)
    reference = step(layers, None, ratio, 61)
    clock.ticks = 0
    grads = step(layers, offloader, ratio, 61)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    compute = ops.current_stream()
    stats = offloader.end_step()
    offloadable = L - keep
    # one storage per saved tensor, six per layer; each waited for once
    assert len(compute.lags) == 6 * offloadable, compute.lags
    assert compute.stalls == 0, f"{compute.stalls} stalls: a reload started too late"
    assert set(compute.lags) == {1}, f"reload-to-use distances in layers: {sorted(set(compute.lags))}"
    assert stats.prefetched_reloads == 6 * offloadable and stats.on_demand_reloads == 0


def test_a_reload_started_late_is_counted_as_a_stall():
    """The stand-ins can see a stall: with reloads never prefetched (every layer's storages
    reloaded when first used), every wait is on an incomplete copy."""
    layers = make_layers()
    clock = Clock(layers)
    ops = LaggingOps(clock)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0, stream_ops=ops)
    x = torch.randn(61, 1, H).requires_grad_()
    with offloader.micro_batch(1.0, num_tokens=61) as mb:
        h = x * 1.0
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    mb.reload_layer = lambda layer, prefetch: None  # no prefetch at all: on demand only
    loss.backward()
    compute = ops.current_stream()
    assert compute.stalls == 6 * (L - 2) and set(compute.lags) == {0}
    assert offloader.end_step().on_demand_reloads == 6 * (L - 2)


class ScalarsAndRows(torch.nn.Module):
    """Saves the layer input x [T, 1, H], a 1-D per-token tensor [T] and a 0-D scalar."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_token = x.sum(dim=(1, 2)) * 1.0  # 1-D: its only dimension is the token dimension
        scale = x.mean() * 1.0  # 0-D: no rows, never worth a copy
        return x * scale + (per_token * per_token).reshape(-1, 1, 1)


@pytest.mark.parametrize("ratio", [0.37, 1.0])
def test_one_dimensional_token_rows_are_offloaded_and_scalars_never(ratio):
    layers = torch.nn.ModuleList([ScalarsAndRows() for _ in range(3)])  # layer 0 offloadable
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    reference = step(layers, None, ratio, 50)
    grads = step(layers, offloader, ratio, 50)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    k = rows_offloaded(ratio, 50)
    assert offloader.end_step().offloaded_bytes == k * H * 4 + k * 4  # x's rows, per_token's rows


def test_offload_micro_batch_is_a_no_op_without_an_offloader_or_autograd():
    from types import SimpleNamespace

    from megatron_bytescale.runtime import MicroBatchOffload, offload_micro_batch

    batch = SimpleNamespace(tokens=torch.zeros(10, dtype=torch.long), offload_ratio=0.5)
    with offload_micro_batch(None, batch):  # no offloader: nothing to do
        pass
    offloader = ActivationOffloader(make_layers(3))
    with torch.no_grad():  # an evaluation forward: autograd saves nothing
        assert not isinstance(offload_micro_batch(offloader, batch), MicroBatchOffload)
    assert offloader.end_step().micro_batches == 0
    context = offload_micro_batch(offloader, batch)
    assert isinstance(context, MicroBatchOffload) and context.num_tokens == 10
    assert offloader.end_step().micro_batches == 1


class _Saves(torch.autograd.Function):
    """``y = x * 1`` that saves ``extra`` for backward (as a kernel saves a small statistic)
    and checks there that it reads back what was saved."""

    @staticmethod
    def forward(ctx, x, extra):
        ctx.save_for_backward(extra)
        ctx.expected = extra.detach().clone().view(torch.uint8)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        (extra,) = ctx.saved_tensors
        assert torch.equal(extra.view(torch.uint8), ctx.expected)
        return grad, None


class SavesOne(torch.nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Saves.apply(x, self.make(x))


@pytest.mark.parametrize("what, make, offloaded", [
    # one byte of a floating dtype (a float8 scale): worth a copy when min_tensor_bytes is 0
    ("one byte", lambda x: (x.detach().reshape(-1)[:1] * 1.0).to(torch.float8_e4m3fn), 1),
    # an empty column slice of a [T, H] tensor: zero bytes, yet its storage span covers
    # (T - 1) * H elements; copying that span would move bytes nothing reads
    ("empty view", lambda x: (x.detach()[:, 0, :] * 1.0)[:, :0], 0),
])
def test_a_saved_tensor_is_worth_a_copy_only_if_it_holds_bytes(what, make, offloaded):
    layers = torch.nn.ModuleList([SavesOne(make) for _ in range(3)])  # layer 0 offloadable
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    reference = step(layers, None, 1.0, 50)
    grads = step(layers, offloader, 1.0, 50)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert offloader.end_step().offloaded_bytes == offloaded, what
