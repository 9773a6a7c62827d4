"""Shared helpers of the runtime tests: random valid plans, global data, the reference, and the
per-rank bodies run inside spawned gloo processes (module-level so that spawn can import them).

Correctness metric everywhere: relative error = max|distributed - reference| / max|reference|
per tensor kind (out, dq, dk, dv), over every real token of every sequence; the reference is a
single-process causal attention per original sequence in float64.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from megatron_bytescale.planner import PlanBuilder, StepPlan

try:  # the planner's schedulers (another engineer's module; the test skips without it)
    from megatron_bytescale.planner.presets import preset_cost_model
    from megatron_bytescale.planner.schedulers import make_plan
except ImportError:  # pragma: no cover - depends on the tree's state
    make_plan = None


# ---------------------------------------------------------------------- plans
def random_plan(
    rng: random.Random,
    *,
    hdp_size: int,
    num_micro_batches: int,
    max_seqs: int = 3,
    max_len: int = 40,
    align: int = 1,
    ring_sizes: tuple[int, ...] | None = None,
) -> StepPlan:
    """A valid plan of rings of random sizes on random (non-contiguous) ranks.

    Rings are added in a global order; each ring gets 1..max_seqs sequences of uneven lengths.
    ``ring_sizes`` forces the ring sizes, in order (cycled).
    """
    lengths: dict[int, int] = {}
    rings: list[tuple[list[int], list[int]]] = []
    next_seq = 0
    for i in range(num_micro_batches):
        size = ring_sizes[i % len(ring_sizes)] if ring_sizes else rng.randint(1, hdp_size)
        members = rng.sample(range(hdp_size), size)
        seqs = []
        for _ in range(rng.randint(1, max_seqs)):
            lengths[next_seq] = rng.randint(1, max_len)
            seqs.append(next_seq)
            next_seq += 1
        rings.append((members, seqs))
    builder = PlanBuilder(hdp_size=hdp_size, capacity=10**9, lengths=lengths, align=align)
    for members, seqs in rings:
        builder.add(members, seqs)
    return builder.build(scheduler="random-test").validate()


def scheduler_plan(
    hdp_size: int, lengths: list[int], capacity: int, scheduler: str, align: int = 1
) -> StepPlan | None:
    """A plan from the planner's ``make_plan`` (no offload, so long sequences get rings), or
    None when the schedulers are not available."""
    if make_plan is None:
        return None
    plan = make_plan(
        lengths,
        scheduler=scheduler,
        hdp_size=hdp_size,
        capacity=capacity,
        cost_model=preset_cost_model(),
        offload=False,
        align=align,
    )
    return plan.validate()


# ---------------------------------------------------------------------- data
def global_tensors(
    seed: int, plan: StepPlan, n_q: int, n_kv: int, head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> dict[int, dict[str, torch.Tensor]]:
    """q, k, v, dout per sequence, identical on every process: float32 values rounded to
    ``dtype`` (and kept in float32, so a float64 reference sees exactly the kernel's inputs)."""
    out = {}
    for s in plan.sequences:
        g = torch.Generator().manual_seed(seed * 100_003 + s.id)
        out[s.id] = {
            "q": torch.randn(s.length, n_q, head_dim, generator=g),
            "k": torch.randn(s.length, n_kv, head_dim, generator=g),
            "v": torch.randn(s.length, n_kv, head_dim, generator=g),
            "dout": torch.randn(s.length, n_q, head_dim, generator=g),
        }
        if dtype != torch.float32:
            out[s.id] = {k: v.to(dtype).float() for k, v in out[s.id].items()}
    return out


def reference(data: dict[str, torch.Tensor], scale: float | None = None) -> dict[str, torch.Tensor]:
    """Causal attention of one whole sequence in float64 with autograd: out, dq, dk, dv."""
    q = data["q"].double().requires_grad_()
    k = data["k"].double().requires_grad_()
    v = data["v"].double().requires_grad_()
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("qnh,knh->nqk", q, ke) * scale
    L = q.shape[0]
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("nqk,knh->qnh", p, ve)
    out.backward(data["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def local_inputs(layout, data_by_seq, fill: float = float("nan")) -> dict[str, torch.Tensor]:
    """q, k, v, dout in the layout's buffer order; padding rows are ``fill`` (NaN proves they
    are never read)."""
    out = {}
    for name in ("q", "k", "v", "dout"):
        rows = []
        for slot in layout.slots:
            t = data_by_seq[slot.seq][name]
            part = torch.full((slot.num_local, *t.shape[1:]), fill)
            row = 0
            for a, b in slot.parts:  # real tokens first, padding at the end of the slot
                part[row : row + b - a] = t[a:b]
                row += b - a
            rows.append(part)
        out[name] = torch.cat(rows)
    return out


def scatter_results(layout, results: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The real rows of ``results`` as numpy arrays with their ``(seq, position)`` keys.

    (numpy, not tensors: torch shares tensors between processes through file descriptors that
    vanish when the child exits.)
    """
    seqs, positions, rows = [], [], []
    global_positions = layout.global_positions().tolist()
    for slot in layout.slots:
        for row in range(slot.offset, slot.offset + slot.num_real):
            seqs.append(slot.seq)
            positions.append(global_positions[row])
            rows.append(row)
    index = torch.tensor(rows, dtype=torch.long)
    return {
        "seq": seqs,
        "pos": positions,
        **{k: v.detach()[index].double().numpy() for k, v in results.items()},
    }


def compare_with_reference(
    plan: StepPlan, per_rank_rows: list[list], seed, n_q, n_kv, head_dim, scale=None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Relative errors per kind; also asserts every real token came back exactly once.

    The float64 reference sees the inputs rounded to ``dtype`` (what the kernels saw)."""
    data = global_tensors(seed, plan, n_q, n_kv, head_dim, dtype)
    got: dict[tuple[int, int], dict] = {}
    for rank_chunks in per_rank_rows:
        for chunk in rank_chunks:
            for i, (seq, pos) in enumerate(zip(chunk["seq"], chunk["pos"])):
                assert (seq, pos) not in got, f"token {pos} of sequence {seq} computed twice"
                got[(seq, pos)] = {
                    k: torch.from_numpy(chunk[k][i]) for k in ("out", "dq", "dk", "dv")
                }
    expected_tokens = sum(s.length for s in plan.sequences)
    assert len(got) == expected_tokens, f"{len(got)} tokens came back, expected {expected_tokens}"
    errs = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    scale_of = {k: 0.0 for k in errs}
    for s in plan.sequences:
        ref = reference(data[s.id], scale)
        for kind in errs:
            mine = torch.stack([got[(s.id, p)][kind] for p in range(s.length)]).double()
            errs[kind] = max(errs[kind], (mine - ref[kind]).abs().max().item())
            scale_of[kind] = max(scale_of[kind], ref[kind].abs().max().item())
    return {k: errs[k] / scale_of[k] for k in errs}


# ---------------------------------------------------------------------- per-rank bodies
def run_plan_on_rank(
    rank: int,
    plan: StepPlan,
    seed: int,
    n_q: int,
    n_kv: int,
    head_dim: int,
    backend: str | None = None,
    scale: float | None = None,
    counters=None,
    hdp=None,
) -> list:
    """Run every micro-batch of this rank's plan through ring_attention (fwd + bwd).

    ``rank`` is the HDP rank; ``hdp`` defaults to the WORLD group.
    """
    from megatron_bytescale.runtime import HDPGroup, layout_for, ring_attention

    hdp = hdp if hdp is not None else HDPGroup()
    data = global_tensors(seed, plan, n_q, n_kv, head_dim)
    rows = []
    for index, mb in enumerate(plan.ranks[rank].micro_batches):
        layout = layout_for(plan, hdp, index)
        x = local_inputs(layout, data)
        q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
        if counters is not None:
            counters.start_micro_batch(mb.order)
        out = ring_attention(
            q, k, v, layout, hdp, softmax_scale=scale, backend=backend, counters=counters
        )
        out.backward(x["dout"])
        results = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        padding = ~layout.real_mask()
        for name, t in results.items():
            if padding.any():
                assert bool((t[padding] == 0).all()), f"{name} of padding rows is not zero"
            assert bool(torch.isfinite(t[~padding]).all()), f"{name} has non-finite values"
        rows.append(scatter_results(layout, results))
    return rows


def many_plans_body(rank: int, world: int, cases: list[dict[str, Any]]) -> list[list]:
    """Run several plans (one per case) in one spawn; returns per-case rows of this rank."""
    out = []
    for case in cases:
        out.append(
            run_plan_on_rank(
                rank,
                case["plan"],
                case["seed"],
                case["n_q"],
                case["n_kv"],
                case["head_dim"],
                backend=case.get("backend"),
                scale=case.get("scale"),
            )
        )
    return out
