"""Activation offload at its edges (CPU, one process): a storage saved again in later layers,
the running fraction of whole tensors to the byte, the ``min_tensor_bytes`` boundary, and a
storage that already has a resident view.

Each expectation is written from the shapes and an independent exact formula; each test
fails for a one-line change of the rule it names (found by the mutation check).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from megatron_bytescale.runtime import ActivationOffloader

T, H = 64, 32


def gradients(layers, x0, offloader, ratio, num_tokens=T):
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    context = offloader.micro_batch(ratio, num_tokens=num_tokens) if offloader else torch.enable_grad()
    with context:
        h = x * 1.0  # an embedding's output: not a leaf
        for layer in layers:
            h = layer(h)
        loss = (h * h).sum()
    loss.backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


def exact_offload_stats(layers, x0):
    """The step's offload counters at ratio 1, after checking its gradients equal the run
    without offload bit for bit."""
    reference = gradients(layers, x0, None, 1.0)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = gradients(layers, x0, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    return offloader.end_step()


@pytest.fixture(scope="module")
def x0():
    return torch.randn(T, 1, H, generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------- one storage, saved in three layers
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
        return x * self.box[0].view(T, 1, H)  # saves x and a view of y


class Tanh(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)  # saves its result


def test_a_storage_saved_again_in_later_layers_is_reloaded_ahead_of_the_last_one():
    """``y`` is made in layer 0 and saved again in layers 1 and 2 (all offloadable). Its
    backward starts in layer 2, so its one reload is started with layer 2's (when layer 3's
    backward begins), not on demand: three storages (y, the inputs of layers 1 and 2), each
    copied and reloaded once, every reload prefetched."""
    box: list = []
    layers = torch.nn.ModuleList([MakesY(box), UsesY(box), UsesY(box), Tanh(), Tanh()])
    x0 = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(2))
    reference = gradients(layers, x0, None, 1.0)
    box.clear()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)  # keeps layers 3, 4 resident
    grads = gradients(layers, x0, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    assert stats.offloaded_tensors == 3 and stats.offloaded_bytes == stats.reloaded_bytes == 3 * T * H * 4
    assert (stats.prefetched_reloads, stats.on_demand_reloads) == (3, 0)


# ---------------------------------------------------- the running fraction of whole tensors
class SavesSizes(torch.nn.Module):
    """Saves 1-D float tensors of the given element counts, in order (``w * t`` saves ``t``);
    each starts 3 elements into its storage (its own bytes count, not its offset)."""

    def __init__(self, sizes) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        # each a view 3 elements into its own storage: a span that does not start at byte 0
        self.tensors = [torch.randn(n + 3, generator=torch.Generator().manual_seed(n))[3:] for n in sizes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum()
        for t in self.tensors:
            total = total + (self.w * t).sum()
        return total


SIZES = [1, 1, 1, 2, 1, 3, 1, 1, 5, 1, 1, 2, 7, 1]


def moved(ratio: float, sizes) -> tuple[int, int]:
    """Independent of the code: (bytes, tensors) moved; a tensor goes when the bytes moved so
    far are below ``r`` of the bytes seen so far (itself included), in exact fractions."""
    r = Fraction(ratio).limit_denominator(10**6)
    seen = moved_bytes = count = 0
    for n in sizes:
        seen += 4 * n
        if moved_bytes < r * seen:
            moved_bytes += 4 * n
            count += 1
    return moved_bytes, count


@pytest.mark.parametrize("ratio", [0.37, 0.5, 1 / 3, 0.9])
def test_whole_tensors_follow_the_running_fraction_to_the_byte(x0, ratio):
    """Tensors of a few bytes make the fraction's margin a byte or less (0.37 of 12 bytes seen
    is 4.44, 4 moved): a tolerance of a byte, or offloading at equality (0.5 of 8 bytes, 4
    moved), moves different tensors."""
    layers = torch.nn.ModuleList([SavesSizes(SIZES), torch.nn.Identity(), torch.nn.Identity()])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    reference = gradients(layers, x0, None, ratio, num_tokens=None)
    grads = gradients(layers, x0, offloader, ratio, num_tokens=None)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    nbytes, count = moved(ratio, SIZES)
    assert 0 < nbytes < 4 * sum(SIZES)  # the case is not all or nothing
    assert stats.offloaded_bytes == stats.reloaded_bytes == nbytes
    # a tensor that stays makes no copy to reload (one reload per tensor moved, none other)
    assert stats.offloaded_tensors == stats.prefetched_reloads + stats.on_demand_reloads == count


# ------------------------------------------------------------- the min_tensor_bytes boundary
class Wide(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x.expand(T, 4, H).contiguous())  # saves a [T, 4, H] input: 4 T H * 4 bytes


@pytest.mark.parametrize("extra, offloaded", [(0, 1), (1, 0)])
def test_a_tensor_of_exactly_min_tensor_bytes_is_worth_a_copy(x0, extra, offloaded):
    layers = torch.nn.ModuleList([Wide(), Tanh(), Tanh()])  # layer 0 offloadable
    offloader = ActivationOffloader(layers, min_tensor_bytes=4 * T * H * 4 + extra)
    reference = gradients(layers, x0, None, 1.0)
    grads = gradients(layers, x0, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert offloader.end_step().offloaded_bytes == offloaded * 4 * T * H * 4


# ------------------------------------------------------- a storage with a resident view first
class ResidentViewFirst(torch.nn.Module):
    """Saves a one-row view of ``y`` (below ``min_tensor_bytes``: it stays on the device, so
    its storage does) and then ``y`` itself (worth a copy on its own)."""

    def __init__(self, small_view_first: bool) -> None:
        super().__init__()
        self.small_view_first = small_view_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        first = torch.sin(y[:1]).sum() if self.small_view_first else 0.0  # sin saves y[:1]
        return x + torch.cos(y) + first  # then cos saves y


@pytest.mark.parametrize("small_view_first, offloaded", [(True, 0), (False, 1)])
def test_a_storage_with_a_resident_view_stays_resident(x0, small_view_first, offloaded):
    """Copying ``y`` would free nothing while its one-row view holds the storage on the
    device: ``y`` is not offloaded. Without that view, ``y`` is (the test can fail)."""
    layers = torch.nn.ModuleList([ResidentViewFirst(small_view_first), Tanh(), Tanh()])
    offloader = ActivationOffloader(layers, min_tensor_bytes=2 * H * 4)
    reference = gradients(layers, x0, None, 1.0)
    grads = gradients(layers, x0, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert offloader.end_step().offloaded_bytes == offloaded * T * H * 4


class SmallViewAfter(torch.nn.Module):
    """Saves the first half of ``y`` (worth a copy: it goes whole, having no token dimension)
    and then ``y``'s last row (below ``min_tensor_bytes``), outside the half already held."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        top = torch.cos(y[: T // 2])  # saves y[:T/2]
        return x + torch.cat([top, top]) + torch.sin(y[-1:]).sum()  # then sin saves y[-1:]


@pytest.mark.parametrize("ratio", [1.0, 0.37])
def test_a_small_view_of_an_offloaded_storage_moves_no_bytes_of_its_own(x0, ratio):
    """The half goes to the host (the running fraction of whole tensors: the first always
    goes); the last row, saved through a view not worth a copy, stays on the device in a
    tail, though its storage is offloaded (a view's bytes are only copied out when the view
    itself is worth a copy)."""
    layers = torch.nn.ModuleList([SmallViewAfter(), Tanh(), Tanh()])
    offloader = ActivationOffloader(layers, min_tensor_bytes=2 * H * 4)
    reference = gradients(layers, x0, None, ratio)
    grads = gradients(layers, x0, offloader, ratio)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    assert stats.offloaded_bytes == stats.reloaded_bytes == T // 2 * H * 4


class HeldViewAfter(torch.nn.Module):
    """Saves ``y`` (token rows) and then ``y``'s last two rows (a view worth a copy, without a
    token dimension, whose bytes ``y``'s device tail already holds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        return x + torch.cos(y) + torch.sin(y[-2:]).sum()  # cos saves y, then sin saves y[-2:]


@pytest.mark.parametrize("ratio", [0.37, 0.5])
def test_a_view_of_bytes_already_held_moves_nothing_more(x0, ratio):
    """``y``'s first ceil(r T) rows go to the host, the rest to a device tail; a later view of
    two tail rows holds no byte that is not held already, so nothing more is copied."""
    layers = torch.nn.ModuleList([HeldViewAfter(), Tanh(), Tanh()])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    reference = gradients(layers, x0, None, ratio)
    grads = gradients(layers, x0, offloader, ratio)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    k = -(-Fraction(ratio).limit_denominator(10**6) * T // 1)
    assert k <= T - 2  # the two rows are in the tail
    stats = offloader.end_step()
    assert stats.offloaded_bytes == stats.reloaded_bytes == k * H * 4


class KeyOfFusedQKV(torch.nn.Module):
    """Saves the second half of a fused projection's output (as the key of a fused QKV is a
    view at an offset): token rows whose storage span starts H/2 elements in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = x * 2.0  # [T, 1, H]: query | key halves
        key = fused[:, :, H // 2:]
        return x + torch.sin(key).sum()  # sin saves the view


@pytest.mark.parametrize("ratio", [0.5, 0.37])
def test_a_token_view_at_an_offset_offloads_its_share_of_its_own_span(x0, ratio):
    """The view's span is elements H/2 .. T H of the storage; its first ceil(r T) of T rows
    are that share of the span (from its own start, not from the storage's)."""
    layers = torch.nn.ModuleList([KeyOfFusedQKV(), Tanh(), Tanh()])
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    reference = gradients(layers, x0, None, ratio)
    grads = gradients(layers, x0, offloader, ratio)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    k = -(-Fraction(ratio).limit_denominator(10**6) * T // 1)
    span = T * H - H // 2  # elements from the view's first to one past its last
    assert offloader.end_step().offloaded_bytes == span * k // T * 4


# ------------------------------------------------------------------------ reload triggers
class MakesYAndZ(MakesY):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x * 0.5)  # saves y
        self.box.append(y)
        return x + y + torch.tanh(x)  # tanh saves z, a storage of this layer's own


class OnlyViewsY(MakesY):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sin(self.box[0].view(T, 1, H))  # saves nothing but a view of y


def test_a_layer_that_saves_only_views_of_earlier_storages_still_starts_the_reloads_below():
    """Layer 1 saves only a view of layer 0's ``y``; its backward must still start layer 0's
    reloads (``z``), so nothing is reloaded on demand."""
    box: list = []
    layers = torch.nn.ModuleList([MakesYAndZ(box), OnlyViewsY(box), Tanh(), Tanh()])
    reference = gradients(layers, torch.ones(T, 1, H) * 0.1, None, 1.0)
    box.clear()
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)  # layers 0, 1 offloadable
    grads = gradients(layers, torch.ones(T, 1, H) * 0.1, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    stats = offloader.end_step()
    assert stats.offloaded_tensors == 2  # y (saved in layers 0 and 1) and z
    assert (stats.prefetched_reloads, stats.on_demand_reloads) == (2, 0)


def test_after_a_layer_that_saves_nothing_a_layer_reloads_on_demand_all_at_once(x0):
    """Nothing is saved in layer 1, so no backward starts layer 0's reloads ahead: its first
    saved tensor used reloads all of layer 0's storages at once, each counted on demand."""
    layers = torch.nn.ModuleList([SavesThree(), torch.nn.Identity(), Tanh(), Tanh()])
    stats = exact_offload_stats(layers, x0)  # layers 0, 1 offloadable
    assert stats.offloaded_tensors == 3
    assert (stats.prefetched_reloads, stats.on_demand_reloads) == (0, 3)


class SavesThree(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x)  # saves a
        b = torch.sigmoid(x * 3.0)  # saves b
        return torch.exp(a + b)  # saves its result


# ----------------------------------------------------------------------- integer tensors
class Gathers(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.arange(T - 1, -1, -1).view(T, 1, 1).expand(T, 1, H).contiguous()  # int64 rows
        return torch.gather(x, 0, index) * 2.0  # gather saves the index and x


def test_integer_tensors_are_never_offloaded(x0):
    """An index tensor is not an activation worth a copy, whatever its size: only floating
    point tensors go (here x, T H floats; not the int64 index of twice its bytes)."""
    layers = torch.nn.ModuleList([Gathers(), Tanh(), Tanh()])
    reference = gradients(layers, x0, None, 1.0)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)
    grads = gradients(layers, x0, offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    assert offloader.end_step().offloaded_bytes == T * H * 4


class SavesYThenAView(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(x * 0.5)  # saves y: its storage is offloaded here
        return x * y.view(T, 1, H)  # saves x and a second view of y's storage


def test_a_second_view_of_an_offloaded_storage_reloads_it_on_demand(x0):
    """Nothing is saved in layer 1, so layer 0's storages come back on demand, and the first
    tensor backward asks for is the *second* view of ``y``'s storage: its handle must reach the
    micro-batch's reload, not only the first view's."""
    layers = torch.nn.ModuleList([SavesYThenAView(), torch.nn.Identity(), Tanh(), Tanh()])
    stats = exact_offload_stats(layers, x0)  # layers 0, 1 offloadable
    assert stats.offloaded_tensors == 2  # y's storage (two views) and the layer input x
    assert (stats.prefetched_reloads, stats.on_demand_reloads) == (0, 2)


def test_a_layer_whose_only_saved_tensor_it_offloads_still_starts_the_reload_below(x0):
    """Four layers that each save only their own output: layers 0 and 1 offload theirs (new
    storages), 2 and 3 keep theirs. Unpacking layer 1's offloaded output in backward must
    start layer 0's reload ahead, as a resident tensor's unpacking does: no reload on demand."""
    layers = torch.nn.ModuleList([Tanh(), Tanh(), Tanh(), Tanh()])
    stats = exact_offload_stats(layers, x0)  # layers 0, 1 offloadable
    assert stats.offloaded_tensors == 2
    assert (stats.prefetched_reloads, stats.on_demand_reloads) == (2, 0)
