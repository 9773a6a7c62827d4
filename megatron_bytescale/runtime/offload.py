"""Selective activation offload: Eq. 3's ratio, applied micro-batch by micro-batch (paper §5.2, D8).

The planner gives every micro-batch an ``offload_ratio`` r (Eq. 3: a long sequence fits on
fewer ranks when part of its activations waits in host memory). :class:`ActivationOffloader`
applies it with ``torch.autograd.graph.saved_tensors_hooks``, so it works on any model made of
layers, megatron-core's included, without touching the model code::

    offloader = ActivationOffloader(model.decoder.layers)
    for mb in micro_batches:
        with offloader.micro_batch(mb.offload_ratio, num_tokens=mb.num_tokens):
            loss = forward(mb)                   # pack hooks: offload while the forward runs
        loss.backward()                          # unpack hooks: reload, one layer ahead
    stats = offloader.end_step()                 # bytes moved, peak resident, reload waits

**Which tensors** (the rule Eq. 3's numerator assumes): a tensor autograd saves inside one of
the first ``l - keep_resident_layers`` layers (``l`` = the layers given, in forward order; by
default the last two stay resident because their backward comes first and nothing could hide
their reload) is offloaded in part when it is floating point, lives on the compute device,
holds at least ``min_tensor_bytes`` and is not a parameter (nor a view of one) or another leaf
that requires grad (a pipeline stage's input: the schedule holds it until its backward anyway):

* token-granular when it has a token dimension (the first dimension of size ``num_tokens``,
  dimension 0 in megatron-core's ``[s, b, h]`` layout and for ring attention's q/k/v/out/lse):
  its first ``ceil(r * num_tokens)`` token rows go to host memory, the other rows are copied
  into a device buffer of their own so the original's memory can be freed;
* whole tensors otherwise, while the bytes offloaded so far are below r times the eligible bytes
  seen so far in this micro-batch.

Everything else (embeddings, the loss, the last layers, small or integer tensors) stays on the
device untouched. **Offload is by storage** (:mod:`.offload_storage`): views that share a
storage (the attention output and the ``[s, 1, h]`` view ``linear_proj`` saves) share one copy.
Each byte of an offloaded storage goes to the host once (when any view's rows ask for it) or
stays in one device tail, the storage is reloaded once, and every view is rebuilt from it with
its size, stride and storage offset. A tensor saved twice is packed once. A storage that one of
its views keeps on the device (a view saved in a layer that is never offloaded, a pipeline
stage's input, a view not offloaded first) stays resident for all of them: offloading another
view of it would free nothing.

**Backward**: the first saved tensor unpacked in layer ``i`` starts the reload of every
offloaded storage of layer ``i - 1`` (the last layer that saved a view of it) on the H2D
stream, so it arrives while layer ``i`` computes; a tensor unpacked before its reload was
started is reloaded on demand (counted).

**Accounting** is measured from the tensors the hooks hold: ``peak_resident_bytes`` is the
largest total size of the distinct storages that saved tensors kept on the device at any moment
of the step (a view keeps its whole storage), ``offloaded_bytes`` / ``reloaded_bytes`` what
went over the link, ``reload_wait_s`` how long the compute waited for reloads (CUDA: stalls of
the compute stream, timed with events; CPU: the reload copies themselves, which run on the
computing thread).

The transfers, their streams and the host buffer pool are in :mod:`.offload_streams` and
:mod:`.host_pool`; the same code runs on CUDA and, with synchronous stand-ins, on CPU.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ContextManager, Iterable, Optional, Sequence

import torch

from .host_pool import HostBufferPool
from .offload_storage import OffloadedStorage, SavedActivation, byte_span
from .offload_streams import ActivationTransfers, StreamOps, stream_ops_for

DEFAULT_KEEP_RESIDENT_LAYERS = 2
DEFAULT_MIN_TENSOR_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class OffloadStats:
    """What the offloader did over a step (or one micro-batch)."""

    micro_batches: int = 0
    offloaded_bytes: int = 0
    """Bytes copied device -> host."""
    reloaded_bytes: int = 0
    """Bytes copied host -> device."""
    offloaded_tensors: int = 0
    peak_resident_bytes: int = 0
    """Largest total of distinct storages that saved activations held on the device."""
    reload_wait_s: float = 0.0
    """Time the computation waited for reloads (see the module docstring)."""
    copy_s: float = 0.0
    """Host time spent issuing copies (the copies themselves on CPU)."""
    prefetched_reloads: int = 0
    on_demand_reloads: int = 0
    host_pool_bytes: int = 0
    """Size of the host buffer pool at the end of the step."""
    host_peak_bytes: int = 0
    """Most host buffer bytes in use at once during the step."""

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass
class _Counters:
    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    offloaded_tensors: int = 0
    prefetched_reloads: int = 0
    on_demand_reloads: int = 0


class ActivationOffloader:
    """Offloads saved activations of ``layers`` by a per-micro-batch ratio (module docstring).

    Args:
        layers: the model's layers on this rank, in forward order (megatron-core:
            ``model.decoder.layers``). Forward hooks on them tell the pack hook which layer runs.
        keep_resident_layers: the last layers never offloaded (Eq. 3 assumes 2).
        min_tensor_bytes: smaller saved tensors stay resident (one copy is not worth it).
        device: the compute device (default: the device of the layers' first parameter).
        params_of: modules whose parameters must never be offloaded (default: ``layers``).
        sequence_parallel_size: with Megatron's sequence parallelism the layernorm / dropout
            regions hold ``num_tokens / tp`` rows per TP rank: those are token dimensions too.
        stream_ops: the stream primitives (default: CUDA's on a CUDA device, else the
            synchronous host stand-ins); tests inject recording ones.
        host_memory_bytes: the host budget per rank the planner used (Eq. 3): the pinned pool
            stays under it (None: unlimited).
    """

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        *,
        keep_resident_layers: int = DEFAULT_KEEP_RESIDENT_LAYERS,
        min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
        device: torch.device | str | None = None,
        params_of: Iterable[torch.nn.Module] | None = None,
        stream_ops: StreamOps | None = None,
        sequence_parallel_size: int = 1,
        host_memory_bytes: float | None = None,
    ) -> None:
        layers = list(layers)
        if not layers:
            raise ValueError("ActivationOffloader needs the model's layers (got none)")
        if keep_resident_layers < 0:
            raise ValueError(f"keep_resident_layers ({keep_resident_layers}) must be >= 0")
        if min_tensor_bytes < 0:
            raise ValueError(f"min_tensor_bytes ({min_tensor_bytes}) must be >= 0")
        if sequence_parallel_size < 1:
            raise ValueError(f"sequence_parallel_size ({sequence_parallel_size}) must be >= 1")
        self.sequence_parallel_size = int(sequence_parallel_size)
        self.num_layers = len(layers)
        self.keep_resident_layers = int(keep_resident_layers)
        self.min_tensor_bytes = int(min_tensor_bytes)
        if device is None:
            first = next((p for layer in layers for p in layer.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._param_modules = list(params_of) if params_of is not None else layers
        ops = stream_ops if stream_ops is not None else stream_ops_for(self.device)
        self.transfers = ActivationTransfers(ops)
        # the planner's Eq. 3 host budget caps the pinned slabs (runtime/host_pool.py)
        self.pool = HostBufferPool(pin_memory=ops.pin_memory, limit_bytes=host_memory_bytes)
        self._layer_stack: list[int] = []
        self._hooks = []
        for index, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(self._enter_layer(index)))
            self._hooks.append(layer.register_forward_hook(self._leave_layer(index)))
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, holders]
        self.resident_bytes = 0
        self._peak_resident = 0
        self._step_counters: list[_Counters] = []

    @property
    def offloadable_layers(self) -> int:
        """Layers whose activations may be offloaded: all but the last ``keep_resident_layers``."""
        return max(0, self.num_layers - self.keep_resident_layers)

    @property
    def current_layer(self) -> int | None:
        """Index of the layer whose forward is running now (None outside the layers)."""
        return self._layer_stack[-1] if self._layer_stack else None

    def micro_batch(self, offload_ratio: float, *, num_tokens: int | None = None) -> "MicroBatchOffload":
        """A context for the forward of one micro-batch that offloads ``offload_ratio`` of it.

        ``num_tokens`` is the micro-batch's local token count (rows of its ``[s, b, h]``
        activations; with sequence parallelism also ``num_tokens / sequence_parallel_size``
        rows are a token dimension); without it every tensor is offloaded whole.
        """
        ratio = float(offload_ratio)
        if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
            raise ValueError(
                f"offload_ratio ({offload_ratio!r}) must be in [0, 1]: the fraction of each "
                "layer's saved activations that goes to host memory"
            )
        if num_tokens is not None and (isinstance(num_tokens, bool) or int(num_tokens) < 0):
            raise ValueError(f"num_tokens ({num_tokens!r}) must be an integer >= 0 or None")
        counters = _Counters()
        self._step_counters.append(counters)
        return MicroBatchOffload(self, ratio, None if num_tokens is None else int(num_tokens), counters)

    def end_step(self) -> OffloadStats:
        """Totals since the previous call (call after the step's backward); starts a new step."""
        c = self._step_counters
        wait_s = self.transfers.take_wait_seconds()  # before take_copy_seconds resets the clocks
        stats = OffloadStats(
            micro_batches=len(c),
            offloaded_bytes=sum(x.offloaded_bytes for x in c),
            reloaded_bytes=sum(x.reloaded_bytes for x in c),
            offloaded_tensors=sum(x.offloaded_tensors for x in c),
            peak_resident_bytes=self._peak_resident,
            reload_wait_s=wait_s,
            copy_s=self.transfers.take_copy_seconds(),
            prefetched_reloads=sum(x.prefetched_reloads for x in c),
            on_demand_reloads=sum(x.on_demand_reloads for x in c),
            host_pool_bytes=self.pool.capacity_bytes,
            host_peak_bytes=self.pool.peak_in_use_bytes,
        )
        self._step_counters = []
        self._peak_resident = self.resident_bytes
        self.pool.reset_peak()
        return stats

    def close(self) -> None:
        """Remove the layer hooks (the offloader is unusable afterwards)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ internals
    def _enter_layer(self, index: int):
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            self._layer_stack.append(index)

        return hook

    def _leave_layer(self, index: int):
        def hook(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
            if self._layer_stack and self._layer_stack[-1] == index:
                self._layer_stack.pop()

        return hook

    def _parameter_storages(self) -> set[int]:
        # recomputed per micro-batch: Megatron's DDP moves parameters into its buffers after
        # the model (and this offloader) were built
        return {
            p.untyped_storage().data_ptr()
            for module in self._param_modules
            for p in module.parameters()
        }

    def track_storage(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as held on the device by a saved activation."""
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self._storages.get(ptr)
        if entry is None:
            self._storages[ptr] = [nbytes, 1]
            self.resident_bytes += nbytes
            self._peak_resident = max(self._peak_resident, self.resident_bytes)
        else:
            entry[1] += 1

    def untrack_storage(self, tensor: torch.Tensor) -> None:
        """One holder of ``tensor``'s storage let go (the storage counts until the last)."""
        storage = tensor.untyped_storage()
        entry = self._storages.get(storage.data_ptr())
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[storage.data_ptr()]
            self.resident_bytes -= entry[0]


class MicroBatchOffload:
    """The offload state of one micro-batch; a context manager around its forward.

    Backward may run after the ``with`` block (and interleaved with other micro-batches'
    forwards under pipeline parallelism): the unpack hooks stay bound to this state.
    """

    def __init__(self, owner: ActivationOffloader, ratio: float, num_tokens: int | None,
                 counters: _Counters) -> None:
        self.owner = owner
        self.ratio = ratio
        self.num_tokens = num_tokens
        sp = owner.sequence_parallel_size
        self._token_sizes = () if not num_tokens else (
            (num_tokens,) if sp == 1 or num_tokens % sp else (num_tokens, num_tokens // sp))
        self.counters = counters
        self._layers: dict[int, list[weakref.ref]] = defaultdict(list)  # layer -> storages
        self._backward_layers: set[int] = set()
        self._seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._records: dict[int, OffloadedStorage] = {}  # data_ptr -> this forward's copies
        self._resident_storages: set[int] = set()
        self._params: set[int] = set()
        self._eligible_whole = 0
        self._offloaded_whole = 0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def __enter__(self) -> "MicroBatchOffload":
        if self._hooks is not None:
            raise RuntimeError("this micro-batch's offload context is already active")
        self._params = self.owner._parameter_storages()
        self.owner._layer_stack.clear()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)
        self._seen.clear()
        self._records.clear()
        self._resident_storages.clear()
        self.owner._layer_stack.clear()

    # ------------------------------------------------------------------ pack
    def _pack(self, tensor: torch.Tensor) -> SavedActivation:
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor:
            handle = seen[1]()
            if handle is not None:
                return handle
        handle = self._saved(tensor, self.owner.current_layer)
        self._seen[id(tensor)] = (weakref.ref(tensor), weakref.ref(handle))
        return handle

    def _saved(self, tensor: torch.Tensor, layer: int | None) -> SavedActivation:
        """The handle of one saved tensor: resident, or a view of its offloaded storage."""
        owner = self.owner
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        record = self._records.get(ptr)
        if record is not None and not record.is_storage(storage):
            del self._records[ptr]  # that storage was freed; its address now holds another
            record = None
        stays = self._must_stay_resident(tensor, layer, ptr)
        if record is not None and stays:  # the whole storage stays: every view reads it
            record.make_resident(tensor)
            del self._records[ptr]
        elif record is not None:
            record.cover(tensor, self._host_bytes(tensor, record))
            if layer is not None and layer > record.layer:  # its backward comes first
                record.layer = layer
                self._layers[layer].append(weakref.ref(record))
            return SavedActivation(self, tensor, layer, record)
        elif not stays and ptr not in self._resident_storages and self._eligible(tensor):
            host = self._host_bytes(tensor, None)
            if host > 0:
                record = OffloadedStorage(self, storage, layer)
                self._records[ptr] = record
                self._layers[layer].append(weakref.ref(record))
                record.cover(tensor, host)
                return SavedActivation(self, tensor, layer, record)
        # parameters and tensors on other devices are not saved activations of this device
        tracked = tensor.device == owner.device and ptr not in self._params
        if tracked:
            self._resident_storages.add(ptr)
        return SavedActivation(self, tensor, layer, tracked=tracked)

    def _must_stay_resident(self, tensor: torch.Tensor, layer: int | None, ptr: int) -> bool:
        """Whether this view keeps its whole storage on the device (then offloading any view
        of that storage would free nothing)."""
        owner = self.owner
        if self.ratio <= 0.0 or layer is None or layer >= owner.offloadable_layers:
            return True
        if tensor.device != owner.device or ptr in self._params:
            return True
        # a parameter, a pipeline stage's input: its owner holds it anyway
        return tensor.is_leaf and tensor.requires_grad

    def _eligible(self, tensor: torch.Tensor) -> bool:
        """Worth a copy of its own: floating point, at least ``min_tensor_bytes``."""
        nbytes = tensor.numel() * tensor.element_size()
        return (tensor.is_floating_point() and tensor.dim() > 0 and nbytes > 0
                and nbytes >= self.owner.min_tensor_bytes)

    def _host_bytes(self, tensor: torch.Tensor, record: OffloadedStorage | None) -> int:
        """How many leading bytes of ``tensor``'s span go to the host (module docstring): its
        first ``ceil(r * rows)`` token rows, or the whole tensor by the running fraction.

        A view of a storage that is already offloaded but not worth a copy of its own (small,
        integer) asks for none: its bytes stay on the device unless another view wants them.
        """
        if record is not None and not self._eligible(tensor):
            return 0
        lo, hi = byte_span(tensor)
        size = tensor.element_size()
        dim = _token_dim(tensor, self._token_sizes)
        if dim is not None:
            rows = tensor.shape[dim]
            offloaded = min(rows, math.ceil(self.ratio * rows - 1e-9))
            # the first rows of a [s, b, h] tensor are the first bytes of its storage span;
            # for any other layout, the same fraction of the span
            return (hi - lo) // size * offloaded // rows * size
        new = hi - lo if record is None else record.unheld_bytes(lo, hi)
        if new == 0:
            return 0
        self._eligible_whole += new
        if self._offloaded_whole < self.ratio * self._eligible_whole - 1e-9:
            self._offloaded_whole += new
            return hi - lo
        return 0

    # ------------------------------------------------------------------ unpack
    def _unpack(self, handle: SavedActivation) -> torch.Tensor:
        layer = handle.layer
        if layer is not None and layer not in self._backward_layers:
            self._backward_layers.add(layer)
            self.reload_layer(layer - 1, prefetch=True)
        return handle.get()

    def reload_layer(self, layer: int, *, prefetch: bool) -> None:
        """Start the reload of every offloaded storage of ``layer`` (those not started yet)."""
        for ref in self._layers.pop(layer, ()):
            record = ref()
            if record is not None and record.needs_reload:
                record.reload()
                if prefetch:
                    self.counters.prefetched_reloads += 1
                else:
                    self.counters.on_demand_reloads += 1


def offload_micro_batch(offloader: ActivationOffloader | None, micro_batch: Any) -> ContextManager[Any]:
    """The context a schedule enters around the **forward** of one planned micro-batch.

    ``micro_batch`` is a :class:`~.layout.MicroBatchTensors` (its plan ``offload_ratio`` and its
    token count, padded to a multiple of the offloader's ``sequence_parallel_size`` as the
    model pads it). Returns a no-op without an offloader or when autograd records nothing (an
    evaluation forward). Backward may run later, outside the context (pipeline schedules).
    """
    if offloader is None or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    sp = offloader.sequence_parallel_size
    rows = -(-int(micro_batch.tokens.numel()) // sp) * sp
    return offloader.micro_batch(micro_batch.offload_ratio, num_tokens=rows)


def _token_dim(tensor: torch.Tensor, token_sizes: tuple[int, ...]) -> int | None:
    """The token dimension: the first dimension (0 in ``[s, b, h]``) of one of ``token_sizes``."""
    for dim, size in enumerate(tensor.shape):
        if size in token_sizes:
            return dim
    return None
