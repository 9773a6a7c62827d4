"""The per-document zigzag split, against values computed by hand and an independent formula.

Every expectation here is written out (or computed by a formula in this file), never taken from
``planner/zigzag.py`` itself: a split that ignored ``align`` or put padding elsewhere must fail.
Lengths are chosen so that they do NOT divide evenly by 2N, and align takes 2, 3, 4 and 8.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.planner.zigzag import (
    zigzag_chunk,
    zigzag_part_ids,
    zigzag_parts,
    zigzag_share,
)

# (length, ring size N, align, padded part size), by hand: ceil(length / 2N), rounded up to align
CHUNKS = [
    (10, 2, 1, 3),      # 10 / 4 = 2.5 -> 3
    (10, 2, 2, 4),      # 3 -> 4
    (10, 2, 3, 3),      # 3 is already a multiple of 3
    (10, 2, 4, 4),
    (10, 2, 8, 8),
    (23, 3, 2, 4),      # 23 / 6 = 3.83 -> 4
    (23, 3, 3, 6),      # 4 -> 6
    (23, 3, 8, 8),
    (37, 5, 2, 4),      # 37 / 10 = 3.7 -> 4
    (37, 5, 3, 6),
    (37, 5, 8, 8),
    (50, 3, 2, 10),     # 50 / 6 = 8.33 -> 9 -> 10
    (50, 3, 4, 12),
    (100, 4, 3, 15),    # 100 / 8 = 12.5 -> 13 -> 15
    (100, 4, 4, 16),
    (100, 4, 8, 16),
    (1001, 6, 3, 84),   # 1001 / 12 = 83.4 -> 84 = 3 * 28
    (1001, 6, 8, 88),   # 84 -> 88
    (1, 4, 2, 2),       # one token, 8 parts: 1 -> 2
    (7, 1, 4, 4),       # ring of 1: 2 parts, 3.5 -> 4 (the share is the whole sequence anyway)
]


@pytest.mark.parametrize("length, ring, align, chunk", CHUNKS)
def test_chunk_by_hand(length, ring, align, chunk):
    assert zigzag_chunk(length, ring, align) == chunk


# (length, N, align) -> the share of every ring position, by hand
SHARES = {
    # chunk 6: parts [0,6) [6,12) [12,18) [18,23) and two empty ones
    (23, 3, 3): [[(0, 6)], [(6, 12)], [(12, 18), (18, 23)]],
    # chunk 4: parts [0,4) [4,8) [8,10) [10,10)
    (10, 2, 4): [[(0, 4)], [(4, 8), (8, 10)]],
    # chunk 3 (align 1): parts [0,3) [3,6) [6,9) [9,10): position 0 holds parts 0 and 3
    (10, 2, 1): [[(0, 3), (9, 10)], [(3, 6), (6, 9)]],
    # chunk 4: ten parts, the last [36,37)
    (37, 5, 2): [[(0, 4), (36, 37)], [(4, 8), (32, 36)], [(8, 12), (28, 32)],
                 [(12, 16), (24, 28)], [(16, 20), (20, 24)]],
    # chunk 8: parts [0,8) ... [32,37), parts 5-9 are all padding
    (37, 5, 8): [[(0, 8)], [(8, 16)], [(16, 24)], [(24, 32)], [(32, 37)]],
    # chunk 15: parts [0,15) ... [90,100) [105..) empty: position 1 holds parts 1 and 6
    (100, 4, 3): [[(0, 15)], [(15, 30), (90, 100)], [(30, 45), (75, 90)], [(45, 60), (60, 75)]],
    # one token on 4 ranks: only position 0 holds anything
    (1, 4, 2): [[(0, 1)], [], [], []],
    # a ring of one holds the whole sequence, unpadded
    (7, 1, 4): [[(0, 7)]],
}


@pytest.mark.parametrize("key", sorted(SHARES), ids=str)
def test_share_by_hand(key):
    length, ring, align = key
    got = [zigzag_share(length, ring, p, align) for p in range(ring)]
    assert got == SHARES[key]


def test_align_defaults_to_one_and_an_empty_sequence_holds_nothing():
    assert zigzag_chunk(10, 2) == 3 and zigzag_parts(10, 2) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert zigzag_share(10, 2, 0) == [(0, 3), (9, 10)]
    assert zigzag_share(0, 1, 0) == [] and zigzag_share(0, 3, 1) == []


def test_parts_and_part_ids_by_hand():
    assert zigzag_parts(10, 2, 4) == [(0, 4), (4, 8), (8, 10), (10, 10)]
    assert zigzag_parts(23, 3, 3) == [(0, 6), (6, 12), (12, 18), (18, 23), (23, 23), (23, 23)]
    assert [zigzag_part_ids(4, p) for p in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def _independent_share(length: int, ring: int, position: int, align: int) -> list[tuple[int, int]]:
    """The zigzag share from the definition: parts of the smallest multiple of ``align`` that is
    at least length / 2N (one integer division, not two ceilings), padding at the end."""
    if ring == 1:
        return [(0, length)]
    chunk = align * -(-length // (2 * ring * align))
    out = []
    for part in (position, 2 * ring - 1 - position):
        start, end = part * chunk, min((part + 1) * chunk, length)
        if start < end:
            out.append((start, end))
    return out


@pytest.mark.parametrize("align", [1, 2, 3, 4, 8])
def test_matches_an_independent_formula(align):
    for ring in (1, 2, 3, 4, 5, 7, 9):
        for length in range(1, 160):
            chunk = zigzag_chunk(length, ring, align)
            # the smallest aligned part size whose 2N parts hold the whole sequence
            assert chunk % align == 0 and 2 * ring * chunk >= length > 2 * ring * (chunk - align)
            shares = [zigzag_share(length, ring, p, align) for p in range(ring)]
            assert shares == [_independent_share(length, ring, p, align) for p in range(ring)]
            # every token in exactly one piece
            tokens = sorted(t for share in shares for a, b in share for t in range(a, b))
            assert tokens == list(range(length))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"ring_size \(0\)"):
        zigzag_chunk(10, 0)
    with pytest.raises(ValueError, match=r"align \(0\)"):
        zigzag_chunk(10, 2, 0)
    with pytest.raises(ValueError, match=r"ring position \(2\) must be in \[0, 2\)"):
        zigzag_share(10, 2, 2)
    with pytest.raises(ValueError, match=r"ring position \(1\) must be 0"):
        zigzag_share(10, 1, 1)


# --------------------------------------------------------------------------- stated splits
def test_splits_by_hand():
    from megatron_bytescale.planner.zigzag import even_zigzag_split, padded_part_size, zigzag_split

    assert zigzag_split(10, 2) == ((0, 3), (3, 6), (6, 9), (9, 10))  # align defaults to 1
    assert zigzag_split(10, 2, 4) == ((0, 4), (4, 8), (8, 10), (10, 10))
    assert zigzag_split(7, 1) == ((0, 7),)
    # as even as possible: 10 = 3 + 3 + 2 + 2
    assert even_zigzag_split(10, 2) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert even_zigzag_split(7, 1) == ((0, 7),)
    # the largest part, rounded up to align (default 1); all-empty parts still take one row
    assert padded_part_size(((0, 3), (3, 5))) == 3
    assert padded_part_size(((0, 3), (3, 5)), 4) == 4
    assert padded_part_size(((0, 0), (0, 0))) == 1
    with pytest.raises(ValueError, match=r"align \(0\) must be >= 1"):
        padded_part_size(((0, 3),), 0)


def test_split_recovered_from_shares_by_hand():
    from megatron_bytescale.planner.zigzag import zigzag_split_from_shares

    # N = 2, length 8: position 0 holds parts 0 and 3, position 1 parts 1 and 2
    assert zigzag_split_from_shares(8, [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]) == ((0, 2), (2, 4), (4, 6), (6, 8))
    # uneven parts are fine as long as they tile in zigzag order
    assert zigzag_split_from_shares(8, [[(0, 3), (7, 8)], [(3, 5), (5, 7)]]) == ((0, 3), (3, 5), (5, 7), (7, 8))
    assert zigzag_split_from_shares(5, [[(0, 5)]]) == ((0, 5),)


@pytest.mark.parametrize("length, shares, message", [
    (8, [], r"^a zigzag split needs at least one ring position$"),
    (8, [[(0, 7)]], r"a ring of size 1 holds the whole sequence \[0, 8\), got \[\(0, 7\)\]"),
    (8, [[(0, 1), (1, 2), (7, 8)], [(2, 7)]],
     r"^ring position 0 holds 3 pieces; at most 2 \(parts 0 and 3\)$"),
    (12, [[(0, 2)], [(2, 4)], [(4, 6), (6, 7), (7, 12)]],
     r"^ring position 2 holds 3 pieces; at most 2 \(parts 2 and 3\)$"),
    (8, [[(0, 2), (6, 8)], [(3, 3), (4, 6)]], r"^ring position 1: piece \[3, 3\) is empty or outside \[0, 8\)$"),
    (8, [[(0, 2), (6, 9)], [(2, 4), (4, 6)]], r"^ring position 0: piece \[6, 9\) is empty or outside \[0, 8\)$"),
    # tokens 6-7 in no piece: the parts stop short of the end
    (8, [[(0, 2)], [(2, 4), (4, 6)]],
     r"^pieces \[\[\(0, 2\)\], \[\(2, 4\), \(4, 6\)\]\] are not a contiguous zigzag split of \[0, 8\) "
     r"over 2 ring positions \(position p holds parts p and 4-1-p, in that order, and the 4 parts "
     r"tile the sequence in order\)$"),
    # the parts tile [0, 8) but position 1 holds one more piece (an overlap)
    (8, [[(0, 8)], [(3, 5)]], r"are not a contiguous zigzag split of \[0, 8\) over 2 ring positions"),
])
def test_split_from_shares_refuses(length, shares, message):
    from megatron_bytescale.planner.zigzag import zigzag_split_from_shares

    with pytest.raises(ValueError, match=message):
        zigzag_split_from_shares(length, shares)
