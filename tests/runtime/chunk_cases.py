"""Cases for attention with a kept prefix: a small attention layer run chunk by chunk on a ring,
and its single-process full-sequence reference (float64, autograd).

The layer: ``q, k, v = x Wq, x Wk, x Wv`` (GQA heads), causal attention per document, ``y =
attn Wo``, loss ``sum(y * g)``. Per chunk each rank builds its rows from the global tensors by
the chunk layout's positions, runs the forwards in chunk order and the backwards in reverse,
each chunk its own graph (as a pipeline runs them), and returns its rows' ``out``, ``dq``,
``dk``, ``dv``, ``dx`` keyed by ``(seq, position)`` plus its parameter gradients.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

PARAMS = ("wq", "wk", "wv", "wo")


def global_data(seed: int, lengths: list[int], d_model: int, n_q: int, n_kv: int, head_dim: int):
    g = torch.Generator().manual_seed(seed)
    params = {
        "wq": torch.randn(d_model, n_q * head_dim, generator=g) / math.sqrt(d_model),
        "wk": torch.randn(d_model, n_kv * head_dim, generator=g) / math.sqrt(d_model),
        "wv": torch.randn(d_model, n_kv * head_dim, generator=g) / math.sqrt(d_model),
        "wo": torch.randn(n_q * head_dim, d_model, generator=g) / math.sqrt(n_q * head_dim),
    }
    seqs = {
        s: {"x": torch.randn(n, d_model, generator=g), "g": torch.randn(n, d_model, generator=g)}
        for s, n in enumerate(lengths)
    }
    return params, seqs


def _attend(q, k, v, scale):
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.einsum("qnh,knh->nqk", q, ke) * scale
    n = q.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.einsum("nqk,knh->qnh", torch.softmax(s.masked_fill(~mask, float("-inf")), -1), ve)


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """Whole sequences in one process, float64: per-token out/dq/dk/dv/dx and parameter grads."""
    params, seqs = global_data(case["seed"], case["lengths"], case["d_model"], case["n_q"],
                               case["n_kv"], case["head_dim"])  # fmt: skip
    w = {n: t.double().requires_grad_() for n, t in params.items()}
    scale = 1.0 / math.sqrt(case["head_dim"])
    rows: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for sid, data in seqs.items():
        x = data["x"].double().requires_grad_()
        n = x.shape[0]
        q = (x @ w["wq"]).view(n, case["n_q"], -1)
        k = (x @ w["wk"]).view(n, case["n_kv"], -1)
        v = (x @ w["wv"]).view(n, case["n_kv"], -1)
        for t in (q, k, v):
            t.retain_grad()
        out = _attend(q, k, v, scale)
        y = out.reshape(n, -1) @ w["wo"]
        (y * data["g"].double()).sum().backward()
        for p in range(n):
            rows[(sid, p)] = {"out": out[p].detach(), "dq": q.grad[p], "dk": k.grad[p],
                              "dv": v.grad[p], "dx": x.grad[p]}  # fmt: skip
    return {"rows": rows, "params": {n: t.grad for n, t in w.items()}}


def run_case_on_rank(rank: int, case: dict[str, Any], hdp) -> dict[str, Any]:
    """Run one case's chunks on this rank (fwd in order, bwd reversed); rows and param grads."""
    from megatron_bytescale.runtime.chunked_attention import (
        ChunkPrefix,
        chunked_ring_attention,
        make_chunk_layout,
    )

    params, seqs = global_data(case["seed"], case["lengths"], case["d_model"], case["n_q"],
                               case["n_kv"], case["head_dim"])  # fmt: skip
    w = {n: t.clone().requires_grad_() for n, t in params.items()}
    members = case["ring"] if case["ring"] != "local" else (rank,)
    ring = hdp.ring(members)
    # a local ring carries this rank's own documents: rank r takes every other sequence
    ids = [s for s in seqs if case["ring"] != "local" or s % 2 == rank]
    k = case["num_chunks"]
    prefix = ChunkPrefix(k)
    losses, keep = [], []
    for chunk in range(k):
        cl = make_chunk_layout(ring, [(s, len(seqs[s]["x"])) for s in ids], chunk=chunk,
                               num_chunks=k, align=case.get("align", 1))  # fmt: skip
        layout = cl.layout
        positions = cl.global_positions()
        real = layout.real_mask()
        x = torch.zeros(layout.num_tokens, case["d_model"])
        g = torch.zeros(layout.num_tokens, case["d_model"])
        for slot in layout.slots:
            rows = slice(slot.offset, slot.offset + slot.num_real)
            x[rows] = seqs[slot.seq]["x"][positions[rows]]
            g[rows] = seqs[slot.seq]["g"][positions[rows]]
        x.requires_grad_()
        n = layout.num_tokens
        nan_pad = torch.where(real, 0.0, float("nan")).view(n, 1, 1)  # padding is never read
        q = (x @ w["wq"]).view(n, case["n_q"], -1) + nan_pad
        kk = (x @ w["wk"]).view(n, case["n_kv"], -1) + nan_pad
        v = (x @ w["wv"]).view(n, case["n_kv"], -1) + nan_pad
        for t in (q, kk, v):
            t.retain_grad()
        out = chunked_ring_attention(q, kk, v, cl, prefix, hdp, backend=case.get("backend"))
        y = out.reshape(n, -1) @ w["wo"]
        losses.append((y * g).sum())
        keep.append((cl, x, q, kk, v, out))
    kept_before = prefix.kept_bytes()
    for chunk in reversed(range(k)):
        losses[chunk].backward()
    assert prefix.done and prefix.kept_bytes() == 0, "the prefix still holds tensors after the last backward"
    result_rows = []
    for cl, x, q, kk, v, out in keep:
        layout = cl.layout
        positions = cl.global_positions().tolist()
        for name, t in (("dq", q.grad), ("dk", kk.grad), ("dv", v.grad)):
            pad = ~layout.real_mask()
            assert bool((t[pad] == 0).all()), f"{name} of padding rows is not zero"
        for slot, start in zip(layout.slots, cl.starts):
            for row in range(slot.offset, slot.offset + slot.num_real):
                result_rows.append({
                    "seq": slot.seq, "pos": positions[row],
                    **{name: t[row].detach().double().numpy() for name, t in
                       (("out", out), ("dq", q.grad), ("dk", kk.grad), ("dv", v.grad), ("dx", x.grad))},
                })  # fmt: skip
    return {"rows": result_rows, "params": {n: t.grad.double().numpy() for n, t in w.items()},
            "kept_bytes": kept_before}  # fmt: skip


def compare(case: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Relative errors per kind against :func:`reference`; every token exactly once."""
    ref = reference(case)
    got: dict[tuple[int, int], dict] = {}
    for result in per_rank:
        for row in result["rows"]:
            key = (row["seq"], row["pos"])
            assert key not in got, f"token {key[1]} of sequence {key[0]} computed twice"
            got[key] = row
    assert set(got) == set(ref["rows"]), (
        f"tokens missing: {sorted(set(ref['rows']) - set(got))[:5]}, extra: {sorted(set(got) - set(ref['rows']))[:5]}"
    )
    errors = {}
    for kind in ("out", "dq", "dk", "dv", "dx"):
        err = max(float(np.abs(got[key][kind] - ref["rows"][key][kind].numpy()).max()) for key in got)
        top = max(float(ref["rows"][key][kind].abs().max()) for key in got)
        errors[kind] = err / top
    for name in PARAMS:
        mine = sum(r["params"][name] for r in per_rank)
        want = ref["params"][name].numpy()
        errors[name] = float(np.abs(mine - want).max() / np.abs(want).max())
    return errors


def chunk_cases_body(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Every case in one spawn, then the order checks; returns per-case results."""
    from megatron_bytescale.runtime import HDPGroup

    hdp = HDPGroup()
    out = [run_case_on_rank(rank, case, hdp) for case in cases]
    out.append(order_errors(rank, hdp))
    return out


def order_errors(rank: int, hdp) -> list[str]:
    """Forwards out of order and backwards not reversed raise (on a local ring, no peers)."""
    from megatron_bytescale.runtime.chunked_attention import (
        ChunkPrefix,
        chunked_ring_attention,
        make_chunk_layout,
    )

    ring = hdp.ring((rank,))
    messages = []
    layouts = [make_chunk_layout(ring, [(0, 12)], chunk=c, num_chunks=2) for c in range(2)]

    def qkv(cl):
        n = cl.layout.num_tokens
        return [torch.randn(n, 2, 4, requires_grad=True) for _ in range(3)]

    prefix = ChunkPrefix(2)
    try:
        chunked_ring_attention(*qkv(layouts[1]), layouts[1], prefix, hdp)
    except RuntimeError as exc:
        messages.append(str(exc))
    prefix = ChunkPrefix(2)
    chunked_ring_attention(*qkv(layouts[0]), layouts[0], prefix, hdp)
    try:  # what activation recomputation would do
        chunked_ring_attention(*qkv(layouts[0]), layouts[0], prefix, hdp)
    except RuntimeError as exc:
        messages.append(str(exc))
    prefix = ChunkPrefix(2)
    outs = [chunked_ring_attention(*qkv(cl), cl, prefix, hdp) for cl in layouts]
    try:
        outs[0].sum().backward()
    except RuntimeError as exc:
        messages.append(str(exc))
    return messages
