"""Every dtype the ``torch`` backend claims, and plan-stated zigzag splits, on real gloo rings.

One 4-process spawn. Each case runs a random plan (rings of 1-4 members, several sequences, a
1-token one) through the distributed ring attention, forward and backward, and compares with a
float64 reference on the same (rounded) inputs; float64 must be exact to 1e-12 (it used to crash
in the backward and hang the peers). Every rank also emulates its whole ring in one process with
the public single-step API (``emulate_ring_attention``) and checks that the distributed result
equals it: the emulation that ``scripts/gpu_check.py`` times on one GPU is the ring's own code.
"""

from __future__ import annotations

import random

import torch

from megatron_bytescale.planner import PlanBuilder, even_zigzag_split
from megatron_bytescale.testing.distributed import run_distributed

from runtime_cases import compare_with_reference, global_tensors, local_inputs, scatter_results

N_Q, N_KV, HEAD_DIM = 4, 2, 8
CASES = [  # (dtype, dkv_wire, even split, tolerance vs float64)
    ("float64", "accumulator", False, 1e-12),
    ("float32", "accumulator", True, 1e-5),
    ("float16", "accumulator", False, 2e-2),
    ("bfloat16", "input", True, 2e-2),
]


def _plan(seed: int, even: bool):
    rng = random.Random(seed)
    lengths, rings, sid = {}, [], 0
    for size in (4, 2, 1, 3):
        members = rng.sample(range(4), size)
        seqs = []
        for _ in range(rng.randint(1, 3)):
            lengths[sid] = rng.randint(1, 40)
            seqs.append(sid)
            sid += 1
        rings.append((members, seqs))
    lengths[0] = 1  # a 1-token sequence on the 4-ring: most parts empty
    builder = PlanBuilder(hdp_size=4, capacity=10**9, lengths=lengths)
    for members, seqs in rings:
        splits = {s: even_zigzag_split(lengths[s], len(members)) for s in seqs} if even else None
        builder.add(members, seqs, splits=splits)
    return builder.build(scheduler="dtype-test").validate()


def _body(rank: int, world: int) -> list:
    from megatron_bytescale.runtime import (
        HDPGroup,
        emulate_ring_attention,
        layout_for,
        ring_attention,
    )

    hdp = HDPGroup()
    out = []
    for ci, (dtype_name, wire, even, _) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        plan = _plan(ci, even)
        data = global_tensors(ci, plan, N_Q, N_KV, HEAD_DIM, dtype)
        rows, emulation_gap = [], 0.0
        for index, mb in enumerate(plan.ranks[rank].micro_batches):
            layout = layout_for(plan, hdp, index)
            x = local_inputs(layout, data, fill=0.0)
            q, k, v = (x[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
            o = ring_attention(q, k, v, layout, hdp, dkv_wire=wire)
            o.backward(x["dout"].to(dtype))
            got = dict(out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
            assert all(t.dtype == dtype for t in got.values()), {n: t.dtype for n, t in got.items()}
            rows.append(scatter_results(layout, got))
            layouts = [layout_for(plan, m, index if m == rank else _index(plan, m, mb.order))
                       for m in mb.ring]  # fmt: skip
            xs = [local_inputs(l, data, fill=0.0) for l in layouts]
            em = emulate_ring_attention(*([x_[n].to(dtype) for x_ in xs] for n in ("q", "k", "v")),
                                        layouts, [x_["dout"].to(dtype) for x_ in xs],
                                        dkv_wire=wire)  # fmt: skip
            p = layout.ring.position
            for name, mine in got.items():
                theirs = getattr(em, name)[p]
                gap = (mine.double() - theirs.double()).abs().max().item()
                emulation_gap = max(emulation_gap, gap / max(theirs.double().abs().max().item(), 1e-30))
        out.append(dict(rows=rows, emulation_gap=emulation_gap))
    return out


def _index(plan, rank: int, order: int) -> int:
    return [mb.order for mb in plan.ranks[rank].micro_batches].index(order)


def test_dtypes_and_plan_splits_on_4_ranks():
    results = run_distributed(4, _body, timeout_s=300)
    for ci, (dtype_name, wire, even, tolerance) in enumerate(CASES):
        plan = _plan(ci, even)
        errors = compare_with_reference(plan, [r[ci]["rows"] for r in results], ci, N_Q, N_KV,
                                        HEAD_DIM, dtype=getattr(torch, dtype_name))  # fmt: skip
        assert max(errors.values()) <= tolerance, (dtype_name, wire, even, errors)
        gaps = [r[ci]["emulation_gap"] for r in results]
        assert max(gaps) == 0.0, (dtype_name, gaps)  # bit for bit: same steps, additions, wire
