"""Plan units of a ring micro-batch split along the pipeline into causal chunks: the chunk
field, its JSON and hash, validation of good and bad plans."""

from __future__ import annotations

import copy

import pytest

from megatron_bytescale.planner.plan import PlanBuilder, PlanError, StepPlan
from megatron_bytescale.planner.zigzag import causal_chunks, zigzag_split

LENGTHS = {0: 50, 1: 30, 2: 9, 3: 20, 4: 2, 5: 13}


def _plan(pp_size: int = 2) -> StepPlan:
    b = PlanBuilder(hdp_size=4, capacity=64, lengths=LENGTHS, align=2)
    b.add((0, 1), (0, 1), num_chunks=2)  # orders 0, 1 on ranks 0 and 1 (local 0, 1)
    b.add((2,), (5, 4), num_chunks=3)  # orders 2-4, a local ring; sequence 4 (2 tokens) skips chunk 0
    b.add((3,), (2,))  # order 5
    b.add((1, 0), (3,))  # order 6: local 2 on both
    return b.build(scheduler="x", pp_size=pp_size, layers_per_stage=4)


def test_old_plans_keep_their_hash():
    b = PlanBuilder(hdp_size=4, capacity=64, lengths={0: 50, 1: 30, 2: 9, 3: 20}, align=2)
    b.add((0, 1), (0, 1))
    b.add((2,), (2,))
    b.add((3,), (3,))
    plan = b.build(scheduler="x", pp_size=2, layers_per_stage=4)
    assert "chunk" not in plan.to_json()
    # computed by the code before the chunk field existed
    assert plan.content_hash() == "d8cafa940eb62fd9d5fbdc2a414cc724297a31c53ec7cb218a96e30af6a6903a"


def test_chunked_plan_validates_round_trips_and_covers_every_token_once():
    plan = _plan().validate()
    back = StepPlan.from_json(plan.to_json()).validate()
    assert back == plan and back.content_hash() == plan.content_hash()
    r0 = plan.ranks[0].micro_batches
    assert [(mb.order, mb.chunk) for mb in r0] == [(0, (0, 2)), (1, (1, 2)), (6, None)]
    r2 = plan.ranks[2].micro_batches
    assert [mb.chunk for mb in r2] == [(0, 3), (1, 3), (2, 3)]
    assert [mb.seqs for mb in r2] == [(5,), (5, 4), (5, 4)]  # 2 tokens: chunks (0,0), (0,1), (1,2)
    # chunk i of sequence 0 is [25 i, 25 (i + 1)), zigzagged over the ring of 2 on its own
    for i in range(2):
        a, b = causal_chunks(50, 2)[i]
        parts = [(x + a, y + a) for x, y in zigzag_split(b - a, 2, 2)]
        got = [(p.start, p.end) for p in r0[i].pieces if p.seq == 0]
        assert got == [parts[0], parts[3]]
        assert plan.chunk_zigzag_splits()[(0, i)] == zigzag_split(b - a, 2, 2)
    assert 0 not in plan.zigzag_splits() and 3 in plan.zigzag_splits()
    tokens = {}
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            for p in mb.pieces:
                tokens[p.seq] = tokens.get(p.seq, 0) + p.num_tokens
    assert tokens == LENGTHS
    unsplit = PlanBuilder(hdp_size=4, capacity=64, lengths=LENGTHS, align=2)
    assert plan.content_hash() != _plan(pp_size=1).content_hash()
    del unsplit


def _broken(edit) -> str:
    data = copy.deepcopy(_plan().to_dict())
    edit(data)
    with pytest.raises(PlanError) as info:
        StepPlan.from_dict(data).validate()
    return str(info.value)


def _mb(data, rank, local):
    return data["ranks"][rank]["micro_batches"][local]


def test_bad_chunk_plans_are_refused():
    def count_one(d):
        for r in (0, 1):
            _mb(d, r, 0)["chunk"] = [0, 1]
    assert "count >= 2" in _broken(count_one)

    def differs(d):
        _mb(d, 1, 1)["chunk"] = [1, 3]
    assert "differs from another member" in _broken(differs)

    def offloads(d):
        for r in (0, 1):
            _mb(d, r, 1)["offload_ratio"] = 0.5
    assert "do not offload" in _broken(offloads)

    def gap(d):  # chunk 1 of 2 at order 6, order 1 an unsplit micro-batch
        for r in (0, 1):
            _mb(d, r, 1)["chunk"], _mb(d, r, 2)["chunk"] = None, [1, 2]
            _mb(d, r, 1)["pieces"], _mb(d, r, 2)["pieces"] = _mb(d, r, 2)["pieces"], _mb(d, r, 1)["pieces"]
            _mb(d, r, 1)["seqs"], _mb(d, r, 2)["seqs"] = _mb(d, r, 2)["seqs"], _mb(d, r, 1)["seqs"]
    msg = _broken(gap)  # caught by the sequence's group first
    assert "consecutive orders" in msg or "chunks of one split micro-batch" in msg

    def missing_last(d):  # the group's last chunk dropped on both members
        for r in (0, 1):
            del d["ranks"][r]["micro_batches"][1]
    msg = _broken(missing_last)
    assert "consecutive orders" in msg

    def other_ring(d):  # chunk 1 of the local group moved to ring (3,)
        mb = d["ranks"][2]["micro_batches"].pop(1)
        mb["ring"] = [3]
        d["ranks"][3]["micro_batches"].insert(0, mb)
    assert "all chunks share one ring" in _broken(other_ring)

    def wrong_seqs(d):  # sequence 4 claimed by chunk 0, which has none of its tokens
        _mb(d, 2, 0)["seqs"] = [5, 4]
    assert "expected [5]" in _broken(wrong_seqs)

    def swapped(d):  # chunk 0 carries chunk 1's tokens and the other way round
        for r in (0, 1):
            _mb(d, r, 0)["pieces"], _mb(d, r, 1)["pieces"] = _mb(d, r, 1)["pieces"], _mb(d, r, 0)["pieces"]
    assert "chunk 0" in _broken(swapped)

    def twice(d):
        _mb(d, 0, 1)["pieces"].append(dict(_mb(d, 0, 0)["pieces"][0]))
    assert "overlap" in _broken(twice) or "follow the order" in _broken(twice)

    def lost(d):
        _mb(d, 1, 1)["pieces"].pop()
    assert "missing" in _broken(lost) or "in no piece" in _broken(lost)

    def malformed(d):
        _mb(d, 0, 0)["chunk"] = [0]
    assert "[index, count]" in _broken(malformed)


def test_builder_refuses_bad_chunk_requests():
    b = PlanBuilder(hdp_size=2, capacity=64, lengths=LENGTHS)
    with pytest.raises(ValueError, match="num_chunks"):
        b.add((0, 1), (0,), num_chunks=0)
    with pytest.raises(ValueError, match="splits cannot"):
        b.add((0, 1), (0,), num_chunks=2, splits={0: zigzag_split(50, 2)})


def test_split_micro_batch_turns_a_plans_ring_into_chunks():
    from megatron_bytescale.planner.chunk_split import split_micro_batch

    b = PlanBuilder(hdp_size=4, capacity=64, lengths=LENGTHS, align=2)
    b.add((0, 1), (0, 1))  # order 0
    b.add((2,), (5, 4))  # 1
    b.add((3,), (2,))  # 2
    b.add((1, 0), (3,))  # 3
    plan = b.build(scheduler="x", pp_size=2, layers_per_stage=4).validate()
    split = split_micro_batch(plan, 0, 3)
    assert [(mb.order, mb.chunk) for mb in split.ranks[0].micro_batches] == [
        (0, (0, 3)), (1, (1, 3)), (2, (2, 3)), (5, None)]
    assert [mb.order for mb in split.ranks[2].micro_batches] == [3]
    assert split.content_hash() != plan.content_hash() and split.estimate is None
    # the ring's tokens stay on its members (each chunk zigzagged on its own: shares may move
    # by a few tokens between them); every token once is validate()'s
    held = [sum(mb.num_tokens for mb in rp.micro_batches) for p in (split, plan) for rp in p.ranks]
    assert held[0] + held[1] == held[4] + held[5] and held[2:4] == held[6:8]
    twice = split_micro_batch(split, 3, 2)  # the local ring of rank 2, 13 and 2 tokens
    assert [mb.chunk for mb in twice.ranks[2].micro_batches] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="already chunk"):
        split_micro_batch(split, 1, 2)
    with pytest.raises(ValueError, match="no micro-batch of order 9"):
        split_micro_batch(plan, 9, 2)
    with pytest.raises(ValueError, match="at most 9"):
        split_micro_batch(plan, 2, 10)
    with pytest.raises(ValueError, match="pp_size >= 2"):
        split_micro_batch(b.build(scheduler="x", pp_size=1, layers_per_stage=4), 0, 2)


def test_split_micro_batch_on_timing_only_plans_keeps_rings_aligned():
    from megatron_bytescale.planner.chunk_split import split_micro_batch
    from megatron_bytescale.planner.schedulers._common import FastPlanBuilder

    b = FastPlanBuilder(pieces=False, hdp_size=3, capacity=64, lengths={0: 100, 1: 9, 2: 80})
    b.add((0, 1), (0,))  # order 0: local 0 on ranks 0 and 1
    b.add((2,), (1,))  # 1: local 0 on rank 2
    b.add((0, 1, 2), (2,))  # 2: local 1 on every rank
    plan = b.build(scheduler="x", pp_size=2, layers_per_stage=4)
    with pytest.raises(ValueError, match="local indices"):  # ranks 0 and 1 grow, rank 2 not
        split_micro_batch(plan, 0, 2)
    split = split_micro_batch(plan, 2, 4)  # the last ring: nothing after it moves
    assert [mb.chunk for mb in split.ranks[2].micro_batches] == [None, (0, 4), (1, 4), (2, 4), (3, 4)]
    assert all(not mb.pieces for rp in split.ranks for mb in rp.micro_batches)
