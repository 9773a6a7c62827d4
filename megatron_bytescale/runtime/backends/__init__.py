"""Attention kernel backends behind one interface (:class:`AttentionBackend`).

``torch`` (always available; aten CPU flash kernels on CPU, tiled math elsewhere), ``math``
(tiled float32 matmuls, any device), ``flash_attn`` (GPU, optional) and ``te`` (Transformer
Engine, GPU, optional). The GPU backends are imported only when chosen, so importing the
runtime never needs them.
"""

from __future__ import annotations

import logging

import torch

from .base import AttentionBackend, Segments
from .torch_backend import MathBackend, TorchBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "math", "flash_attn", "te")

_instances: dict[str, AttentionBackend] = {}
_unavailable: dict[str, ImportError] = {}  # automatic choice tries an optional import once


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


def get_backend(
    name: str | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend called ``name``, or the best available one for ``device``/``dtype``.

    Automatic choice: on CUDA with fp16/bf16, ``flash_attn`` if it imports, else ``te`` if it
    imports, else ``torch``; everywhere else ``torch``. Naming an unavailable backend raises
    its ImportError (with an install hint); an unknown name raises ValueError.
    """
    if name is not None:
        if name not in _instances:
            _instances[name] = _create(name)
        return _instances[name]
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        for candidate in ("flash_attn", "te"):
            if candidate in _unavailable:
                continue
            try:
                backend = get_backend(candidate)
            except ImportError as exc:
                _unavailable[candidate] = exc
                logger.info("attention backend %s unavailable: %s", candidate, exc)
                continue
            return backend
    return get_backend("torch")


__all__ = [
    "AttentionBackend",
    "BACKEND_NAMES",
    "MathBackend",
    "Segments",
    "TorchBackend",
    "get_backend",
]
