"""Synthetic length generators (paper §1.2 statistics), lengths files and Megatron .idx lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_bytescale.data.lengths import LengthsFileError, read_lengths, write_lengths
from megatron_bytescale.data.synthetic import GENERATORS, synthetic_lengths

TOKENS = 32 * 2**20
M2 = 2_097_152
K = 1024


def token_share(lengths: np.ndarray, mask: np.ndarray) -> float:
    return float(lengths[mask].sum() / lengths.sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_byted_statistics(seed):
    """Paper: ~80 % of samples <= 4K; 0.05 % reach 2M holding 12.1 % of tokens; 1 % of samples
    (>= 128K) hold 44.3 %; 37 % of tokens in sequences > 256K. Tolerance: +-3 points on token
    shares (2M sequences come whole: two of them are 12.5 % of 32M), +-4 points on the sample
    share <= 4K, 0.03 points on the 2M sample share, 0.3 points on the >= 128K sample share."""
    x = synthetic_lengths("byted", TOKENS, seed=seed)
    assert int(x.sum()) == TOKENS and x.max() <= M2 and x.min() >= 1
    assert np.mean(x <= 4 * K) == pytest.approx(0.80, abs=0.04)
    assert np.mean(x == M2) == pytest.approx(0.0005, abs=0.0003)
    assert token_share(x, x == M2) == pytest.approx(0.121, abs=0.03)
    assert np.mean(x >= 128 * K) == pytest.approx(0.01, abs=0.003)
    assert token_share(x, x >= 128 * K) == pytest.approx(0.443, abs=0.03)
    assert token_share(x, x > 256 * K) == pytest.approx(0.37, abs=0.03)


@pytest.mark.parametrize("seed", [0, 1])
def test_github_statistics(seed):
    """Paper: 16.2 % of tokens from sequences > 128K, 9.8 % > 256K (+-2 points)."""
    x = synthetic_lengths("github", TOKENS, seed=seed)
    assert int(x.sum()) == TOKENS and x.max() <= M2
    assert token_share(x, x > 128 * K) == pytest.approx(0.162, abs=0.02)
    assert token_share(x, x > 256 * K) == pytest.approx(0.098, abs=0.02)


def test_generators_are_seeded_exact_and_clipped():
    for name in GENERATORS:
        a = synthetic_lengths(name, 3_000_000, seed=5, max_length=65536)
        b = synthetic_lengths(name, 3_000_000, seed=5, max_length=65536)
        assert np.array_equal(a, b), name
        assert int(a.sum()) == 3_000_000 and a.max() <= 65536 and a.min() >= 1, name
        assert a.dtype == np.int64
        assert not np.array_equal(a, synthetic_lengths(name, 3_000_000, seed=6, max_length=65536)), name
    tiny = synthetic_lengths("byted", 10, seed=0)
    assert int(tiny.sum()) == 10


def test_synthetic_bad_input():
    with pytest.raises(ValueError, match="unknown synthetic dataset 'pile'"):
        synthetic_lengths("pile", 100)
    with pytest.raises(ValueError, match=r"global_tokens \(0\)"):
        synthetic_lengths("byted", 0)
    with pytest.raises(ValueError, match=r"max_length \(0\)"):
        synthetic_lengths("github", 10, max_length=0)


# --------------------------------------------------------------------------- files
def test_text_and_json_lengths(tmp_path):
    t = tmp_path / "l.txt"
    t.write_text("# lengths\n5\n\n 7 \n9\n")
    assert read_lengths(t).tolist() == [5, 7, 9]
    j = tmp_path / "l.json"
    j.write_text(json.dumps([3, 1, 4]))
    assert read_lengths(j).tolist() == [3, 1, 4]
    w = tmp_path / "w.txt"
    write_lengths(w, [1, 2, 3])
    assert read_lengths(w).tolist() == [1, 2, 3]


@pytest.mark.parametrize("content, match", [
    ("5\n7\nabc\n", r"l.txt, line 3: 'abc' is not an integer"),
    ("5\n0\n", r"l.txt, line 2: length 0 must be >= 1"),
    ("5\n2.5\n", r"line 2: '2.5' is not an integer"),
    ("[1, 2.5]", r"l.txt: element 1 \(2.5\) is not an integer"),
    ("[1, -3]", r"element 1 is -3"),
    ("[1, 2", r"l.txt is not valid JSON \(line 1"),
    ('[1, "2"]', r"element 1 \('2'\)"),
])
def test_malformed_lengths_files(tmp_path, content, match):
    p = tmp_path / "l.txt"
    p.write_text(content)
    with pytest.raises(LengthsFileError, match=match):
        read_lengths(p)


def test_missing_lengths_file(tmp_path):
    with pytest.raises(LengthsFileError, match="nope.txt' does not exist"):
        read_lengths(tmp_path / "nope.txt")
    with pytest.raises(LengthsFileError, match="is a directory"):
        read_lengths(tmp_path)
    p = tmp_path / "obj.json"  # JSON, but not a list
    p.write_text('{"a": 1}')
    with pytest.raises(LengthsFileError, match="obj.json: expected a JSON list of lengths .* got an object"):
        read_lengths(p)


def test_megatron_index_lengths(tmp_path):
    """Document lengths through megatron-core's index reader; the .bin is never needed."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    from megatron_bytescale.integration.indexed_lengths import read_indexed_lengths

    # 5 sequences in 3 documents (one empty): [3, 4], [], [5, 6, 7]
    with _IndexWriter(str(tmp_path / "corpus.idx"), np.int32) as w:
        w.write([3, 4, 5, 6, 7], None, [0, 2, 2, 5])
    for path in ("corpus", "corpus.idx", "corpus.bin"):
        assert read_indexed_lengths(tmp_path / path).tolist() == [7, 18]
    (tmp_path / "bad.idx").write_bytes(b"not an index at all, really")
    with pytest.raises(ValueError, match="bad.idx' is not a readable Megatron index file"):
        read_indexed_lengths(tmp_path / "bad.idx")
    with pytest.raises(ValueError, match="missing.idx' does not exist"):
        read_indexed_lengths(tmp_path / "missing")
    # and through the CLI (a prefix whose .idx exists is read as an indexed dataset)
    from megatron_bytescale.tools.plan_cmd import main

    assert main([str(tmp_path / "corpus"), "--hdp-size", "4", "--capacity", "8", "--quiet"]) == 0
