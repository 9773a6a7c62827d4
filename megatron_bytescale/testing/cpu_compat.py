"""Make megatron-core run on a CPU-only machine (gloo), for tests and the CPU demo only.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:

* ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on
  ``torch.cuda.current_device()`` (used by the local ``DotProductAttention``);
* the model-parallel RNG tracker (``get_cuda_rng_tracker().fork()`` around every attention
  dropout, even at p = 0) stores and restores *CUDA* generator states;
* the schedules, P2P communication and DDP create tensors with the literal ``device="cuda"``,
  call ``torch.cuda.current_device()``, ``torch.cuda.synchronize()`` and (0.19.x)
  ``torch.cuda.current_stream()``;
* without apex or Transformer Engine the local layer spec's norm is ``WrappedTorchNorm``,
  which refuses sequence parallelism: under SP every TP rank normalises only its share of the
  tokens, so the norm's weights need the ``sequence_parallel`` attribute that makes
  ``finalize_model_grads`` all-reduce their gradients over the TP group, and only the fused
  (apex / TE) norms set it.

:func:`enable_cpu_megatron` redirects all of these to the CPU: the memory buffer allocates on
the CPU, the torch norm marks its weights for sequence parallelism as apex's fused norm does, the "CUDA" RNG states are CPU generator states, the ``torch.cuda`` calls become
harmless stand-ins, and a :class:`torch.overrides.TorchFunctionMode` rewrites any CUDA device
argument (``"cuda"``, ``"cuda:0"``, an int, ``torch.device("cuda")``) to ``"cpu"``, because a
string literal inside megatron cannot be monkeypatched. The mode costs about 1 ms on a 30 ms
step of a tiny model.

This is a stand-in for hardware the machine lacks, never a production path: it refuses to run
when CUDA is available (real GPUs must use the real code), and it is not imported by the
plugin's library modules. Other CPU limits it does not lift, and that callers must respect:
build models with ``use_cpu_initialization=True``, use ``OptimizerConfig(clip_grad=0.0)``
(gradient clipping asserts CUDA tensors), and do not use the distributed optimizer (it
rejects CPU tensors). See ``/work/shared/reference/cpu_feasibility.md``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from functools import reduce
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_ENABLED = False
_MODE: "_CudaDeviceToCpu | None" = None


class CpuCompatError(RuntimeError):
    """The CPU stand-ins were requested on a machine where they must not be used."""


def cpu_megatron_enabled() -> bool:
    """Whether :func:`enable_cpu_megatron` has run in this process."""
    return _ENABLED


def enable_cpu_megatron(*, allow_with_cuda: bool = False) -> None:
    """Install the CPU stand-ins for megatron-core's CUDA calls in this process (idempotent).

    Call it in every rank, after ``import megatron.core`` is possible and before building the
    model or calling a schedule. Calling it again is a no-op.

    Args:
        allow_with_cuda: only for unit tests that check the stand-ins themselves; a machine
            with a GPU must run megatron's real CUDA code, so by default this refuses.

    Raises:
        CpuCompatError: CUDA is available (and ``allow_with_cuda`` is False).
    """
    global _ENABLED, _MODE
    with _LOCK:
        if not _ENABLED and torch.cuda.is_available() and not allow_with_cuda:
            raise CpuCompatError(
                "megatron_bytescale.testing.cpu_compat replaces megatron-core's CUDA calls with "
                "CPU stand-ins, but CUDA is available here "
                f"({torch.cuda.device_count()} device(s)); run megatron's real CUDA path on a GPU "
                "machine instead of enabling the CPU shim"
            )
        if _ENABLED:
            return
        _patch_memory_buffer()
        _patch_torch_norm()
        _patch_rng_tracker()
        _patch_torch_cuda_calls()
        _MODE = _CudaDeviceToCpu()
        _MODE.__enter__()
        _keep_mode_in_backward(_MODE)
        _ENABLED = True
        logger.info("megatron-core CPU stand-ins enabled (tests and CPU demo only)")


# ----------------------------------------------------------------------------- pieces


def _patch_memory_buffer() -> None:
    from megatron.core import utils as mcore_utils

    def get_tensor_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
        """CPU version of GlobalMemoryBuffer.get_tensor: same reuse rule, CPU storage."""
        required = reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required:
            buffer = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buffer
        return buffer[0:required].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor_on_cpu


def _patch_torch_norm() -> None:
    """``WrappedTorchNorm`` with sequence parallelism: the torch norm, weights marked as
    apex's ``FusedLayerNorm`` marks them (``param.sequence_parallel = True``)."""
    import copy

    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args: Any, **kwargs: Any):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_rng_tracker() -> None:
    """The tracker's "CUDA" generator states become states of the CPU default generator."""
    from megatron.core.tensor_parallel import random as mcore_random

    def get_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    def add(self, name: str, seed: int) -> None:
        """Register RNG state ``name`` seeded with ``seed`` without touching CUDA."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state
    mcore_random.CudaRNGStatesTracker.add = add


class _NoStream:
    """Stands in for ``torch.cuda.current_stream()`` and ``torch.cuda.Stream``: every
    synchronisation is a no-op."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_event(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def wait_stream(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *_args: Any, **_kwargs: Any) -> "_NoEvent":
        return _NoEvent()


class _NoEvent:
    """Stands in for a CUDA event: the host already waited for everything."""

    def synchronize(self) -> None:
        return None

    def wait(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def query(self) -> bool:
        return True


def _patch_torch_cuda_calls() -> None:
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *_a, **_k: None
    torch.cuda.current_stream = lambda *_a, **_k: _NoStream()
    # megatron-core's MoE all-to-all dispatcher makes a side stream for its device-to-host
    # copies of the split sizes and enters it with ``torch.cuda.stream``
    torch.cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # megatron passes torch.cuda.current_device() ints as devices
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _keep_mode_in_backward(mode: TorchFunctionMode) -> None:
    """Run custom autograd backwards under ``mode`` too.

    ``loss.backward()`` reaches the mode's handler, and a mode is switched off while its own
    handler runs, so the whole backward would run without it; megatron's tensor-parallel
    linears allocate ``device=torch.cuda.current_device()`` buffers in their backward
    (sequence-parallel reduce-scatter). The engine calls ``BackwardCFunction.apply`` for every
    custom ``autograd.Function``; entering the mode there restores the rewrite.
    """
    from torch.autograd import function as autograd_function

    apply = autograd_function.BackwardCFunction.apply

    def apply_with_mode(self, *args: Any) -> Any:
        with mode:
            return apply(self, *args)

    autograd_function.BackwardCFunction.apply = apply_with_mode


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.distributed.all_gather and _uneven(args, kwargs, "tensor_list"):
            return _uneven_all_gather(*args, **kwargs)
        if func is torch.distributed.reduce_scatter and _uneven(args, kwargs, "input_list", 1):
            return _uneven_reduce_scatter(*args, **kwargs)
        if func is torch.distributed.all_to_all_single:
            # megatron-core's all-to-all dispatcher turns its split sizes into numpy arrays only
            # when they come from a GPU (``maybe_move_tensor_to_cpu``); on the CPU they stay
            # tensors, which torch's all_to_all_single does not take
            kwargs = {k: (v.tolist() if torch.is_tensor(v) and "split" in k else v)
                      for k, v in kwargs.items()}
        return func(*args, **kwargs)


# megatron-core's MoE all-to-all dispatcher with TP x EP gathers the routed rows of the TP ranks
# (different counts per rank) with ``all_gather`` / ``reduce_scatter`` on lists of tensors of
# different sizes, which NCCL runs and gloo refuses; on gloo they are emulated with even ones


def _uneven(args: tuple, kwargs: dict, name: str, position: int = 0) -> bool:
    tensors = kwargs.get(name, args[position] if len(args) > position else None)
    if kwargs.get("async_op") or not isinstance(tensors, (list, tuple)) or not tensors:
        return False
    return len({tuple(t.shape) for t in tensors}) > 1


def _uneven_all_gather(tensor_list: list, tensor: torch.Tensor, group: Any = None,
                       async_op: bool = False) -> None:
    """``all_gather`` of first-dimension sizes that differ: pad to the largest, gather, cut."""
    rows = max(t.shape[0] for t in tensor_list)
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in tensor_list]
    torch.distributed.all_gather(parts, padded, group=group)
    for out, part in zip(tensor_list, parts):
        out.copy_(part[: out.shape[0]])


def _uneven_reduce_scatter(output: torch.Tensor, input_list: list, op: Any = None,
                           group: Any = None, async_op: bool = False) -> None:
    """``reduce_scatter`` (sum) of first-dimension sizes that differ: all-reduce the whole
    concatenation (every rank holds the same split sizes) and keep this rank's part."""
    if op not in (None, torch.distributed.ReduceOp.SUM):
        raise ValueError(f"the CPU emulation of an uneven reduce_scatter sums; got op {op}")
    whole = torch.cat([t.reshape(t.shape[0], -1) for t in input_list]).contiguous()
    torch.distributed.all_reduce(whole, group=group)
    me = torch.distributed.get_rank(group)
    start = sum(t.shape[0] for t in input_list[:me])
    output.copy_(whole[start:start + input_list[me].shape[0]].reshape(output.shape))
