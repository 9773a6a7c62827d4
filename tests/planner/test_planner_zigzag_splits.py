"""Any contiguous zigzag split a plan states is valid; anything else is refused by name.

The planner cuts parts of ceil(L / 2N) tokens with the padding at the end, but a plan written by
another tool may split as evenly as possible (or any other contiguous way). ``StepPlan.validate``
and the runtime derive the 2N parts from the pieces, and the padding from the largest part.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.planner import (
    MicroBatch,
    Piece,
    PlanBuilder,
    PlanError,
    RankPlan,
    Sequence,
    StepPlan,
    even_zigzag_split,
    padded_part_size,
    zigzag_chunk,
    zigzag_split,
    zigzag_split_from_shares,
)


def _shares(split, n):
    return [[split[k] for k in ((p,) if n == 1 else (p, 2 * n - 1 - p)) if split[k][1] > split[k][0]]
            for p in range(n)]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(length=st.integers(1, 200), n=st.integers(1, 8), cuts=st.lists(st.integers(0, 200), max_size=15))
def test_any_contiguous_split_round_trips(length, n, cuts):
    """Random contiguous splits (empty parts anywhere) are recovered from the shares; the
    reading may only move a lone piece between a position's two parts when the parts between
    them are empty, so the token order is the same."""
    parts = 1 if n == 1 else 2 * n
    bounds = sorted([0, length, *[min(c, length) for c in cuts[: parts - 1]]])
    while len(bounds) < parts + 1:
        bounds.append(length)
    split = tuple(zip(bounds[:-1], bounds[1:]))
    got = zigzag_split_from_shares(length, _shares(split, n))
    assert [b - a for a, b in got if b > a] == [b - a for a, b in split if b > a]
    assert _shares(got, n) == _shares(split, n)


def test_planner_and_even_splits_agree_with_padding():
    for length, n, align in itertools.product((1, 5, 10, 23, 64, 97), (1, 2, 3, 4), (1, 4)):
        ours = zigzag_split(length, n, align)
        assert zigzag_split_from_shares(length, _shares(ours, n)) == ours
        if n > 1:
            assert padded_part_size(ours, align) == zigzag_chunk(length, n, align)
            even = even_zigzag_split(length, n)
            assert max(b - a for a, b in even) - min(b - a for a, b in even) <= 1
            assert zigzag_split_from_shares(length, _shares(even, n)) == even
            assert padded_part_size(even, 1) == -(-length // (2 * n))


def _plan(pieces_by_rank, length=10, ring=(0, 1)):
    return StepPlan(
        hdp_size=len(ring), capacity=100, scheduler="hand", sequences=(Sequence(id=0, length=length),),
        ranks=tuple(
            RankPlan(rank=r, micro_batches=(MicroBatch(
                order=0, ring=ring, seqs=(0,),
                pieces=tuple(Piece(seq=0, start=a, end=b) for a, b in pieces_by_rank[r])),))
            for r in range(len(ring))
        ),
    )  # fmt: skip


def test_validate_accepts_an_even_split_and_states_its_parts():
    # L = 10 on 2 ranks: the planner cuts 3,3,3,1; an even split is 3,3,2,2
    plan = _plan({0: [(0, 3), (8, 10)], 1: [(3, 6), (6, 8)]}).validate()
    assert plan.zigzag_splits()[0] == ((0, 3), (3, 6), (6, 8), (8, 10))
    builder = PlanBuilder(hdp_size=2, capacity=100, lengths={0: 10})
    builder.add([0, 1], [0], splits={0: even_zigzag_split(10, 2)})
    built = builder.build(scheduler="hand").validate()
    assert built.ranks == plan.ranks and built.zigzag_splits() == plan.zigzag_splits()


@pytest.mark.parametrize(
    "pieces, match",
    [
        ({0: [(3, 6)], 1: [(0, 3), (6, 10)]}, "not a contiguous zigzag split"),  # middle part on 0
        ({0: [(8, 10), (0, 3)], 1: [(3, 6), (6, 8)]}, "not a contiguous zigzag split"),  # local order
        ({0: [(0, 3), (8, 10)], 1: [(3, 6), (7, 8)]}, "tokens 6-6 are missing"),  # a gap
        ({0: [(0, 3), (5, 10)], 1: [(3, 6), (6, 8)]}, "tokens 5-5 overlap"),  # overlap
        ({0: [(0, 2), (2, 3), (8, 10)], 1: [(3, 6), (6, 8)]}, "holds 3 pieces"),
        ({0: [(0, 3), (8, 8), (8, 10)], 1: [(3, 6), (6, 8)]}, "is empty"),
    ],
)
def test_validate_refuses_what_is_not_a_contiguous_zigzag_split(pieces, match):
    with pytest.raises(PlanError, match=match):
        _plan(pieces).validate()


def test_empty_parts_anywhere_are_valid():
    # part 2 of 4 is empty: position 1 holds one piece, position 0 its two
    plan = _plan({0: [(0, 3), (6, 10)], 1: [(3, 6)]}).validate()
    assert plan.zigzag_splits()[0] == ((0, 3), (3, 6), (6, 6), (6, 10))


def test_local_ring_holds_the_whole_sequence():
    with pytest.raises(PlanError, match=r"ring of size 1 holds the whole sequence \[0, 10\)"):
        _plan({0: [(0, 5), (5, 10)]}, ring=(0,)).validate()
