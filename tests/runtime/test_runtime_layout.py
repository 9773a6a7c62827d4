"""Materialisation of plans into per-rank token buffers, without processes (int ranks)."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_bytescale.planner import MicroBatch, Piece, PlanBuilder, RankPlan, Sequence, StepPlan
from megatron_bytescale.runtime import (
    PAD_TOKEN_ID,
    Ring,
    build_micro_batch,
    iter_micro_batches,
    layout_for,
    make_attention_layout,
)

from runtime_cases import random_plan, scheduler_plan


def _token(seq: int, pos: int) -> int:
    """A unique, non-zero token id per (sequence, position)."""
    return seq * 100_000 + pos + 1


def _tokens_by_seq(plan: StepPlan, as_numpy: bool = False) -> dict:
    out = {}
    for s in plan.sequences:
        ids = [_token(s.id, p) for p in range(s.length)]
        out[s.id] = np.asarray(ids, dtype=np.int64) if as_numpy else torch.tensor(ids)
    return out


def _plans() -> list[StepPlan]:
    rng = random.Random(2024)
    plans = [
        random_plan(rng, hdp_size=n, num_micro_batches=10, max_seqs=4, max_len=50, align=align)
        for n, align in ((4, 1), (5, 3), (6, 8), (3, 2))
    ]
    sched = scheduler_plan(
        4, [300, 40, 35, 30, 120, 20, 64, 9, 100, 3, 210, 17], 100, "balance", align=4
    )
    if sched is not None:
        plans.append(sched)
    return plans


@pytest.mark.parametrize(
    "plan", _plans(), ids=lambda p: f"hdp{p.hdp_size}-align{p.align}-{p.scheduler}"
)
def test_every_token_once_with_labels_and_positions(plan: StepPlan):
    lengths = plan.sequence_lengths()
    tokens = _tokens_by_seq(plan, as_numpy=plan.hdp_size % 2 == 1)  # numpy and torch inputs
    seen: dict[tuple[int, int], int] = {}
    loss_tokens = 0
    num_tokens_by_order: dict[int, set[int]] = {}
    for rank in range(plan.hdp_size):
        for index, mb in enumerate(iter_micro_batches(plan, rank, tokens)):
            assert mb.order == plan.ranks[rank].micro_batches[index].order
            T = mb.layout.num_tokens
            assert (
                mb.tokens.shape
                == mb.labels.shape
                == mb.loss_mask.shape
                == mb.position_ids.shape
                == (T,)
            )
            assert mb.tokens.dtype == mb.labels.dtype == mb.position_ids.dtype == torch.long
            assert mb.loss_mask.dtype == torch.float32
            assert mb.num_loss_tokens == int(mb.loss_mask.sum().item())
            num_tokens_by_order.setdefault(mb.order, set()).add(T)
            loss_tokens += mb.num_loss_tokens
            real = mb.layout.real_mask()
            assert bool((mb.tokens[~real] == PAD_TOKEN_ID).all())
            assert bool((mb.loss_mask[~real] == 0).all()) and bool(
                (mb.position_ids[~real] == 0).all()
            )
            assert bool((mb.labels[~real] == PAD_TOKEN_ID).all())
            for row in torch.nonzero(real).flatten().tolist():
                tok = int(mb.tokens[row])
                seq, pos = divmod(tok - 1, 100_000)
                assert (seq, pos) not in seen, f"token {pos} of sequence {seq} appears twice"
                seen[(seq, pos)] = rank
                assert int(mb.position_ids[row]) == pos
                if pos + 1 < lengths[seq]:
                    assert int(mb.labels[row]) == _token(seq, pos + 1) and mb.loss_mask[row] == 1
                else:
                    assert int(mb.labels[row]) == PAD_TOKEN_ID and mb.loss_mask[row] == 0
    assert len(seen) == plan.total_tokens
    assert loss_tokens == sum(n - 1 for n in lengths.values())
    # every member of a ring has the same buffer length (pre-sized receive buffers)
    assert all(len(ts) == 1 for ts in num_tokens_by_order.values())


def test_slots_follow_zigzag_layout():
    lengths = {0: 23, 1: 5, 2: 64}
    builder = PlanBuilder(hdp_size=5, capacity=10**6, lengths=lengths, align=4)
    builder.add([4, 1, 3], [0, 1, 2])
    plan = builder.build(scheduler="t").validate()
    # by hand, 6 parts each, align 4: 23 -> ceil(23/6) = 4 -> 4; 5 -> 1 -> 4; 64 -> 11 -> 12
    chunks = {0: 4, 1: 4, 2: 12}
    # real tokens per ring position (parts i and 5-i, padding at the end of the sequence):
    # 23 = [0,4)..[16,20) [20,23): positions hold 4+3, 4+4, 4+4; 5 = [0,4) [4,5): 4+0, 1+0, 0;
    # 64 = [0,12)..[48,60) [60,64): 12+4, 12+12, 12+12
    real = {0: (7, 8, 8), 1: (4, 1, 0), 2: (16, 24, 24)}
    for position, rank in enumerate((4, 1, 3)):
        layout = layout_for(plan, rank, 0)
        assert layout.ring == Ring((4, 1, 3), position)
        offset = 0
        for slot, seq in zip(layout.slots, (0, 1, 2)):
            chunk = chunks[seq]
            assert slot.num_real == real[seq][position] and slot.real_by_position == real[seq]
            assert (slot.seq, slot.length, slot.chunk, slot.offset) == (
                seq,
                lengths[seq],
                chunk,
                offset,
            )
            assert slot.num_local == 2 * chunk
            n = lengths[seq]  # real tokens of parts i and 2N-1-i, padding excluded
            assert slot.parts == (
                (min(position * chunk, n), min((position + 1) * chunk, n)),
                (min((5 - position) * chunk, n), min((6 - position) * chunk, n)),
            )
            offset += 2 * chunk
        assert layout.num_tokens == offset == 40  # 2 * (4 + 4 + 12) rows on every member
        assert layout.cu_seqlens.tolist() == [
            0,
            *np.cumsum([s.num_local for s in layout.slots]).tolist(),
        ]
        assert layout.cu_seqlens.dtype == torch.int32


def test_local_ring_is_unpadded_whole_sequences():
    layout = make_attention_layout(Ring((2,), 0), [(7, 5), (3, 9)])
    assert layout.num_tokens == 14 and layout.ring.is_local
    assert [(s.seq, s.offset, s.num_local, s.parts) for s in layout.slots] == [
        (7, 0, 5, ((0, 5),)),
        (3, 5, 9, ((0, 9),)),
    ]


def test_errors_are_clear():
    lengths = {0: 10, 1: 4}
    builder = PlanBuilder(hdp_size=3, capacity=100, lengths=lengths)
    builder.add([2, 0], [0])
    builder.add([1], [1])
    plan = builder.build(scheduler="t").validate()
    tokens = {0: torch.arange(1, 11), 1: torch.arange(1, 5)}
    with pytest.raises(ValueError, match="got 9 tokens but the plan says length 10"):
        build_micro_batch(plan, 0, 0, {0: torch.arange(9), 1: tokens[1]})
    with pytest.raises(ValueError, match=r"rank 3 is outside the plan's HDP ranks \[0, 3\)"):
        build_micro_batch(plan, 3, 0, tokens)
    with pytest.raises(IndexError, match="rank 0 has 1 micro-batches in this plan; index 1"):
        build_micro_batch(plan, 0, 1, tokens)
    with pytest.raises(ValueError, match="no tokens for sequence 0"):
        build_micro_batch(plan, 2, 0, {1: tokens[1]})
    with pytest.raises(ValueError, match="must be 1-D"):
        build_micro_batch(plan, 2, 0, {0: torch.arange(10).view(2, 5)})
    with pytest.raises(ValueError, match="integers"):
        build_micro_batch(plan, 2, 0, {0: torch.rand(10)})
    # a plan whose pieces are not the zigzag share (never validated)
    bad = StepPlan(
        hdp_size=1,
        capacity=100,
        scheduler="bad",
        sequences=(Sequence(id=0, length=10),),
        ranks=(
            RankPlan(
                rank=0,
                micro_batches=(
                    MicroBatch(
                        order=0, ring=(0,), seqs=(0,), pieces=(Piece(seq=0, start=0, end=9),)
                    ),
                ),
            ),
        ),
    )
    with pytest.raises(ValueError, match=r"ring of size 1 holds the whole sequence \[0, 10\)"):
        build_micro_batch(bad, 0, 0, {0: torch.arange(10)})
    with pytest.raises(ValueError, match="appears twice"):
        make_attention_layout(Ring((0,), 0), [(1, 3), (1, 3)])
    with pytest.raises(ValueError, match="position 3"):
        Ring((0, 1, 2), 3)


def test_device_argument_moves_tensors():
    builder = PlanBuilder(hdp_size=1, capacity=100, lengths={0: 6})
    builder.add([0], [0])
    mb = build_micro_batch(builder.build(scheduler="t"), 0, 0, {0: list(range(1, 7))}, device="cpu")
    assert mb.tokens.tolist() == [1, 2, 3, 4, 5, 6] and mb.labels.tolist() == [2, 3, 4, 5, 6, 0]
    assert mb.tokens.device.type == "cpu" and mb.offload_ratio == 0.0
    # another device (meta: no data, but a real move), every tensor of the micro-batch
    plan = builder.build(scheduler="t")
    moved = build_micro_batch(plan, 0, 0, {0: list(range(1, 7))}, device="meta")
    tensors = (moved.tokens, moved.labels, moved.loss_mask, moved.position_ids)
    assert all(t.device.type == "meta" for t in tensors) and moved.num_loss_tokens == 5


def test_runtime_never_imports_megatron():
    code = (
        "import sys, megatron_bytescale.runtime as r; "
        "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_p2p_bytes_of_a_plan_by_hand():
    from megatron_bytescale.runtime import plan_p2p_bytes, ring_local_tokens

    lengths = {0: 23, 1: 5, 2: 64, 3: 50}
    builder = PlanBuilder(hdp_size=5, capacity=10**6, lengths=lengths, align=4)
    builder.add([4, 1, 3], [0, 1, 2])  # 40 rows per member (test_slots_follow_zigzag_layout)
    builder.add([2], [3])  # local: no traffic
    plan = builder.build(scheduler="t").validate()
    assert ring_local_tokens([23, 5, 64], 3, 4) == 40
    assert ring_local_tokens([23, 5, 64], 1, 4) == 92  # a local pack is not padded
    assert ring_local_tokens([50], 2, 3) == 2 * 15  # two parts of 50 / 4 = 12.5 -> 13 -> 15 (align 3)
    # per member per layer, Nkv = 2, H = 8: K+V are 2 * 40 * 2 * 8 = 1280 elements; forward sends
    # them 2 hops (bf16, 2 B), backward again plus the fp32 dK/dV accumulators (2 + 4 B)
    per_member = 2 * 1280 * 2 + 2 * 1280 * (2 + 4)
    assert per_member == 20480
    got = plan_p2p_bytes(plan, num_kv_heads=2, head_dim=8, element_size=2, num_layers=3)
    assert got == 3 * 3 * per_member  # 3 members, 3 layers
    assert plan_p2p_bytes(plan, num_kv_heads=2, head_dim=8, element_size=2, backward=False) == 3 * 2 * 1280 * 2
