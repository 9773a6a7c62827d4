"""PyTorch's own FlashAttention-2 varlen kernels (``aten::_flash_attention_forward/_backward``).

Every CUDA build of PyTorch >= 2.2 carries them, so a GPU user needs no extra package. They are
the kernels behind ``scaled_dot_product_attention``'s flash path, called here in their varlen
form (3-D ``[T, N, H]`` inputs plus ``cu_seqlens``), which SDPA does not expose:

* forward, positional form stable across torch 2.4-2.13::

      out, lse, rng_state, unused, debug = aten._flash_attention_forward(
          q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=s)

  ``lse`` is ``[N, T]`` float32 from torch 2.5 on (flash-attn >= 2.6 inside) and padded
  ``[B, N, max_q]`` in torch 2.4; both are converted to our ``[T, N]`` here and nowhere else.
* backward::

      dq, dk, dv = aten._flash_attention_backward(
          dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
          rng_state, unused, scale=s)

  It takes the *final* (externally merged) out and lse, which is exactly the ring's contract.
  The two random-state tensors are read only with dropout, which the ring never uses.

GQA is native (``N_q`` a multiple of ``N_kv``; dk/dv come back with ``N_kv`` heads). The kernels
need CUDA sm80+, fp16/bf16 and a head dim that is a multiple of 8 and at most 256
(:func:`flash_unsupported_reason`). On ``device="meta"`` the same calls run PyTorch's shape
functions, which is how the CPU tests check these call forms.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .base import Segments, fused_kernel_reason


def flash_kernels_present() -> bool:
    """Whether this torch build registers the aten flash-attention varlen ops."""
    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(
        torch.ops.aten, "_flash_attention_backward"
    )


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def flash_unsupported_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Why PyTorch's flash kernels cannot run this case; None if they can.

    ``meta`` tensors pass (shape functions only), so CPU tests exercise the call forms.
    """
    device = torch.device(device)
    if not flash_kernels_present():
        return f"torch {torch.__version__} has no aten::_flash_attention_forward"
    reason = fused_kernel_reason(
        "PyTorch's flash kernel", device, dtype, head_dim, devices=("cuda", "meta")
    )
    if reason is not None:
        return reason
    if device.type == "cuda":
        if not torch.backends.cuda.is_flash_attention_available():
            return f"torch {torch.__version__} was built without flash attention"
        major, minor = _capability(device.index if device.index is not None else 0)
        if major < 8:
            return f"PyTorch's flash kernels need compute capability 8.0+, got {major}.{minor}"
    return None


def _torch_before(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) < (major, minor)


PADDED_LSE = _torch_before(2, 5)
"""torch < 2.5 vendors flash-attn < 2.6, whose varlen log-sum-exp is padded ``[B, N, max_q]``."""


# ---------------------------------------------------------------------- lse layouts
def lse_to_rows(lse: torch.Tensor, segments: Segments) -> torch.Tensor:
    """The kernel's log-sum-exp as ``[T, N]`` (a view for torch >= 2.5's ``[N, T]``)."""
    if lse.dim() == 2:
        return lse.t()
    n = lse.shape[1]  # torch 2.4: [B, N, max_q]
    flat = lse.transpose(1, 2).reshape(-1, n)
    return flat.index_select(0, segments.padded_rows(lse.device))


def lse_from_rows(lse_TN: torch.Tensor, segments: Segments, padded: bool) -> torch.Tensor:
    """Our ``[T, N]`` log-sum-exp in the layout the backward kernel reads (float32)."""
    lse_TN = lse_TN.float()
    if not padded:
        return lse_TN.t().contiguous()
    n = lse_TN.shape[1]
    flat = lse_TN.new_zeros((segments.num * segments.max_q, n))
    flat.index_copy_(0, segments.padded_rows(lse_TN.device), lse_TN)
    return flat.view(segments.num, segments.max_q, n).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------- calls
class FlashVarlenKernels:
    """One aten flash varlen call per block (all its segments at once), forward and backward.

    Remembers per device the random-state tensors a forward returned, so the backward hands
    the kernel tensors of the kinds it expects (their values are never read without dropout).
    """

    def __init__(self) -> None:
        self._rng: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, *,
        causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(out [T, N, H], lse [T, N] float32)`` of every segment of the block."""
        cu_q, cu_k = segments.tensors(q.device)
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, segments.max_q, segments.max_k, 0.0, causal, False, scale=scale
        )
        self._rng[str(q.device)] = (rng_state, unused)
        return out, lse_to_rows(lse, segments)

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, segments: Segments, *, causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(dq, dk, dv)`` of the block given the final out and lse ``[T, N]`` of its rows."""
        cu_q, cu_k = segments.tensors(q.device)
        rng_state, unused = self._rng_tensors(q.device)
        lse_kernel = lse_from_rows(lse, segments, padded=PADDED_LSE)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse_kernel, cu_q, cu_k, segments.max_q, segments.max_k,
            0.0, causal, rng_state, unused, scale=scale,
        )  # fmt: skip
        return dq, dk, dv

    def _rng_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._rng:  # a backward before any forward: the values are never read
            self._rng[key] = (
                torch.zeros(2, dtype=torch.int64, device=device),
                torch.zeros((), dtype=torch.int64, device=device),
            )
        return self._rng[key]
