"""Attention with a kept prefix (a ring micro-batch split into causal chunks) against a
single-process full-sequence reference: one 2-process spawn covers a ring of 2 with 2 and 3
chunks, uneven documents (one shorter than the chunk count, so some chunks lack it), align > 1,
GQA, one chunk (the plain ring), local rings, and the order checks.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.zigzag import causal_chunks
from megatron_bytescale.testing.distributed import run_distributed

from chunk_cases import chunk_cases_body, compare

TOLERANCE = 1e-5

CASES = [
    dict(ring=(0, 1), num_chunks=2, lengths=[37, 20], seed=1, d_model=12, n_q=4, n_kv=2, head_dim=8),
    dict(ring=(1, 0), num_chunks=3, lengths=[41, 2, 17, 9], seed=2, d_model=10, n_q=2, n_kv=1,
         head_dim=8, align=2),
    dict(ring=(0, 1), num_chunks=3, lengths=[64], seed=3, d_model=8, n_q=4, n_kv=4, head_dim=4,
         backend="math"),
    dict(ring=(0, 1), num_chunks=1, lengths=[23, 11], seed=4, d_model=8, n_q=2, n_kv=2, head_dim=4),
    dict(ring="local", num_chunks=3, lengths=[30, 19, 25, 7], seed=5, d_model=8, n_q=4, n_kv=2,
         head_dim=4),
]


def test_causal_chunks_tile_the_sequence():
    assert causal_chunks(10, 3) == ((0, 3), (3, 6), (6, 10))
    assert causal_chunks(2, 3) == ((0, 0), (0, 1), (1, 2))
    assert causal_chunks(7, 1) == ((0, 7),)
    with pytest.raises(ValueError, match="num_chunks"):
        causal_chunks(10, 0)


def test_chunked_attention_matches_full_sequence_reference():
    results = run_distributed(2, chunk_cases_body, CASES, timeout_s=240)
    for ci, case in enumerate(CASES):
        errors = compare(case, [r[ci] for r in results])
        worst = max(errors.values())
        assert worst <= TOLERANCE, f"case {ci} ({case['num_chunks']} chunks, {case['lengths']}): {errors}"
        if case["num_chunks"] > 1:  # the prefix was really kept (not recomputed or re-sent)
            assert all(r[ci]["kept_bytes"] > 0 for r in results)
    for messages in (r[-1] for r in results):
        assert len(messages) == 3, messages
        assert "forward out of order" in messages[0]
        assert "forward ran twice" in messages[1]
        assert "backward out of order" in messages[2]


def test_chunk_micro_batches_from_a_plan_hold_every_token_once_with_global_labels():
    import torch

    from megatron_bytescale.planner.plan import PlanBuilder
    from megatron_bytescale.runtime import build_micro_batch, chunk_layout_for, layout_for

    lengths = {0: 50, 1: 30, 2: 9, 4: 2, 5: 13}
    b = PlanBuilder(hdp_size=4, capacity=64, lengths=lengths, align=2)
    b.add((0, 1), (0, 1), num_chunks=2)
    b.add((2,), (5, 4), num_chunks=3)
    b.add((3,), (2,))
    plan = b.build(scheduler="x", pp_size=2, layers_per_stage=4).validate()
    tokens = {s: torch.arange(n) + 100 * s + 1 for s, n in lengths.items()}  # id: 100 s + pos + 1
    seen: dict[tuple[int, int], int] = {}
    for rank in range(4):
        for index, mb in enumerate(plan.ranks[rank].micro_batches):
            t = build_micro_batch(plan, rank, index, tokens)
            assert (t.chunk is None) == (mb.chunk is None)
            if mb.chunk is not None:
                assert t.chunk.chunk == mb.chunk[0] and t.layout is t.chunk.layout
                with pytest.raises(ValueError, match="use chunk_layout_for"):
                    layout_for(plan, rank, index)
                assert chunk_layout_for(plan, rank, index).starts == t.chunk.starts
            real = t.layout.real_mask()
            for tok, lab, mask, pos in zip(t.tokens[real].tolist(), t.labels[real].tolist(),
                                           t.loss_mask[real].tolist(), t.position_ids[real].tolist()):
                seq, at = divmod(tok - 1, 100)
                assert at == pos, "position ids are positions in the whole sequence"
                last = pos == lengths[seq] - 1
                assert mask == (0.0 if last else 1.0) and (last or lab == tok + 1)
                seen[(seq, pos)] = seen.get((seq, pos), 0) + 1
    assert seen == {(s, p): 1 for s, n in lengths.items() for p in range(n)}
