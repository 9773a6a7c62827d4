"""The one prepared GPU check: proves the GPU path of megatron_bytescale in a few minutes.

Run it as ONE command on a machine with one CUDA GPU (the test machine: Python 3.12, torch 2.11
+ CUDA 13, no flash-attn, no Transformer Engine, no internet, megatron-core installed from a
wheel carried beside the tree; ``bash scripts/gpu_check.sh`` does the install and the run):

    python scripts/gpu_check.py --out out/gpu_check.jsonl          # on the GPU, <= 8 minutes
    python scripts/gpu_check.py --report out/gpu_check.jsonl       # here: docs/benchmarks.md "gpu"
    python scripts/gpu_check.py --small --out /tmp/x.jsonl         # toy sizes on CPU (test suite)

Every measurement is appended to ``--out`` as one JSON line the moment it exists (flushed), so a
run cut short by a time limit still leaves everything measured so far. Sections (``--sections``
picks some; each has a time share of ``--budget-s`` and records what it had to skip):

a. environment, the backend ``auto`` picks for bf16, a measured bf16 GEMM ceiling;
b. single attention blocks of every backend present against float64: bf16 and fp16, causal and
   not, several documents per block, 1-token segments, GQA, head dims 64/96/128;
c. rings of 1, 2, 3, 4 and 8 members emulated in one process through the runtime's public
   single-step API (``emulate_ring_attention``), forward and backward against float64, both dK/dV
   wire dtypes, and (CUDA) the whole emulated ring under ``torch.cuda.set_sync_debug_mode("error")``;
d. forward+backward TFLOP/s of each zigzag block type at 4K-128K local tokens (32 query / 8 KV
   heads, head dim 128) next to the bare aten kernel, a pack of 400 short documents, and the
   ring's overhead outside the kernels at 8K-token chunks;
e. a megatron-core LLaMA-7B-shaped layer, fwd+bwd at 1K-64K tokens through the calibration code:
   the fitted ``T(s) = alpha s^2 + beta s + gamma`` and activation bytes per token next to the
   H100 preset;
f. one-GPU HDP training steps through ``wrap_for_hdp`` (distributed optimizer, bf16, clip 1.0):
   the loss drops, and fp32 gradients equal megatron-core's own GPT run one sequence at a time;
g. selective activation offload on the GPU's D2H / H2D streams (``gpu_check_offload.py``):
   resident saved bytes and step time against the offload ratio, gradients equal to ratio 0.

Thresholds that no real kernel has met yet (section d's wrapper speed and ring overhead, g's
step-time overhead) are recorded as ``target`` / ``meets_target``, not judged: a run reports
them and the first GPU run sets them. Correctness (errors against float64, gradients, zero host
syncs, resident bytes) is judged with ``ok``.

The float64 references see the inputs already rounded to the tested dtype, so the errors are
those of the kernels and the ring, not of rounding the inputs. Only public names of the package
are used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from gpu_check_offload import section_offload  # noqa: E402 - the scripts folder is on the path

SECTIONS = ("a", "b", "c", "d", "e", "f", "g")
SHARES = {"a": 0.05, "b": 0.15, "c": 0.15, "d": 0.27, "e": 0.15, "f": 0.15, "g": 0.08}
# section d's targets: recorded beside each measurement, judged only after a GPU run set them
WRAPPER_TARGET = 0.9  # ring wrapper's speed / the bare kernel's
OVERHEAD_TARGET = 0.10  # the ring's time outside the kernels, fraction of the kernels' time
HALF_TOLERANCE = 2e-2  # bf16 / fp16 against float64 (max-norm relative error)
FP32_TOLERANCE = 1e-5


# ============================================================================ recording
class Recorder:
    """Appends one JSON line per measurement to ``path`` (flushed at once) and keeps time."""

    def __init__(self, path: Path, budget_s: float, small: bool) -> None:
        self.path, self.small = path, small
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.section = "-"
        self.section_deadline = float("inf")
        self.failures = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def begin(self, section: str, share: float) -> None:
        self.section = section
        left = self.budget_s - self.elapsed()
        self.section_deadline = self.elapsed() + max(5.0, min(left, self.budget_s * share))

    def time_left(self) -> float:
        return min(self.section_deadline, self.budget_s) - self.elapsed()

    def write(self, name: str, **values: Any) -> dict:
        record = {"section": self.section, "name": name, "t_s": round(self.elapsed(), 2), **values}
        if record.get("ok") is False:
            self.failures += 1
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        status = {True: "ok", False: "FAIL"}.get(record.get("ok"), "")
        print(f"[{record['t_s']:7.1f}s] {self.section} {name} {status} "
              f"{_short(values)}", flush=True)  # fmt: skip
        return record

    def skip(self, name: str, why: str) -> None:
        self.write(name, skipped=why)

    def close(self) -> None:
        self._file.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, (torch.device, Path)):
        return str(x)
    return repr(x)


def _short(values: dict) -> str:
    keep = {k: v for k, v in values.items() if k not in ("ok", "traceback")}
    text = json.dumps(keep, default=_jsonable)
    return text if len(text) < 160 else text[:157] + "..."


# ============================================================================ helpers
def relerr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max|a - ref| / max|ref| in float64 (0 when both are empty)."""
    if ref.numel() == 0:
        return 0.0
    ref64 = ref.double()
    scale = ref64.abs().max().item()
    return (a.double() - ref64).abs().max().item() / (scale if scale > 0 else 1.0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time_s(fn: Callable[[], Any], device: torch.device, *, repeats: int, warmup: int = 1) -> float:
    """Best seconds of ``fn`` over ``repeats`` runs after ``warmup`` (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def sync_debug_error(device: torch.device) -> Iterator[None]:
    """On CUDA, make any host-device synchronisation inside raise (zero syncs allowed)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _sig(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits (for the JSON lines)."""
    return float(f"{x:.{digits}g}")


def attention_flops(segments, n_q: int, head_dim: int, causal: bool, backward: bool = True) -> float:
    """FLOPs of a block: forward 4 * Nq * H * (q x k pairs) (half for causal); backward 2.5x."""
    pairs = 0.0
    for qa, qb, ka, kb in segments:
        lq, lk = qb - qa, kb - ka
        pairs += lq * (lq + 1) / 2 if causal else lq * lk
    forward = 4.0 * n_q * head_dim * pairs
    return forward * (3.5 if backward else 1.0)


def present_backends(device: torch.device) -> list[str]:
    """Every backend that imports here and runs bf16 on ``device`` (math always)."""
    from megatron_bytescale.runtime import BACKEND_NAMES, get_backend

    names = []
    for name in BACKEND_NAMES:
        try:
            backend = get_backend(name)
        except ImportError:
            continue
        if backend.unsupported_reason(device, torch.bfloat16, 128) is None:
            names.append(name)
    return names


# ============================================================================ a. environment
def section_env(rec: Recorder, device: torch.device) -> None:
    import megatron_bytescale.runtime as runtime

    info: dict[str, Any] = dict(
        python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
        device=str(device), machine=platform.machine(), cpus=os.cpu_count(),
    )  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count,
                    flash_sdp=torch.backends.cuda.is_flash_attention_available())  # fmt: skip
    for module in ("megatron.core", "flash_attn", "transformer_engine"):
        info[module] = _version_of(module)
    rec.write("environment", **info)
    picks = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        picks[str(dtype).replace("torch.", "")] = runtime.get_backend(
            device=device, dtype=dtype, head_dim=128).name  # fmt: skip
    rec.write("auto_backend", ok=(device.type != "cuda" or picks["bfloat16"] != "math"), **picks)
    n = 256 if rec.small else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = best_time_s(lambda: a @ b, device, repeats=3 if rec.small else 10, warmup=3)
    rec.write("bf16_gemm", n=n, seconds=seconds, tflops=2 * n**3 / seconds / 1e12)


def _version_of(module: str) -> str | None:
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception:  # noqa: BLE001 - an empty TE meta-package raises RuntimeError
        return None
    return str(getattr(mod, "__version__", getattr(mod, "__name__", "?")))


# ============================================================================ b. blocks
def section_blocks(rec: Recorder, device: torch.device) -> None:
    from megatron_bytescale.runtime import MathBackend, Segments, get_backend

    reference = MathBackend(tile=4096)
    if rec.small:
        causal_lengths, q_lengths, k_lengths = [1, 17, 1, 40, 9], [7, 1, 20], [13, 1, 9]
    else:
        causal_lengths, q_lengths, k_lengths = [1, 300, 1, 2000, 700, 33], [700, 1, 1500], [1300, 1, 900]
    cum = lambda xs: tuple([0] + [sum(xs[: i + 1]) for i in range(len(xs))])  # noqa: E731
    cases = {True: Segments(cu_q=cum(causal_lengths), cu_k=cum(causal_lengths)),
             False: Segments(cu_q=cum(q_lengths), cu_k=cum(k_lengths))}  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for backend_name in present_backends(device):
        backend = get_backend(backend_name)
        for dtype in (torch.bfloat16, torch.float16):
            for head_dim in (64, 96) if rec.small else (64, 96, 128):
                for causal in (True, False):
                    if rec.time_left() < 2:
                        return rec.skip(f"{backend_name}", "time budget")
                    seg = cases[causal]
                    n_q, n_kv = 8, 2  # GQA 4:1
                    q, k, v, dout = (
                        torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
                        for rows, heads in ((seg.cu_q[-1], n_q), (seg.cu_k[-1], n_kv),
                                            (seg.cu_k[-1], n_kv), (seg.cu_q[-1], n_q))
                    )  # fmt: skip
                    q, k, v, dout = (t.to(device) for t in (q, k, v, dout))
                    scale = 1 / math.sqrt(head_dim)
                    reason = backend.unsupported_reason(device, dtype, head_dim)
                    name = f"{backend_name}/{str(dtype)[6:]}/d{head_dim}/{'causal' if causal else 'full'}"
                    if reason is not None:
                        rec.write(name, skipped=reason)
                        continue
                    out, lse = backend.forward(q, k, v, seg, causal=causal, scale=scale)
                    grads = backend.backward(dout, q, k, v, out, lse, seg, causal=causal, scale=scale)
                    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
                    r_out, r_lse = reference.forward(q64, k64, v64, seg, causal=causal, scale=scale)
                    r_grads = reference.backward(do64, q64, k64, v64, r_out, r_lse, seg, causal=causal,
                                                 scale=scale)  # fmt: skip
                    errors = {"out": relerr(out, r_out), "lse": relerr(lse, r_lse)}
                    errors.update({n: relerr(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, r_grads)})
                    rec.write(name, ok=max(errors.values()) <= HALF_TOLERANCE, segments=seg.num,
                              **{k_: round(e, 6) for k_, e in errors.items()})  # fmt: skip


# ============================================================================ c. rings
def ring_case(ring_size: int, lengths: list[int], heads: tuple[int, int], head_dim: int,
              dtype: torch.dtype, device: torch.device, seed: int):  # fmt: skip
    """One ring holding every sequence of ``lengths``: the members' layouts, their inputs
    (``q``/``k``/``v``/``dout`` rows in ``dtype``) and each sequence's whole inputs."""
    from megatron_bytescale.planner import PlanBuilder
    from megatron_bytescale.runtime import layout_for

    builder = PlanBuilder(hdp_size=ring_size, capacity=10**9, lengths=dict(enumerate(lengths)))
    builder.add(list(range(ring_size)), list(range(len(lengths))))
    plan = builder.build(scheduler="gpu-check").validate()
    layouts = [layout_for(plan, r, 0) for r in range(ring_size)]
    g = torch.Generator().manual_seed(seed)
    n_q, n_kv = heads
    seqs = {}
    for sid, n in enumerate(lengths):
        seqs[sid] = {name: torch.randn(n, h, head_dim, generator=g).to(dtype).to(device)
                     for name, h in (("q", n_q), ("k", n_kv), ("v", n_kv), ("dout", n_q))}  # fmt: skip
    inputs = []
    for layout in layouts:
        positions = layout.global_positions()
        member = {}
        for name, h in (("q", n_q), ("k", n_kv), ("v", n_kv), ("dout", n_q)):
            buf = torch.zeros(layout.num_tokens, h, head_dim, dtype=dtype, device=device)
            for slot in layout.slots:
                rows = torch.arange(slot.offset, slot.offset + slot.num_real)
                buf[rows.to(device)] = seqs[slot.seq][name][positions[rows].to(device)]
            member[name] = buf
        inputs.append(member)
    return layouts, inputs, seqs


def sequence_reference(seqs, scale: float):
    """float64 causal attention of every whole sequence (math backend), out and grads."""
    from megatron_bytescale.runtime import MathBackend, Segments

    ref = MathBackend(tile=4096)
    out = {}
    for sid, t in seqs.items():
        n = t["q"].shape[0]
        seg = Segments(cu_q=(0, n), cu_k=(0, n))
        q, k, v, do = (t[x].double() for x in ("q", "k", "v", "dout"))
        o, lse = ref.forward(q, k, v, seg, causal=True, scale=scale)
        dq, dk, dv = ref.backward(do, q, k, v, o, lse, seg, causal=True, scale=scale)
        out[sid] = {"out": o, "dq": dq, "dk": dk, "dv": dv}
    return out


def _ring_errors(layouts, result, reference) -> dict[str, float]:
    errors = {}
    for kind in ("out", "dq", "dk", "dv"):
        worst = 0.0
        for p, layout in enumerate(layouts):
            mine = getattr(result, kind)[p]
            positions = layout.global_positions()
            for slot in layout.slots:
                if not slot.num_real:
                    continue
                rows = torch.arange(slot.offset, slot.offset + slot.num_real)
                ref = reference[slot.seq][kind]
                got = mine[rows.to(mine.device)].double()
                want = ref[positions[rows].to(ref.device)]
                scale = ref.abs().max().item() or 1.0
                worst = max(worst, (got - want).abs().max().item() / scale)
        errors[kind] = round(worst, 6)
    return errors


def section_rings(rec: Recorder, device: torch.device) -> None:
    from megatron_bytescale.runtime import emulate_ring_attention

    head_dim = 64 if rec.small else 128
    heads = (4, 2) if rec.small else (32, 8)
    for ring_size in (1, 2, 3, 4, 8):
        if rec.small:
            lengths = [1, 5 * ring_size + 3, 37, 2]
        else:
            lengths = [1, 4096 * ring_size + 37, 3000, 17, 2]
        if rec.time_left() < 3:
            return rec.skip(f"ring{ring_size}", "time budget")
        layouts, inputs, seqs = ring_case(ring_size, lengths, heads, head_dim, torch.bfloat16,
                                           device, seed=ring_size)  # fmt: skip
        reference = sequence_reference(seqs, 1 / math.sqrt(head_dim))
        args = [[m[n] for m in inputs] for n in ("q", "k", "v")]
        douts = [m["dout"] for m in inputs]
        for wire in ("accumulator", "input"):
            sync_free: bool | str = "n/a (cpu)"
            if device.type == "cuda":
                try:
                    with sync_debug_error(device):
                        emulate_ring_attention(*args, layouts, douts, dkv_wire=wire)
                    sync_free = True
                except RuntimeError as exc:
                    sync_free = False
                    rec.write(f"ring{ring_size}/{wire}/sync", ok=False, error=str(exc)[:500])
            result = emulate_ring_attention(*args, layouts, douts, dkv_wire=wire)
            errors = _ring_errors(layouts, result, reference)
            rec.write(f"ring{ring_size}/{wire}", ok=max(errors.values()) <= HALF_TOLERANCE
                      and sync_free is not False, ring_size=ring_size, dkv_wire=wire,
                      sync_free=sync_free, lengths=lengths, **errors)  # fmt: skip
        del layouts, inputs, seqs, reference


# ============================================================================ d. throughput
def _bare_kernel(device: torch.device) -> Callable:
    """fwd+bwd of one block through the bare kernel (aten flash on CUDA, the backend elsewhere)."""
    from megatron_bytescale.runtime import get_backend

    if device.type != "cuda":
        backend = get_backend("torch")

        def run(q, k, v, dout, seg, causal, scale):
            out, lse = backend.forward(q, k, v, seg, causal=causal, scale=scale)
            backend.backward(dout, q, k, v, out, lse, seg, causal=causal, scale=scale)

        return run

    def run(q, k, v, dout, seg, causal, scale):
        cu_q, cu_k = seg.tensors(q.device)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, seg.max_q, seg.max_k, 0.0, causal, False, scale=scale)  # fmt: skip
        torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, seg.max_q, seg.max_k, 0.0, causal, rng, unused,
            scale=scale)  # fmt: skip

    return run


def _block_inputs(layout, source, heads, head_dim, device):
    from megatron_bytescale.runtime import attention_block, take_rows

    block = attention_block(layout, source)
    n_q, n_kv = heads
    T = layout.num_tokens
    q = torch.randn(T, n_q, head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.randn(2, T, n_kv, head_dim, device=device, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    bare = tuple(take_rows(x, s).contiguous() for x, s in ((q, block.q_spans), (kv[0], block.k_spans),
                                                           (kv[1], block.k_spans), (dout, block.q_spans)))
    return block, q, kv, dout, bare


def section_throughput(rec: Recorder, device: torch.device) -> None:
    from megatron_bytescale.runtime import (
        Ring,
        make_attention_layout,
        prepare_device_metadata,
        resolve_backend,
        ring_backward_step,
        ring_forward_step,
        start_ring_forward,
    )

    heads, head_dim = ((4, 2), 64) if rec.small else ((32, 8), 128)
    sizes = (128, 256) if rec.small else (4096, 8192, 16384, 32768, 65536, 131072)
    bare = _bare_kernel(device)
    scale = 1 / math.sqrt(head_dim)
    repeats = 1 if rec.small else 3
    for local in sizes:
        # one sequence of 2 * local tokens on a ring of 2: member 1 sees the diagonal (causal)
        # and "source before me" blocks, member 0 the "source after me" block
        layouts = [make_attention_layout(Ring((0, 1), p), [(0, 2 * local)]) for p in (0, 1)]
        for kind, layout, source in (("diagonal", layouts[1], 1), ("src_before", layouts[1], 0),
                                     ("src_after", layouts[0], 1)):  # fmt: skip
            if rec.time_left() < 4:
                return rec.skip(f"{kind}/{local}", "time budget")
            block, q, kv, dout, bare_inputs = _block_inputs(layout, source, heads, head_dim, device)
            prepare_device_metadata(layout, device)
            backend = resolve_backend(None, q)
            seg = block.segments

            def wrapped():
                state = start_ring_forward(q)
                ring_forward_step(state, q, kv[0], kv[1], layout, source, backend=backend, scale=scale)
                dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=device)
                ring_backward_step(dout, q, kv[0], kv[1], state.output(q.dtype), state.lse, layout,
                                   source, dq, dkv, backend=backend, scale=scale)  # fmt: skip

            flops = attention_flops(seg, heads[0], head_dim, block.causal)
            t_bare = best_time_s(lambda: bare(*bare_inputs, seg, block.causal, scale), device, repeats=repeats)
            t_ring = best_time_s(wrapped, device, repeats=repeats)
            rec.write(f"{kind}/{local}", local_tokens=local, block=kind, backend=backend.name,
                      q_rows=seg.cu_q[-1], k_rows=seg.cu_k[-1],
                      bare_tflops=_sig(flops / t_bare / 1e12), ring_tflops=_sig(flops / t_ring / 1e12),
                      ring_vs_bare=round(t_bare / t_ring, 3), target=WRAPPER_TARGET,
                      meets_target=t_bare / t_ring >= WRAPPER_TARGET)  # fmt: skip
            del q, kv, dout, bare_inputs
    _pack_of_short_documents(rec, device, heads, head_dim, bare, repeats)
    _ring_step_overhead(rec, device, heads, head_dim, repeats)


def _pack_of_short_documents(rec, device, heads, head_dim, bare, repeats) -> None:
    from megatron_bytescale.runtime import (
        Ring,
        make_attention_layout,
        resolve_backend,
        ring_backward_step,
        ring_forward_step,
        start_ring_forward,
    )

    if rec.time_left() < 4:
        return rec.skip("pack", "time budget")
    g = torch.Generator().manual_seed(5)
    documents, top = (16, 24) if rec.small else (400, 1000)  # CPU kernels loop over documents
    lengths = torch.randint(1, top, (documents,), generator=g).tolist()
    layout = make_attention_layout(Ring((0,), 0), list(enumerate(lengths)))
    block, q, kv, dout, bare_inputs = _block_inputs(layout, 0, heads, head_dim, device)
    backend = resolve_backend(None, q)
    scale = 1 / math.sqrt(head_dim)

    def wrapped():
        state = start_ring_forward(q)
        ring_forward_step(state, q, kv[0], kv[1], layout, 0, backend=backend, scale=scale)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=device)
        ring_backward_step(dout, q, kv[0], kv[1], state.output(q.dtype), state.lse, layout, 0,
                           dq, dkv, backend=backend, scale=scale)  # fmt: skip

    flops = attention_flops(block.segments, heads[0], head_dim, True)
    t_bare = best_time_s(lambda: bare(*bare_inputs, block.segments, True, scale), device, repeats=repeats)
    t_ring = best_time_s(wrapped, device, repeats=repeats)
    rec.write("pack", documents=documents, tokens=sum(lengths), backend=backend.name,
              bare_tflops=_sig(flops / t_bare / 1e12), ring_tflops=_sig(flops / t_ring / 1e12),
              ring_vs_bare=round(t_bare / t_ring, 3))  # fmt: skip


def _ring_step_overhead(rec, device, heads, head_dim, repeats) -> None:
    """A 4-member ring at 8K-token chunks, emulated: its time outside the kernels."""
    from megatron_bytescale.runtime import attention_block, emulate_ring_attention, take_rows

    if rec.time_left() < 6:
        return rec.skip("ring_overhead", "time budget")
    local = 64 if rec.small else 8192
    layouts, inputs, _ = ring_case(4, [4 * local], heads, head_dim, torch.bfloat16, device, seed=9)
    args = [[m[n] for m in inputs] for n in ("q", "k", "v")]
    douts = [m["dout"] for m in inputs]
    t_ring = best_time_s(lambda: emulate_ring_attention(*args, layouts, douts), device, repeats=repeats)
    bare = _bare_kernel(device)
    scale = 1 / math.sqrt(head_dim)
    calls = []
    for p, layout in enumerate(layouts):
        for step in range(4):
            src = (p - step) % 4
            block = attention_block(layout, src)
            if block is None:
                continue
            q, k, v, do = (take_rows(x, s).contiguous() for x, s in (
                (inputs[p]["q"], block.q_spans), (inputs[src]["k"], block.k_spans),
                (inputs[src]["v"], block.k_spans), (inputs[p]["dout"], block.q_spans)))  # fmt: skip
            calls.append((q, k, v, do, block.segments, block.causal))

    def all_kernels():
        for q, k, v, do, seg, causal in calls:
            bare(q, k, v, do, seg, causal, scale)

    t_kernels = best_time_s(all_kernels, device, repeats=repeats)
    overhead = t_ring / t_kernels - 1
    rec.write("ring_overhead", ring_size=4, local_tokens=local, ring_s=round(t_ring, 5),
              kernels_s=round(t_kernels, 5), overhead=round(overhead, 3), target=OVERHEAD_TARGET,
              meets_target=overhead <= OVERHEAD_TARGET)  # fmt: skip


# ============================================================================ e. layer
def _distributed(device: torch.device):
    """A one-process group and Megatron initialised for HDP (CP = 1, DP = 1)."""
    import torch.distributed as dist

    from megatron_bytescale.integration import initialize_hdp_model_parallel

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init = Path(tempfile.mkdtemp()) / "rendezvous"
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{init}", rank=0, world_size=1)  # fmt: skip
    if device.type == "cpu":
        from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

        enable_cpu_megatron()
    from megatron_bytescale.integration import get_hdp_manager

    try:
        return get_hdp_manager()
    except RuntimeError:
        return initialize_hdp_model_parallel()


def section_layer(rec: Recorder, device: torch.device) -> None:
    import torch.nn.functional as F

    from megatron_bytescale.integration import (
        build_gpt_model,
        make_transformer_config,
        measure_layer_costs,
        seed_model_parallel,
    )
    from megatron_bytescale.planner import CostModel, preset_cost_model

    manager = _distributed(device)
    seed_model_parallel(1)
    if rec.small:
        shape = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=172)
        lengths, vocab = [32, 64, 128, 256], 256
    else:
        shape = dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=11008)
        lengths, vocab = [1024, 2048, 4096, 8192, 16384, 32768, 65536], 32000
    half = device.type == "cuda"
    config = make_transformer_config(
        num_layers=1, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, bf16=half, params_dtype=torch.bfloat16 if half else torch.float32,
        **shape,
    )  # fmt: skip
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=max(lengths),
                            use_transformer_engine=False)  # fmt: skip
    if half:
        model = model.bfloat16()  # as Float16Module does (norms are created in fp32)
    measured_t, measured_a = [], []
    for n in lengths:
        if rec.time_left() < 3:
            rec.skip(f"layer/{n}", "time budget")
            break
        t, a = measure_layer_costs(model, manager, lengths=[n], repeats=2, vocab_size=vocab,
                                   device=device)  # fmt: skip
        measured_t += t
        measured_a += a
        rec.write(f"layer/{n}", tokens=n, seconds=t[0][1], activation_bytes_per_token=a[0][1] / n)
    del model
    if len(measured_t) >= 3:
        fit = CostModel.fit(measured_t, measured_a, name="gpu-check", num_layers=1, d2h_bandwidth=1.0,
                            h2d_bandwidth=1.0, kv_bytes_per_token=1.0, p2p_bandwidth_intra=1.0,
                            p2p_bandwidth_inter=1.0)  # fmt: skip
        preset = preset_cost_model("llama-7b", "h100")
        rec.write("layer_fit", alpha1=fit.alpha1, beta1=fit.beta1, gamma=fit.gamma,
                  activation_bytes_per_token=fit.alpha2, activation_beta2=fit.beta2,
                  preset_alpha1=preset.alpha1, preset_beta1=preset.beta1,
                  preset_activation_bytes_per_token=preset.alpha2,
                  alpha1_vs_preset=round(fit.alpha1 / preset.alpha1, 3) if preset.alpha1 else None,
                  beta1_vs_preset=round(fit.beta1 / preset.beta1, 3) if preset.beta1 else None,
                  activation_vs_preset=round(fit.alpha2 / preset.alpha2, 3))  # fmt: skip


# ============================================================================ f. training
def _gpt(config, vocab: int, context: int, state=None):
    from megatron_bytescale.integration import build_gpt_model

    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=context,
                            use_transformer_engine=False)  # fmt: skip
    if state is not None:
        model.load_state_dict(state)
    return model


def _reference_grads(config, state, sequences, vocab: int, context: int, device: torch.device):
    """megatron-core's own GPT (local spec, DotProductAttention), every sequence alone."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=vocab, max_sequence_length=context,
                     position_embedding_type="rope").to(device)  # fmt: skip
    model.load_state_dict(state)
    loss_tokens = sum(len(s) - 1 for s in sequences)
    total = torch.zeros([], device=device)
    for seq in sequences:
        tokens = torch.as_tensor(seq, dtype=torch.long, device=device)[None]
        labels = torch.zeros_like(tokens)
        labels[0, :-1] = tokens[0, 1:]
        positions = torch.arange(tokens.shape[1], device=device)[None]
        losses = model(tokens, positions, None, labels=labels)
        total = total + losses[0, :-1].float().sum()
    (total / loss_tokens).backward()
    return {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}


def _hdp_steps(manager, config, state, batches, *, vocab, context, capacity, device, **wrap):
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration import (
        ByteScaleConfig,
        make_step_planner,
        run_hdp_step,
        wrap_for_hdp,
    )
    from megatron_bytescale.planner import preset_cost_model

    ddp, optimizer = wrap_for_hdp(_gpt(config, vocab, context, state), lr=3e-3, **wrap)
    planner = make_step_planner(ByteScaleConfig(hdp=True, capacity=capacity, context_length=context),
                                hdp_size=manager.size, cost_model=preset_cost_model("llama-7b", "h100"))
    losses, grads = [], []
    for step in HDPDataIterator(batches, planner=planner, hdp=manager.hdp, device=device):
        captured: dict[str, torch.Tensor] = {}
        original = optimizer.step

        def capturing_step(original=original, captured=captured):
            for name, param in ddp.module.named_parameters():
                captured[name.removeprefix("module.")] = param.main_grad.detach().float().clone()
            optimizer.step = original
            return original()

        optimizer.step = capturing_step
        record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        losses.append(record.loss_sum / record.global_loss_tokens)
        grads.append(captured)
    return losses, grads


def section_training(rec: Recorder, device: torch.device) -> None:
    from megatron_bytescale.integration import make_transformer_config, seed_model_parallel

    manager = _distributed(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the gradient check
        torch.backends.cudnn.allow_tf32 = False
    vocab, context = (256, 256) if rec.small else (1024, 2048)
    capacity = context
    shape = (dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
             if rec.small else
             dict(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1536))
    g = torch.Generator().manual_seed(3)
    lengths = [context, context // 2, 97, 64, 33, 17, 9, 2, 1, context // 4]
    sequences = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    seed_model_parallel(2)
    fp32 = make_transformer_config(**shape)
    state = {k: (v.detach().clone() if torch.is_tensor(v) else v)
             for k, v in _gpt(fp32, vocab, context).state_dict().items()}
    # fp32: HDP gradients equal megatron-core's own GPT, one sequence at a time
    if rec.time_left() > 5:
        _, grads = _hdp_steps(manager, fp32, state, [sequences], vocab=vocab, context=context,
                              capacity=capacity, device=device, distributed_optimizer=False,
                              clip_grad=0.0)  # fmt: skip
        reference = _reference_grads(fp32, state, sequences, vocab, context, device)
        errors = {n: relerr(grads[0][n], reference[n]) for n in reference if n in grads[0]}
        worst = max(errors.values()) if errors else float("inf")
        rec.write("fp32_grads_vs_megatron", ok=worst <= FP32_TOLERANCE and len(errors) == len(reference),
                  worst=worst, parameters=len(errors), worst_parameter=max(errors, key=errors.get))
    # bf16 + distributed optimizer + clip 1.0 (CUDA): the loss drops. On CPU megatron-core's
    # mixed-precision optimizer refuses CPU tensors, so --small runs this part in fp32.
    if rec.time_left() > 5:
        cuda = device.type == "cuda"
        dtype = dict(bf16=True, params_dtype=torch.bfloat16) if cuda else {}
        steps = 4 if rec.small else 10
        losses, _ = _hdp_steps(manager, make_transformer_config(**dtype, **shape), state,
                               [sequences] * steps, vocab=vocab, context=context,
                               capacity=capacity, device=device, distributed_optimizer=cuda,
                               clip_grad=1.0 if cuda else 0.0)  # fmt: skip
        rec.write("loss_drops", ok=losses[-1] < losses[0] * 0.98, losses=[round(x, 4) for x in losses],
                  dtype="bf16" if cuda else "fp32", distributed_optimizer=cuda,
                  clip_grad=1.0 if cuda else 0.0)  # fmt: skip


# ============================================================================ report
def write_report(path: Path, docs: Path | None = None) -> str:
    """The ``gpu`` section of docs/benchmarks.md (or ``docs``) from a run's JSON lines."""
    sys.path.insert(0, str(REPO / "scripts"))
    from benchmarks_md import markdown_table, write_section

    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    by = lambda section: [r for r in records if r["section"] == section]  # noqa: E731
    env = next((r for r in records if r["name"] == "environment"), {})
    start = next((r for r in records if r["name"] == "start"), {})
    lines = ["## gpu: the prepared GPU check (scripts/gpu_check.py)", ""]
    if start.get("small"):
        lines.append("**This is the `--small` run on a CPU (toy sizes), not a GPU run**: it shows the "
                     "check's sections work end to end; throughput numbers mean nothing here.")
        lines.append("")
    machine = env.get("gpu") or f"{env.get('cpus', '?')}-core CPU"
    lines.append(f"Machine: {machine} (capability {env.get('capability', '-')}), torch {env.get('torch')}, "
                 f"CUDA {env.get('cuda')}, Python {env.get('python')}, megatron-core {env.get('megatron.core')}, "
                 f"flash-attn {env.get('flash_attn')}, Transformer Engine {env.get('transformer_engine')}. "
                 f"Run time {next((r.get('elapsed_s') for r in records if r['name'] == 'done'), '?')} s.")
    failures = [f"{r['section']} {r['name']}" for r in records if r.get("ok") is False]
    errors = [f"{r['section']} {r['name']}" for r in records if "error" in r and r.get("ok") is None]
    lines += ["", f"{len(records)} measurements; failed checks: {', '.join(failures) or 'none'}; "
              f"errors: {', '.join(errors) or 'none'}.", ""]
    for section, title, keys in (
        ("a", "Environment", None),
        ("b", "Attention blocks vs float64 (max-norm relative error)", ["out", "lse", "dq", "dk", "dv", "ok"]),
        ("c", "Emulated rings vs float64", ["ring_size", "dkv_wire", "sync_free", "out", "dq", "dk", "dv", "ok"]),
        ("d", "Block fwd+bwd TFLOP/s, ring wrapper vs bare kernel",
         ["block", "local_tokens", "bare_tflops", "ring_tflops", "ring_vs_bare", "overhead", "target",
          "meets_target"]),
        ("e", "LLaMA-7B-shaped layer", ["tokens", "seconds", "activation_bytes_per_token", "alpha1",
                                         "beta1", "alpha1_vs_preset", "beta1_vs_preset", "activation_vs_preset"]),
        ("f", "One-GPU HDP training", ["ok", "worst", "losses"]),
        ("g", "Activation offload against the ratio", ["offload_ratio", "resident_bytes", "resident_fraction",
         "eq3_fraction", "step_s", "overhead", "offloaded_bytes", "host_pool_bytes", "ok"]),
    ):  # fmt: skip
        rows = by(section)
        if not rows:
            continue
        lines += [f"### {section}. {title}", ""]
        if keys is None:
            lines.append(markdown_table(["name", "values"], [[r["name"], json.dumps(
                {k: v for k, v in r.items() if k not in ("section", "name", "t_s")})] for r in rows]))
        else:
            lines.append(markdown_table(["name", *keys], [[r["name"], *(r.get(k, r.get("skipped", "")) if k == keys[0]
                                         else r.get(k, "") for k in keys)] for r in rows]))  # fmt: skip
        lines.append("")
    body = "\n".join(lines)
    if docs is None:
        write_section("gpu", body)
    else:
        write_section("gpu", body, path=docs)
    return body


# ============================================================================ main
def section_offload_g(rec: Recorder, device: torch.device) -> None:
    section_offload(rec, device, best_time_s=best_time_s, relerr=relerr)


RUNNERS = {"a": section_env, "b": section_blocks, "c": section_rings, "d": section_throughput,
           "e": section_layer, "f": section_training, "g": section_offload_g}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy sizes on the CPU (the test suite runs this)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "gpu_check.jsonl",
                        help="JSON lines, appended one per measurement")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="time for all sections (default 420 on a GPU, 600 with --small)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="e.g. a,b,c")
    parser.add_argument("--report", type=Path, default=None,
                        help="write docs/benchmarks.md section 'gpu' from this JSON-lines file and exit")
    parser.add_argument("--docs", type=Path, default=None,
                        help="with --report: the markdown file to write (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.report is not None:
        if not args.report.is_file():
            parser.error(f"--report {args.report}: no such file")
        print(write_report(args.report, args.docs))
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    if args.small:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        parser.error("no CUDA device here; run with --small for the CPU version")
    budget = args.budget_s if args.budget_s is not None else (600.0 if args.small else 420.0)
    rec = Recorder(args.out, budget, args.small)
    rec.write("start", small=args.small, sections=sections, budget_s=budget, argv=sys.argv[1:])
    try:
        for section in sections:
            rec.begin(section, SHARES[section])
            try:
                RUNNERS[section](rec, device)
            except Exception as exc:  # noqa: BLE001 - record it, go on with the next section
                rec.write("error", ok=False, error=f"{type(exc).__name__}: {exc}"[:1000],
                          traceback=traceback.format_exc()[-4000:])  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rec.section = "-"
        rec.write("done", failures=rec.failures, elapsed_s=round(rec.elapsed(), 1))
    finally:
        rec.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
