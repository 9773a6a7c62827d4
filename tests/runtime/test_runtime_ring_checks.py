"""Bytes, calls, process groups and error handling of the ring runtime, in one 4-process spawn.

Each check is a function run on every rank; the rank returns a dict of facts the test asserts
on in the parent (so a failing check names itself), or raises.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from megatron_bytescale.planner import PlanBuilder
from megatron_bytescale.runtime import (
    CommCounters,
    HDPGroup,
    Ring,
    RingComm,
    layout_for,
    make_attention_layout,
    plan_p2p_bytes,
    ring_attention,
    ring_attention_p2p_bytes,
    verify_ring_layout,
)
from megatron_bytescale.runtime.layout import build_micro_batch
from megatron_bytescale.testing.distributed import run_distributed

from runtime_cases import (
    compare_with_reference,
    global_tensors,
    local_inputs,
    random_plan,
    reference,
    run_plan_on_rank,
)

N_Q, N_KV, HEAD_DIM = 4, 2, 8
WORLD = 4


# ---------------------------------------------------------------------- helpers
class _CallCounter:
    """Counts calls of ``torch.distributed.<name>`` while installed."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0
        self.args: list[tuple] = []
        self._orig = getattr(dist, name)

    def __enter__(self):
        def wrapper(*args, **kwargs):
            self.calls += 1
            self.args.append(args)
            return self._orig(*args, **kwargs)

        setattr(dist, self.name, wrapper)
        return self

    def __exit__(self, *exc):
        setattr(dist, self.name, self._orig)


def _num_process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _run_mb(plan, rank, index, hdp, counters, seed=0, dtype=torch.float32):
    data = global_tensors(seed, plan, N_Q, N_KV, HEAD_DIM)
    layout = layout_for(plan, hdp, index)
    x = local_inputs(layout, data, fill=0.0)
    q, k, v = (x[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    counters.start_micro_batch(plan.ranks[rank].micro_batches[index].order)
    out = ring_attention(q, k, v, layout, hdp, counters=counters)
    out.backward(x["dout"].to(dtype))
    return layout, out, q, k, v


def _expect_error(fn, exc_type, *fragments) -> str:
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        missing = [f for f in fragments if f not in msg]
        if missing:
            raise AssertionError(f"{exc_type.__name__} message {msg!r} lacks {missing}") from exc
        return msg
    raise AssertionError(f"expected {exc_type.__name__} containing {fragments}")


# ---------------------------------------------------------------------- checks (run per rank)
def check_bytes_and_calls(rank: int) -> dict:
    """Per micro-batch counters equal the formula; local rings make no P2P call at all."""
    hdp = HDPGroup()
    plan = random_plan(
        random.Random(3),
        hdp_size=WORLD,
        num_micro_batches=8,
        ring_sizes=(1, 4, 2, 1, 3, 1, 2, 4),
        align=2,
    )
    counters = CommCounters()
    facts = []
    groups = set()
    for index, mb in enumerate(plan.ranks[rank].micro_batches):
        with _CallCounter("batch_isend_irecv") as calls:
            layout, *_ = _run_mb(plan, rank, index, hdp, counters)
        groups.update(id(op.group) for (ops,) in calls.args for op in ops)
        rec = counters.micro_batches[-1]
        expected = ring_attention_p2p_bytes(
            num_tokens=layout.num_tokens,
            ring_size=layout.ring.size,
            num_kv_heads=N_KV,
            head_dim=HEAD_DIM,
            element_size=4,
        )
        facts.append(
            dict(
                size=layout.ring.size,
                sent=rec.bytes_sent,
                received=rec.bytes_received,
                expected=expected,
                p2p_calls=rec.p2p_calls,
                patched_calls=calls.calls,
                attention_calls=rec.attention_calls,
            )
        )
    step = counters.end_step()
    return {
        "facts": facts,
        # every ring operation ran on the ring group, none on the HDP (collectives') group
        "p2p_groups": sorted(
            {id(hdp.ring_group): "ring", id(hdp.group): "hdp"}.get(g, "other") for g in groups
        ),
        "ring_group_ranks": dist.get_process_group_ranks(hdp.ring_group),
        "step_sent": step.total.bytes_sent,
        "plan_bytes": plan_p2p_bytes(plan, num_kv_heads=N_KV, head_dim=HEAD_DIM, element_size=4),
    }


def check_static_cp_bytes(rank: int) -> dict:
    """A static CP ring over all ranks carrying every sequence sends what the formula says."""
    hdp = HDPGroup()
    lengths = {0: 50, 1: 17, 2: 33, 3: 8}
    builder = PlanBuilder(hdp_size=WORLD, capacity=10**6, lengths=lengths, align=1)
    builder.add(list(range(WORLD)), list(lengths))
    plan = builder.build(scheduler="static-cp").validate()
    counters = CommCounters()
    layout, *_ = _run_mb(plan, rank, 0, hdp, counters)
    T = sum(2 * (-(-n // (2 * WORLD))) for n in lengths.values())  # zigzag chunks, align 1
    fwd = (WORLD - 1) * 2 * T * N_KV * HEAD_DIM * 4
    bwd = (WORLD - 1) * 2 * T * N_KV * HEAD_DIM * (4 + 4)
    rec = counters.end_step().total
    return dict(
        T=layout.num_tokens,
        T_expected=T,
        sent=rec.bytes_sent,
        received=rec.bytes_received,
        by_hand=fwd + bwd,
        p2p_calls=rec.p2p_calls,
    )


def check_no_group_creation(rank: int) -> dict:
    """The HDP group creates exactly one group (the ring group); many steps with different
    rings create none."""
    at_start = _num_process_groups()
    with _CallCounter("new_group") as made:
        hdp = HDPGroup()
    before = _num_process_groups()
    with _CallCounter("new_group") as created:
        rng = random.Random(11)
        for step in range(4):
            plan = random_plan(rng, hdp_size=WORLD, num_micro_batches=6, max_len=20)
            counters = CommCounters()
            for index in range(len(plan.ranks[rank].micro_batches)):
                _run_mb(plan, rank, index, hdp, counters, seed=step)
                hdp.ring(plan.ranks[rank].micro_batches[index].ring)
    return dict(at_start=at_start, construction_calls=made.calls, before=before,
                after=_num_process_groups(), new_group_calls=created.calls)


def check_backward_charged_to_forward_micro_batch(rank: int) -> dict:
    """Forward A, start B, backward A: A's backward bytes stay on A."""
    hdp = HDPGroup()
    lengths = {0: 24}
    builder = PlanBuilder(hdp_size=WORLD, capacity=10**6, lengths=lengths)
    builder.add(list(range(WORLD)), [0])
    plan = builder.build(scheduler="t").validate()
    data = global_tensors(0, plan, N_Q, N_KV, HEAD_DIM)
    layout = layout_for(plan, hdp, 0)
    x = local_inputs(layout, data, fill=0.0)
    q, k, v = (x[n].requires_grad_() for n in ("q", "k", "v"))
    counters = CommCounters()
    a = counters.start_micro_batch(0)
    out = ring_attention(q, k, v, layout, hdp, counters=counters)
    after_forward = a.bytes_sent
    b = counters.start_micro_batch(1)
    out.backward(x["dout"])
    return dict(
        a_fwd=after_forward, a_total=a.bytes_sent, b_total=b.bytes_sent, T=layout.num_tokens
    )


def check_bf16_follows_dtype(rank: int) -> dict:
    hdp = HDPGroup()
    plan = random_plan(random.Random(5), hdp_size=WORLD, num_micro_batches=3, ring_sizes=(4, 2, 1))
    counters = CommCounters()
    worst = 0.0
    dtypes = set()
    for index in range(len(plan.ranks[rank].micro_batches)):
        layout, out, q, k, v = _run_mb(
            plan, rank, index, hdp, counters, seed=8, dtype=torch.bfloat16
        )
        dtypes |= {str(out.dtype), str(q.grad.dtype), str(k.grad.dtype), str(v.grad.dtype)}
        data = global_tensors(8, plan, N_Q, N_KV, HEAD_DIM)
        for slot in layout.slots:
            ref = reference(data[slot.seq])["out"]
            rows = layout.global_positions()[slot.offset : slot.offset + slot.num_real]
            mine = out[slot.offset : slot.offset + slot.num_real].double()
            worst = max(worst, ((mine - ref[rows]).abs().max() / ref.abs().max()).item())
    return dict(dtypes=sorted(dtypes), worst=worst)


def check_errors(rank: int) -> dict:
    """Bad input raises a clear error on the rank that can see it; nothing hangs."""
    hdp = HDPGroup()
    msgs = {}
    # HDPGroup.ring validation
    msgs["dup"] = _expect_error(lambda: hdp.ring([rank, rank]), ValueError, "distinct")
    msgs["range"] = _expect_error(lambda: hdp.ring([rank, 9]), ValueError, "[9]", "outside")
    other = (rank + 1) % WORLD
    msgs["member"] = _expect_error(
        lambda: hdp.ring([other]), ValueError, f"HDP rank {rank}", "not a member"
    )
    msgs["ring_dup"] = _expect_error(lambda: Ring((1, 1), 0), ValueError, "distinct")
    msgs["ring_pos"] = _expect_error(lambda: Ring((1, 2), 2), ValueError, "position 2")
    # layout / tensor mismatches, all local (no communication happens before the error)
    ring = hdp.ring([rank])
    layout = make_attention_layout(ring, [(0, 10), (1, 6)])
    q = torch.randn(16, 4, 8)
    kv = torch.randn(16, 2, 8)
    msgs["tokens"] = _expect_error(
        lambda: ring_attention(q[:15], kv[:15], kv[:15], layout, hdp), ValueError, "15 tokens", "16"
    )
    msgs["heads"] = _expect_error(
        lambda: ring_attention(torch.randn(16, 3, 8), kv, kv, layout, hdp),
        ValueError,
        "multiple",
        "3",
        "2",
    )
    msgs["shape"] = _expect_error(
        lambda: ring_attention(q, kv, kv[:, :1], layout, hdp), ValueError, "same shape"
    )
    msgs["dims"] = _expect_error(
        lambda: ring_attention(q[0], kv, kv, layout, hdp), ValueError, "THD"
    )
    foreign = make_attention_layout(Ring((other,), 0), [(0, 16)])
    msgs["foreign_ring"] = _expect_error(
        lambda: ring_attention(q, kv, kv, foreign, hdp),
        ValueError,
        f"HDP rank {other}",
        f"HDP rank {rank}",
    )
    outside = make_attention_layout(Ring((rank, 7), 0), [(0, 8)])
    msgs["outside"] = _expect_error(
        lambda: ring_attention(
            torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8), outside, hdp
        ),
        ValueError,
        "[7]",
        "outside",
    )
    msgs["backend"] = _expect_error(
        lambda: ring_attention(q, kv, kv, layout, hdp, backend="nope"), ValueError, "nope", "torch"
    )
    # plan / HDP group mismatch
    builder = PlanBuilder(hdp_size=WORLD + 1, capacity=100, lengths={0: 5})
    builder.add([0], [0])
    msgs["plan_size"] = _expect_error(
        lambda: build_micro_batch(builder.build(scheduler="t"), hdp, 0, {0: [1, 2, 3, 4, 5]}),
        ValueError,
        f"{WORLD + 1}",
        f"{WORLD}",
    )
    # RingComm misuse
    comm = RingComm(
        hdp, hdp.ring([rank, other]) if rank % 2 == 0 else hdp.ring([(rank - 1) % WORLD, rank])
    )
    msgs["wait_first"] = _expect_error(comm.wait, RuntimeError, "before commit")
    msgs["empty_commit"] = _expect_error(comm.commit, RuntimeError, "nothing queued")
    msgs["local_comm"] = _expect_error(lambda: RingComm(hdp, ring), ValueError, "size 1")
    # ring members that disagree on the micro-batch: pairs (0,1) and (2,3); the odd member of
    # each pair builds a different layout. verify_ring_layout makes BOTH raise.
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    pair_ring = hdp.ring(pair)
    mine = make_attention_layout(pair_ring, [(0, 12 if rank % 2 == 0 else 14)])
    msgs["disagree"] = _expect_error(
        lambda: verify_ring_layout(mine, hdp), ValueError, "different", "content_hash"
    )
    agree = make_attention_layout(pair_ring, [(0, 12)])
    verify_ring_layout(agree, hdp)  # agreeing members pass
    # after all that, a real ring still works (nothing is left half-sent)
    dist.barrier()
    x = torch.randn(agree.num_tokens, 4, 8)
    y = torch.randn(agree.num_tokens, 2, 8)
    out = ring_attention(x, y, y, agree, hdp, verify_peers=True)
    msgs["after_ok"] = str(tuple(out.shape))
    return msgs


def check_comm_double_commit(rank: int) -> dict:
    hdp = HDPGroup()
    ring = hdp.ring(list(range(WORLD)))
    comm = RingComm(hdp, ring)
    buf = comm.send_recv(torch.full((3,), float(rank)))
    comm.commit()
    msg = _expect_error(comm.commit, RuntimeError, "twice")
    msg2 = _expect_error(lambda: comm.send_recv(torch.zeros(3)), RuntimeError, "in flight")
    comm.wait()
    return dict(msg=msg, msg2=msg2, got=buf.tolist(), expected=float(ring.prev_rank))


def check_subgroup(rank: int) -> dict:
    """An HDP group that is a subgroup (as Megatron's DP group is): HDP ranks map to other
    global ranks, and a non-member cannot build it."""
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])  # collective: every rank, same order
    mine, other = (low, high) if rank < 2 else (high, low)
    msg = _expect_error(lambda: HDPGroup(other), ValueError, f"global rank {rank}", "not a member")
    hdp = HDPGroup(mine)
    builder = PlanBuilder(hdp_size=2, capacity=10**6, lengths={0: 29, 1: 6, 2: 11, 3: 17}, align=2)
    builder.add([1, 0], [0, 1])
    builder.add([0], [2])
    builder.add([1], [3])
    plan = builder.build(scheduler="t").validate()
    rows = run_plan_on_rank(hdp.rank, plan, 13, N_Q, N_KV, HEAD_DIM, hdp=hdp)
    mapping = [hdp.global_rank(r) for r in range(hdp.size)]
    ring_ranks = dist.get_process_group_ranks(hdp.ring_group)
    return dict(msg=msg, rows=rows, plan=plan, mapping=mapping, hdp_rank=hdp.rank,
                ring_ranks=ring_ranks, separate=hdp.ring_group is not mine)


CHECKS = [
    check_bytes_and_calls,
    check_static_cp_bytes,
    check_no_group_creation,
    check_backward_charged_to_forward_micro_batch,
    check_bf16_follows_dtype,
    check_errors,
    check_comm_double_commit,
    check_subgroup,
]


def _all_checks(rank: int, world: int) -> dict:
    return {check.__name__: check(rank) for check in CHECKS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(WORLD, _all_checks, timeout_s=240)


# ---------------------------------------------------------------------- assertions
def test_p2p_bytes_match_formula_and_local_rings_are_silent(results):
    sizes = set()
    for r in results:
        out = r["check_bytes_and_calls"]
        for f in out["facts"]:
            sizes.add(f["size"])
            assert f["sent"] == f["received"] == f["expected"], f
            assert f["attention_calls"] == 1
            if f["size"] == 1:
                assert f["sent"] == 0 and f["p2p_calls"] == 0 and f["patched_calls"] == 0, f
            else:
                # forward N-1 k/v shifts, backward N-1 k/v shifts + N-1 dK/dV shifts
                assert f["p2p_calls"] == f["patched_calls"] == 3 * (f["size"] - 1), f
    assert sizes == {1, 2, 3, 4}
    total_sent = sum(r["check_bytes_and_calls"]["step_sent"] for r in results)
    assert total_sent == results[0]["check_bytes_and_calls"]["plan_bytes"] > 0


def test_static_cp_ring_bytes(results):
    for r in results:
        out = r["check_static_cp_bytes"]
        assert out["T"] == out["T_expected"]
        assert out["sent"] == out["received"] == out["by_hand"] > 0, out
        assert out["p2p_calls"] == 3 * (WORLD - 1)


def test_no_process_group_created(results):
    for r in results:
        out = r["check_no_group_creation"]
        assert out["construction_calls"] == 1 and out["before"] == out["at_start"] + 1, out
        assert out["new_group_calls"] == 0
        assert out["after"] == out["before"], out


def test_ring_traffic_runs_on_the_ring_group_only(results):
    for r in results:
        out = r["check_bytes_and_calls"]
        assert out["p2p_groups"] == ["ring"], out["p2p_groups"]
        assert out["ring_group_ranks"] == list(range(WORLD))


def test_backward_bytes_charged_to_forward_micro_batch(results):
    for r in results:
        out = r["check_backward_charged_to_forward_micro_batch"]
        assert out["b_total"] == 0
        assert out["a_fwd"] == (WORLD - 1) * 2 * out["T"] * N_KV * HEAD_DIM * 4
        assert out["a_total"] == out["a_fwd"] + (WORLD - 1) * 2 * out["T"] * N_KV * HEAD_DIM * 8


def test_bf16_output_and_grads_follow_input_dtype(results):
    for r in results:
        out = r["check_bf16_follows_dtype"]
        assert out["dtypes"] == ["torch.bfloat16"]
        # bf16 keeps 8 significant bits (u = 2^-8): inputs and result are rounded once each, the
        # kernel's probabilities once more; 2u is 1.8x the worst measured (4.3e-3, ranks 0-3)
        assert out["worst"] < 2 * 2.0**-8, out


def test_bad_input_raises_clear_errors(results):
    for rank, r in enumerate(results):
        msgs = r["check_errors"]
        assert msgs["after_ok"].startswith("(")
        assert "disagree" in msgs and "content_hash" in msgs["disagree"]


def test_ring_comm_misuse(results):
    for r in results:
        out = r["check_comm_double_commit"]
        assert out["got"] == [out["expected"]] * 3


def test_subgroup_hdp_group_maps_ranks(results):
    for rank, r in enumerate(results):
        out = r["check_subgroup"]
        assert out["mapping"] == out["ring_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["separate"] and out["hdp_rank"] == rank % 2
    for pair in ((0, 1), (2, 3)):
        outs = [results[g]["check_subgroup"] for g in pair]
        errors = compare_with_reference(
            outs[0]["plan"], [o["rows"] for o in outs], 13, N_Q, N_KV, HEAD_DIM
        )
        assert max(errors.values()) <= 1e-5, errors
