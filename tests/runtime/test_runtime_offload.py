"""The activation offload context on CPU (one process): gradients, memory, pool, ordering, errors.

The toy model's saved bytes are known exactly (see ``LAYER_SAVED_BYTES``), so the measured
peak of resident saved bytes is compared with what Eq. 3 says must stay on the device.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_bytescale.runtime import ActivationOffloader
from megatron_bytescale.runtime.offload_streams import HostEvent, HostStreamOps
from offload_cases import LoggedStream, TokenLayer

T, H, L = 64, 32, 6
# per layer: LayerNorm saves x [T,1,H], mean and rstd [T,1,1]; linear a its input [T,1,H];
# gelu its input [T,1,4H]; linear b its input [T,1,4H]: T * (10 H + 2) floats (weights excluded)
LAYER_SAVED_BYTES = T * (10 * H + 2) * 4
LOSS_SAVED_BYTES = T * H * 4  # (h * h).sum() saves h twice: one tensor


def make_layers(n: int = L) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(TokenLayer(H) for _ in range(n))


def run_step(layers, x0, offloader, ratios, *, interleave=False):
    """Forward + backward of ``len(ratios)`` micro-batches; returns the gradients."""
    for p in layers.parameters():
        p.grad = None
    inputs = [(x0 * (i + 1)).requires_grad_() for i in range(len(ratios))]
    losses = []
    for x, r in zip(inputs, ratios):
        context = offloader.micro_batch(r, num_tokens=T) if offloader else _null()
        with context:
            h = x * 1.0  # as an embedding would: the first layer's input is not a leaf
            for layer in layers:
                h = layer(h)
            loss = (h * h).sum()
        if interleave:
            losses.append(loss)
        else:
            loss.backward()
    for loss in reversed(losses):  # pipeline-style: forwards first, backwards in reverse
        loss.backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone() for x in inputs]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def max_error(a, b) -> float:
    return max(float((x - y).abs().max()) / max(1e-30, float(y.abs().max())) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def x0():
    return torch.randn(T, 1, H, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0, 0.3])
def test_gradients_equal_the_run_without_offload(x0, ratio):
    layers = make_layers()
    reference = run_step(layers, x0, None, [ratio])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = run_step(layers, x0, offloader, [ratio])
    assert max_error(grads, reference) <= 1e-6
    stats = offloader.end_step()
    assert stats.offloaded_bytes == stats.reloaded_bytes
    assert (stats.offloaded_bytes > 0) == (ratio > 0)
    assert stats.on_demand_reloads == 0, "every reload should start one layer ahead"


def test_interleaved_micro_batches_with_different_ratios(x0):
    """Pipeline schedules run forwards of several micro-batches before their backwards."""
    layers = make_layers()
    reference = run_step(layers, x0, None, [0, 0, 0], interleave=True)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = run_step(layers, x0, offloader, [1.0, 0.0, 0.5], interleave=True)
    assert max_error(grads, reference) <= 1e-6
    stats = offloader.end_step()
    assert stats.micro_batches == 3
    offloadable = (L - 2) * LAYER_SAVED_BYTES
    assert stats.offloaded_bytes == offloadable + offloadable // 2


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_peak_resident_saved_bytes_drop_as_eq3_says(x0, ratio):
    layers = make_layers()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    run_step(layers, x0, offloader, [ratio])
    stats = offloader.end_step()
    offloaded_rows = math.ceil(ratio * T)
    # Eq. 3: two layers stay, the other l - 2 keep the fraction 1 - r (token rows)
    expected = LOSS_SAVED_BYTES + LAYER_SAVED_BYTES * 2 + (L - 2) * LAYER_SAVED_BYTES * (T - offloaded_rows) // T
    assert stats.peak_resident_bytes == expected
    assert offloader.resident_bytes == 0, "everything saved was released after backward"


def test_the_host_pool_stops_growing_after_the_first_step(x0):
    layers = make_layers()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    sizes = []
    for step in range(10):
        run_step(layers, x0, offloader, [1.0, 0.5])
        stats = offloader.end_step()
        sizes.append((stats.host_pool_bytes, offloader.pool.num_buffers, offloader.pool.allocations))
        assert stats.host_peak_bytes >= stats.offloaded_bytes // 2
    assert len(set(sizes)) == 1, sizes
    assert offloader.pool.in_use_bytes == 0


def test_a_tensor_saved_twice_is_offloaded_once_and_parameters_never(x0):
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(H, H) / H)

        def forward(self, x):
            y = x @ self.w.t()  # saves a view of the parameter
            return y * y  # saves y twice

    layers = torch.nn.ModuleList([Twice() for _ in range(3)])
    reference = run_step(layers, x0, None, [1.0])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = run_step(layers, x0, offloader, [1.0])
    assert max_error(grads, reference) <= 1e-6
    stats = offloader.end_step()
    # only layer 0 is offloadable (3 layers, 2 resident): x and y, each once; no weights
    assert stats.offloaded_tensors == 2
    assert stats.offloaded_bytes == 2 * T * H * 4


def test_parameters_moved_into_a_buffer_are_still_recognised(x0):
    """Megatron's DDP moves parameters into one contiguous buffer after the model is built."""
    layers = make_layers(4)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    params = list(layers.parameters())
    buffer = torch.cat([p.detach().reshape(-1) for p in params])
    start = 0
    for p in params:
        p.data = buffer[start:start + p.numel()].view_as(p)
        start += p.numel()
    run_step(layers, x0, offloader, [1.0])
    stats = offloader.end_step()
    assert stats.offloaded_bytes == 2 * LAYER_SAVED_BYTES


def test_tensors_without_a_token_dimension_go_whole_by_running_fraction(x0):
    layers = make_layers()
    reference = run_step(layers, x0, None, [1.0])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    with offloader.micro_batch(0.5):  # no num_tokens: no token dimension is known
        h = x * 1.0
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    loss.backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    assert max_error(grads, reference) <= 1e-6
    stats = offloader.end_step()
    offloadable = (L - 2) * LAYER_SAVED_BYTES
    assert 0.3 * offloadable <= stats.offloaded_bytes <= 0.7 * offloadable


def test_min_tensor_bytes_keeps_small_tensors_resident(x0):
    layers = make_layers()
    offloader = ActivationOffloader(layers, min_tensor_bytes=T * H * 4 + 1)  # only [T,1,4H] go
    run_step(layers, x0, offloader, [1.0])
    assert offloader.end_step().offloaded_bytes == (L - 2) * 2 * T * 4 * H * 4


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_a_ratio_outside_0_1_is_refused(ratio):
    offloader = ActivationOffloader(make_layers(3))
    with pytest.raises(ValueError, match=r"offload_ratio .* must be in \[0, 1\]"):
        offloader.micro_batch(ratio, num_tokens=T)


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="needs the model's layers"):
        ActivationOffloader([])
    with pytest.raises(ValueError, match="keep_resident_layers"):
        ActivationOffloader(make_layers(2), keep_resident_layers=-1)


# ------------------------------------------------------------- the stream ordering (GPU logic)
class RecordingEvent(HostEvent):
    """An event the test completes by hand (to play an asynchronous copy)."""

    def __init__(self, log, name) -> None:
        super().__init__()
        self.log, self.name, self.done = log, name, False

    def record(self, stream=None) -> None:
        super().record(stream)
        self.stream = stream.name
        self.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class RecordingOps(HostStreamOps):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self.events: list[RecordingEvent] = []
        self._compute = LoggedStream(self.log, "compute")

    def new_stream(self):
        self._count += 1
        return LoggedStream(self.log, ["d2h", "h2d"][self._count - 1])

    def new_event(self, *, timing: bool = False):
        event = RecordingEvent(self.log, f"e{len(self.events)}")
        self.events.append(event)
        return event

    def record_stream(self, tensor, stream) -> None:
        self.log.append(("record_stream", stream.name))


def test_streams_are_ordered_like_the_gpu_path_needs(x0):
    layers = make_layers(3)  # one offloadable layer
    ops = RecordingOps()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0, stream_ops=ops)
    x = x0.clone().requires_grad_()
    with offloader.micro_batch(1.0, num_tokens=T):
        h = x * 1.0
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    log = ops.log
    offloads = [i for i, e in enumerate(log) if e[:2] == ("record", "d2h")]
    assert len(offloads) == 6  # layer 0 saves x, mean, rstd, norm out, a out, gelu out
    for i in offloads:  # each D2H copy waited for compute and protected its source tensor
        assert ("wait_stream", "d2h", "compute") in log[:i]
        assert log[i - 1] == ("record_stream", "d2h")
    # while every offload is still "in flight", a new buffer cannot reuse theirs
    allocations = offloader.pool.allocations
    loss.backward()
    reloads = [e for e in log if e[:2] == ("record", "h2d")]
    assert len(reloads) == len(offloads)
    d2h_events = [log[i][2] for i in offloads]
    assert all(("wait_event", "h2d", name) in log for name in d2h_events), "reload before offload done"
    h2d_events = [e[2] for e in reloads]
    for name in h2d_events:  # the compute stream waited for every reload before using it
        assert ("wait_event", "compute", name) in log
    # pending events keep the buffers out of the pool until they complete
    assert offloader.pool.allocations == allocations
    pending = offloader.pool.pending_buffers
    assert len(pending) == len(offloads)
    taken = []
    acquire = offloader.pool.acquire
    offloader.pool.acquire = lambda n: taken.append(acquire(n)) or taken[-1]
    with offloader.micro_batch(1.0, num_tokens=T):
        loss = sum(layer(x0.clone().requires_grad_() * 1.0).sum() for layer in layers[:1])
    del offloader.pool.acquire
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in pending]
    assert taken and not any(a < e and s < b for s, e in spans
                             for a, b in ((t.data_ptr(), t.data_ptr() + t.numel()) for t in taken)
                             ), "reused a buffer whose copy may still run"  # fmt: skip
    for event in ops.events:
        event.done = True
    loss.backward()
    stats = offloader.end_step()
    assert stats.reload_wait_s >= 0.0 and stats.micro_batches == 2


def test_sequence_parallel_rows_are_token_rows_too(x0):
    """With Megatron's sequence parallelism a TP rank's layernorm region holds T / tp rows."""

    class Half(torch.nn.Module):  # saves a [T/2, 1, H] tensor (the SP region) and [T, 1, H] ones
        def forward(self, x):
            y = x[: T // 2] * 2  # a storage of its own (a view of x would share x's copy)
            return torch.cat([torch.sin(y), x[T // 2:]]) * torch.cos(x)

    layers = torch.nn.ModuleList([Half() for _ in range(3)])
    # saved in layer 0: sin's input y [T/2], x (by cos), cat's and cos's outputs
    for sp, view_rows in ((1, T // 2), (2, T // 4)):  # sp=1: the view goes whole (no token dim)
        offloader = ActivationOffloader(layers, min_tensor_bytes=0, sequence_parallel_size=sp)
        x = x0.clone().requires_grad_()
        with offloader.micro_batch(0.5, num_tokens=T):
            layers[2](layers[1](layers[0](x * 1.0))).sum().backward()
        half = T // 2 * H * 4
        assert offloader.end_step().offloaded_bytes == 3 * half + view_rows * H * 4


def test_a_pipeline_stage_input_stays_resident(x0):
    """A stage's input is a leaf that requires grad: the schedule keeps it until its backward,
    so offloading it would free nothing."""

    class Square(torch.nn.Module):
        def forward(self, x):
            return x * x  # saves x twice (one tensor)

    layers = torch.nn.ModuleList([Square() for _ in range(3)])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    for leaf, expected in ((True, 0), (False, T * H * 4)):
        x = x0.clone().requires_grad_()
        with offloader.micro_batch(1.0, num_tokens=T):
            out = layers[2](layers[1](layers[0](x if leaf else x * 1.0)))
        out.sum().backward()
        assert offloader.end_step().offloaded_bytes == expected


def test_the_pinned_pool_stays_within_the_host_budget_of_eq3(x0):
    """The host bytes Eq. 3 counts (what one micro-batch offloads) are what the pool pins."""
    from megatron_bytescale.runtime.host_pool import pinned_bytes

    layers = make_layers()
    probe = ActivationOffloader(layers, min_tensor_bytes=0)
    run_step(layers, x0, probe, [1.0])
    need = probe.end_step().offloaded_bytes
    budget = need + 64 * 512  # Eq. 3's bytes, plus one 512-byte alignment per saved tensor
    offloader = ActivationOffloader(layers, min_tensor_bytes=0, host_memory_bytes=budget)
    for _ in range(3):
        run_step(layers, x0, offloader, [1.0])
        stats = offloader.end_step()
    pool = offloader.pool
    assert pool.over_limit_bytes == 0 and stats.host_pool_bytes == pool.capacity_bytes <= budget
    assert all(pinned_bytes(s) == s for s in pool.slab_sizes)  # what torch pins, not more
    assert stats.host_peak_bytes >= need
