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
        assert len(messages) == 2, messages
        assert "forward out of order" in messages[0]
        assert "backward out of order" in messages[1]
