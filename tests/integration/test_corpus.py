"""Demo corpora and global-batch packing."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from megatron_bytescale.data.corpus import (
    byte_tokens,
    jsonl_documents,
    split_definitions,
    stdlib_documents,
)
from megatron_bytescale.data.global_batches import global_batches


def test_split_definitions_keeps_every_byte():
    source = b"import os\n\ndef f():\n    pass\n\nclass A:\n    def m(self):\n        return 1\n"
    parts = split_definitions(source)
    assert b"\n".join(parts) == source
    assert [p.split(b"\n")[0].strip()[:5] for p in parts] == [
        b"impor",
        b"def f",
        b"class",
        b"def m",
    ]


def test_stdlib_documents_are_deterministic_bytes():
    first = list(itertools.islice(stdlib_documents(seed=3), 50))
    again = list(itertools.islice(stdlib_documents(seed=3), 50))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert all(d.min() >= 0 and d.max() < 256 and len(d) >= 2 for d in first)


def test_global_batches_cover_the_documents_in_order():
    docs = [np.arange(n) % 256 for n in (5, 40, 3, 70, 9, 1, 30)]
    batches = list(global_batches(iter(docs), tokens_per_batch=32, context_length=20))
    stream = np.concatenate([s for b in batches for s in b.tokens_by_seq])
    kept = np.concatenate([d for d in docs if len(d) >= 2])
    assert np.array_equal(stream, kept[: len(stream)])
    for batch in batches:
        assert 31 <= batch.total_tokens <= 32
        assert max(batch.lengths) <= 20 and min(batch.lengths) >= 2


def test_jsonl_documents(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["hello", "wörld", "x"]) + "\n")
    docs = list(jsonl_documents(path, repeat=False))
    assert [d.tolist() for d in docs] == [
        byte_tokens("hello").tolist(),
        byte_tokens("wörld").tolist(),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text"}\n')
    with pytest.raises(ValueError, match="no 'text' field"):
        list(jsonl_documents(bad, repeat=False))
