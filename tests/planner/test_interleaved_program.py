"""The interleaved training program (``planner/interleaved_program.py``) on every stage of random
HDP lists, run with blocking channels and ring rendezvous: it finishes, and every message
reaches the op that expects it.

The executor is independent of the program's construction: every rank (pipeline r, stage s)
walks its items, an exchange (sends and receives posted together) completes only when each of
its messages is matched with the peer's post (rendezvous: no buffering, the strictest model of
gloo / NCCL point-to-point), messages between two ranks match first-in first-out (with PP 2 the
next and the previous rank are one rank: forwards and backwards share that channel), and an op
of a ring micro-batch runs only when every member pipeline's same stage is at that op.
"""

from __future__ import annotations

import random

import pytest

from megatron_bytescale.planner.interleaved_program import stage_program
from megatron_bytescale.planner.pipeline_floor import template_stage_ops


def random_lists(rng: random.Random, pipelines: int, most: int) -> tuple[list[int], dict[int, list[int]]]:
    """Per-pipeline lengths (zero included) and, per (pipeline, local index), the ring members
    holding that micro-batch at that index (rings at the same local index, as plans have them)."""
    lengths = [rng.randint(0, most) for _ in range(pipelines)]
    if rng.random() < 0.3:
        lengths[rng.randrange(pipelines)] = 0
    members: dict[tuple[int, int], list[int]] = {}
    for i in range(max(lengths, default=0)):
        holders = [r for r in range(pipelines) if i < lengths[r]]
        rng.shuffle(holders)
        while holders:
            take = sorted(holders[: rng.randint(1, len(holders))])
            holders = holders[len(take):]
            for r in take:
                members[(r, i)] = take
    return lengths, members


def run(lengths: list[int], members, pp: int, vpp: int, *, blocking_sends: bool = False) -> tuple[bool, int]:
    """Execute every stage's program; (finished, messages delivered). Raises on a message
    delivered to the wrong op. ``blocking_sends``: a send also waits for its receiver, and is
    posted together with the next op's receive (one exchange, as the 1F1B driver pairs them)."""
    programs = {s: stage_program(lengths, pp, vpp, s) for s in range(pp)}
    items: dict[tuple[int, int], list] = {}
    for r in range(len(lengths)):
        for s in range(pp):
            seq: list = []
            pending: list = []  # a blocking send waits to be posted with the next receive
            for op in programs[s][r]:
                label = (op.phase, op.index, op.chunk)
                posts = list(pending)
                pending = []
                if op.receive is not None:
                    src = (s - 1) % pp if op.receive == "prev" else (s + 1) % pp
                    posts.append(("recv", (r, src, s), label))
                if posts:
                    seq.append(("x", posts))
                seq.append(("op", label))
                if op.send is not None:
                    dst, to = op.target(pp, vpp, s)
                    post = ("send", (r, s, dst), to)
                    if blocking_sends:
                        pending.append(post)
                    else:
                        seq.append(("x", [post]))
            if pending:
                seq.append(("x", pending))
            items[(r, s)] = seq
    ptr = {key: 0 for key in items}
    posted: dict[tuple[int, int], list] = {}  # rank -> its current exchange: (kind, channel, number, label)
    books: dict[str, dict] = {"send": {}, "recv": {}}  # kind -> channel -> labels in post order
    delivered: set = set()

    def post(rank) -> list:
        nonlocal progress
        if rank not in posted:
            progress = True  # a new post may be what a peer waits for
            entries = []
            for kind, channel, label in items[rank][ptr[rank]][1]:
                book = books[kind].setdefault(channel, [])
                book.append(label)
                entries.append((kind, channel, len(book) - 1, label))
            posted[rank] = entries
        return posted[rank]

    progress = True
    while progress:  # until a whole pass neither posts nor completes anything
        progress = False
        for rank in items:
            if ptr[rank] >= len(items[rank]):
                continue
            item = items[rank][ptr[rank]]
            if item[0] == "x":
                ok = True
                for kind, channel, n, label in post(rank):
                    other = books["recv" if kind == "send" else "send"].get(channel, [])
                    if len(other) <= n:
                        ok = ok and kind == "send" and not blocking_sends  # a plain send never waits
                        continue
                    sent, received = (label, other[n]) if kind == "send" else (other[n], label)
                    if sent != received:
                        raise AssertionError(f"{channel} message {n}: sent to {sent}, received as {received}")
                    delivered.add((channel, n))
                if ok:
                    del posted[rank]
                    ptr[rank] += 1
                    progress = True
            else:
                r, s = rank
                peers = [(q, s) for q in members[(r, item[1][1])]]
                if all(ptr[p] < len(items[p]) and items[p][ptr[p]] == item for p in peers):
                    for p in peers:
                        ptr[p] += 1
                    progress = True
    finished = all(ptr[k] == len(items[k]) for k in items)
    return finished, len(delivered)


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_random_hdp_lists_with_rings_never_deadlock(pp, vpp):
    rng = random.Random(pp * 100 + vpp)
    for _ in range(60):
        lengths, members = random_lists(rng, rng.randint(1, 4), 9)
        finished, delivered = run(lengths, members, pp, vpp)
        assert finished, (lengths, members)
        # every micro-batch crosses p v - 1 virtual-stage boundaries each way
        assert delivered == 2 * sum(lengths) * (pp * vpp - 1)


def test_sends_that_wait_for_their_receiver_deadlock_one_pipeline_of_four():
    """Why the driver never waits for a send: pairing each send with the next op's receive in
    one blocking exchange (the 1F1B driver's pairing) deadlocks PP 2 x VPP 2 at 4 micro-batches."""
    local = {(0, i): [0] for i in range(8)}
    assert run([3], local, 2, 2, blocking_sends=True)[0]
    assert not run([4], local, 2, 2, blocking_sends=True)[0]
    assert run([4], local, 2, 2)[0]


def test_the_program_runs_every_op_of_the_template_once():
    lengths = [5, 0, 3, 8]
    for s in range(4):
        for prog, ops in zip(stage_program(lengths, 4, 2, s), template_stage_ops(lengths, 4, 2, s)):
            assert [(op.phase, op.index, op.chunk) for op in prog] == ops
        assert sorted((op.phase, op.index, op.chunk) for op in stage_program(lengths, 4, 2, s)[0]) == sorted(
            (ph, i, c) for ph in "FB" for i in range(5) for c in range(2))


def test_megatrons_own_table_per_pipeline_would_deadlock_the_executor():
    """The executor can fail: two pipelines sharing rings 0 and 1 whose stages follow Megatron's
    table for their own lengths (not the template) order the rings differently."""
    from megatron_bytescale.planner import interleaved_program as module
    from megatron_bytescale.planner.pipeline_floor import pipeline_stage_ops

    def own_tables(lengths, pp, vpp, stage):
        return [pipeline_stage_ops(list(range(m)), pp, vpp, stage) for m in lengths]

    members = {(0, 0): [0, 1], (1, 0): [0, 1], (0, 1): [0, 1], (1, 1): [0, 1]}
    members.update({(1, i): [1] for i in range(2, 8)})
    assert run([2, 8], members, 4, 2)[0]
    saved = module.template_stage_ops
    module.template_stage_ops = own_tables
    try:
        assert not run([2, 8], members, 4, 2)[0]
    finally:
        module.template_stage_ops = saved


def test_a_message_to_the_wrong_op_is_caught():
    """Shifting where the last stage's forwards wrap to makes a receive see the wrong op."""
    from megatron_bytescale.planner import interleaved_program as module

    saved = module.StageOp.target

    def wrong(self, pp, vpp, stage):
        out = saved(self, pp, vpp, stage)
        if out is not None and self.phase == "F" and stage == pp - 1:
            return out[0], ("F", self.index, self.chunk)  # forgot the chunk + 1
        return out

    module.StageOp.target = wrong
    try:
        with pytest.raises(AssertionError, match="received as"):
            run([4, 4], {(r, i): [r] for r in range(2) for i in range(4)}, 2, 2)
    finally:
        module.StageOp.target = saved


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="pp >= 2"):
        stage_program([1], 1, 2, 0)
    with pytest.raises(ValueError, match="outside"):
        stage_program([1], 2, 2, 2)
