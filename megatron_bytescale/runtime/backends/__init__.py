"""Attention kernel backends behind one interface (:class:`AttentionBackend`).

``torch`` (always available: PyTorch's flash varlen kernels on CUDA, the aten CPU flash kernels
on CPU), ``math`` (tiled matmuls, any device, slow on a GPU), ``flash_attn`` (CUDA, optional) and
``te`` (Transformer Engine, CUDA, optional). The optional ones are imported only when tried, so
importing the runtime never needs them.

Automatic choice (:func:`get_backend` without a name): on CUDA ``te`` -> ``flash_attn`` ->
``torch`` -> ``math``, the first that is installed and runs the dtype and head dim; ``math`` on
CUDA logs one warning naming why every faster backend was passed over and what to change.
Elsewhere ``torch`` (``math`` where the CPU kernels cannot run the dtype).
"""

from __future__ import annotations

import logging

import torch

from .base import AttentionBackend, Segments, accumulation_dtype
from .math_backend import MathBackend
from .torch_backend import TorchBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "math", "flash_attn", "te")
AUTO_ORDER_CUDA = ("te", "flash_attn", "torch", "math")

_instances: dict[str, AttentionBackend] = {}
_unavailable: dict[str, ImportError] = {}  # automatic choice tries an optional import once
_warned: set[tuple[str, str]] = set()


def _create(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchBackend()
    if name == "math":
        return MathBackend()
    if name == "flash_attn":
        from .flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    if name == "te":
        from .te_backend import TEBackend

        return TEBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKEND_NAMES)}")


def _named(name: str) -> AttentionBackend:
    if name not in _instances:
        _instances[name] = _create(name)
    return _instances[name]


def get_backend(
    name: str | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> AttentionBackend:
    """The backend called ``name``, or the best one for ``device``, ``dtype`` and ``head_dim``.

    Naming an unavailable backend raises its ImportError (with an install hint); an unknown
    name raises ValueError. Without a name the order is the module docstring's; a fall to
    ``math`` on an accelerator is logged once per reason as a warning.
    """
    if name is not None:
        return _named(name)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype if dtype is not None else torch.float32
    order = AUTO_ORDER_CUDA if dev.type == "cuda" else ("torch", "math")
    passed_over: list[str] = []
    for candidate in order:
        if candidate in _unavailable:
            passed_over.append(f"{candidate}: {_unavailable[candidate]}")
            continue
        try:
            backend = _named(candidate)
        except ImportError as exc:
            _unavailable[candidate] = exc
            passed_over.append(f"{candidate}: {exc}")
            continue
        reason = backend.unsupported_reason(dev, dtype, head_dim)
        if reason is None:
            if candidate == "math" and dev.type != "cpu":
                _warn_math(dev, dtype, head_dim, passed_over)
            return backend
        passed_over.append(f"{candidate}: {reason}")
    raise ValueError(
        f"no attention backend runs {dtype} (head dim {head_dim}) on {dev}: "
        + "; ".join(passed_over)
    )


def _warn_math(dev: torch.device, dtype: torch.dtype, head_dim, passed_over: list[str]) -> None:
    key = (dev.type, "; ".join(passed_over))
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(
        "ring attention on %s with %s (head dim %s) runs the tiled 'math' backend, 10-50x slower "
        "than a flash kernel, because %s. Fix: train in bf16 or fp16 (--bf16) with a head dim "
        "that is a multiple of 8 and at most 256 on an sm80+ GPU (PyTorch's own flash kernels "
        "then run), or install flash-attn / Transformer Engine; --bytescale-attention-backend "
        "math silences this warning",
        dev, dtype, head_dim, "; ".join(passed_over),
    )  # fmt: skip


__all__ = [
    "AUTO_ORDER_CUDA",
    "AttentionBackend",
    "BACKEND_NAMES",
    "MathBackend",
    "Segments",
    "TorchBackend",
    "accumulation_dtype",
    "get_backend",
]
