"""Section g of the GPU check: selective activation offload on the GPU's own streams.

A stack of transformer-MLP-shaped layers (LayerNorm, Linear H -> 4H, GELU, Linear 4H -> H) runs
forward and backward under ``runtime.ActivationOffloader`` at offload ratios 0 .. 1: on CUDA the
offloader's separate D2H / H2D streams and pinned host pool, on CPU (``--small``) its
synchronous host stand-ins. For each ratio it records

* the peak of resident saved bytes (the offloader's count, and on CUDA the allocator's peak
  above the model), against Eq. 3's ``(2 + (l - 2)(1 - r))`` layers' worth,
* the step time (best of a few) and its overhead over ratio 0, the bytes moved and the pinned
  pool's size,
* the gradients against ratio 0: offload copies bytes, so they must be equal.

Pass / fail is judged on the gradients and on the resident bytes only; the step-time overhead is
a measurement until a GPU run has set what to expect (docs/gpu.md).
"""

from __future__ import annotations

from typing import Any

import torch

RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


class _Layer(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.a = torch.nn.Linear(hidden, 4 * hidden)
        self.b = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(self.norm(x))))


def section_offload(rec: Any, device: torch.device, *, best_time_s: Any, relerr: Any) -> None:
    from megatron_bytescale.runtime import ActivationOffloader

    tokens, hidden, num_layers = (128, 32, 6) if rec.small else (8192, 4096, 8)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    repeats = 1 if rec.small else 3
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_Layer(hidden) for _ in range(num_layers)).to(device, dtype)
    x0 = torch.randn(tokens, 1, hidden, device=device, dtype=dtype)
    offloader = ActivationOffloader(layers, min_tensor_bytes=0)

    def step(ratio: float) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        x = x0.clone().requires_grad_()
        with offloader.micro_batch(ratio, num_tokens=tokens):
            h = x * 1.0
            for layer in layers:
                h = layer(h)
            loss = h.float().square().mean()
        loss.backward()
        return [p.grad for p in layers.parameters()] + [x.grad]

    reference = None
    resident0 = None
    time0 = None
    for ratio in RATIOS:
        if rec.time_left() < 3:
            return rec.skip(f"ratio{ratio}", "time budget")
        step(ratio)  # warm-up: the pool's slabs and the kernels
        offloader.end_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        grads = [g.clone() for g in step(ratio)]
        stats = offloader.end_step()
        peak_alloc = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
        seconds = best_time_s(lambda: step(ratio), device, repeats=repeats, warmup=0)
        offloader.end_step()
        if reference is None:
            reference, resident0, time0 = grads, stats.peak_resident_bytes, seconds
        worst = max(relerr(g, r) for g, r in zip(grads, reference))
        # Eq. 3: two layers stay whole, the other l - 2 keep the fraction 1 - r of their rows
        expected_fraction = (2 + (num_layers - 2) * (1 - ratio)) / num_layers
        fraction = stats.peak_resident_bytes / resident0 if resident0 else 1.0
        rec.write(f"ratio{ratio}", offload_ratio=ratio, tokens=tokens, hidden=hidden,
                  layers=num_layers, dtype=dtype, resident_bytes=stats.peak_resident_bytes,
                  resident_fraction=round(fraction, 3),
                  eq3_fraction=round(expected_fraction, 3),
                  allocator_peak_bytes=peak_alloc, offloaded_bytes=stats.offloaded_bytes,
                  host_pool_bytes=stats.host_pool_bytes, step_s=round(seconds, 5),
                  overhead=round(seconds / time0 - 1, 3), grads_vs_ratio0=worst,
                  ok=worst <= 1e-6 and fraction <= expected_fraction + 0.1)  # fmt: skip
    offloader.close() if hasattr(offloader, "close") else None
