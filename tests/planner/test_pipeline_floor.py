"""Interleaved (virtual) pipeline stages and sequence chunks in the estimate
(``planner/pipeline_floor.py``): the formula, an independent executor, rings, the plan field."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from megatron_bytescale.planner.estimate import estimate_plan, micro_batch_costs, simulate_plan, with_virtual_pipeline
from megatron_bytescale.planner.order import simulate
from megatron_bytescale.planner.pipeline_floor import (
    chunk_seconds,
    interleaved_makespan,
    interleaved_table,
    simulate_schedule,
    time_plan,
)
from megatron_bytescale.planner.plan import PlanError, StepPlan
from megatron_bytescale.planner.schedulers import make_plan

from planner_cases import small_cost_model


# --------------------------------------------------------------------------- an independent executor
def megatron_ops(m: int, pp: int, vpp: int, stage: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved loop, written from its structure: warm-up forwards of virtual
    ids 0..w-1, then per steady iteration forward id k + w and backward id k, then the
    cool-down backwards; ``vpp`` 1 is plain 1F1B. ``m`` is a multiple of ``pp`` here."""
    total = m * vpp
    if vpp == 1:
        warm = min(pp - stage - 1, total)
    else:
        warm = min(2 * (pp - stage - 1) + (vpp - 1) * pp, total)

    def fwd(k: int) -> tuple[int, int]:
        group, within = divmod(k, pp * vpp)
        return group * pp + within % pp, within // pp

    def bwd(k: int) -> tuple[int, int]:
        i, c = fwd(k)
        return i, vpp - 1 - c

    ops = [("F", *fwd(k)) for k in range(warm)]
    for k in range(total - warm):
        ops += [("F", *fwd(k + warm)), ("B", *bwd(k))]
    ops += [("B", *bwd(k)) for k in range(total - warm, total)]
    return ops


def execute(lists, seconds, pp, vpp, ff=1 / 3):
    """Run every stage's op list with pointers: an op starts when it is next on every member
    pipeline's stage, its stage is free and its predecessor op of the same unit is done."""
    top = -(-max(len(x) for x in lists) // pp) * pp
    ops = [[[(ph, ul[i], c) for ph, i, c in megatron_ops(top, pp, vpp, s) if i < len(ul)] for s in range(pp)]
           for ul in lists]
    ptr = [[0] * pp for _ in lists]
    free = [[0.0] * pp for _ in lists]
    done: dict = {}
    members: dict = {}
    for r, ul in enumerate(lists):
        for u in ul:
            members.setdefault(u, []).append(r)

    def pred(ph, u, c, s):
        if ph == "F":
            return ("F", u, c, s - 1) if s > 0 else (("F", u, c - 1, pp - 1) if c > 0 else None)
        if s < pp - 1:
            return ("B", u, c, s + 1)
        return ("B", u, c + 1, 0) if c < vpp - 1 else ("F", u, vpp - 1, pp - 1)

    progress = True
    while progress:
        progress = False
        for r in range(len(lists)):
            for s in range(pp):
                if ptr[r][s] >= len(ops[r][s]):
                    continue
                ph, u, c = ops[r][s][ptr[r][s]]
                p = pred(ph, u, c, s)
                if p is not None and p not in done:
                    continue
                if any(ptr[q][s] >= len(ops[q][s]) or ops[q][s][ptr[q][s]] != (ph, u, c) for q in members[u]):
                    continue
                start = max([free[q][s] for q in members[u]] + ([done[p]] if p is not None else []))
                end = start + seconds[u] / vpp * (ff if ph == "F" else 1 - ff)
                done[(ph, u, c, s)] = end
                for q in members[u]:
                    free[q][s] = end
                    ptr[q][s] += 1
                progress = True
    if any(ptr[r][s] < len(ops[r][s]) for r in range(len(lists)) for s in range(pp)):
        return None
    return np.array([max(free[r]) for r in range(len(lists))])


# --------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("vpp", [1, 2, 4])
def test_equal_micro_batches_follow_the_interleaved_formula(pp, vpp):
    for m in (pp, 2 * pp, 3 * pp):
        got = simulate_schedule([list(range(m))], {i: 1.5 for i in range(m)}, pp=pp, vpp=vpp).rank_finish_s[0]
        assert got == pytest.approx(interleaved_makespan(m, 1.5, pp=pp, vpp=vpp), rel=1e-12)
        assert got == pytest.approx(m * 1.5 + (pp - 1) * 1.5 / vpp, rel=1e-12)  # the bubble shrinks by v


def test_unequal_micro_batches_match_an_independent_executor():
    rng = random.Random(7)
    for _ in range(60):
        pp, vpp = rng.choice([2, 3, 4]), rng.choice([1, 2, 4])
        m = pp * rng.randint(1, 3)
        t = {i: rng.uniform(0.1, 3.0) for i in range(m)}
        got = simulate_schedule([list(range(m))], t, pp=pp, vpp=vpp).rank_finish_s[0]
        assert got == pytest.approx(execute([list(range(m))], t, pp, vpp)[0], rel=1e-12)
        # the fill and drain still cross p - 1 chunk ops of 1 / v of a stage
        assert got >= sum(t.values()) + (pp - 1) * min(t.values()) / vpp - 1e-9


def test_rings_over_pipelines_of_different_lengths_match_the_executor():
    rng = random.Random(3)
    for _ in range(40):
        pp, vpp = rng.choice([2, 4]), rng.choice([1, 2, 4])
        n = rng.randint(2, 4)
        lengths = [rng.randint(0, 7) for _ in range(n)]
        lists = [[] for _ in range(n)]
        nxt = 0
        for i in range(max(lengths)):  # ring units sit at the same local index on their members
            holders = [r for r in range(n) if i < lengths[r]]
            while holders:
                take = holders[: rng.randint(1, len(holders))]
                holders = holders[len(take):]
                for r in take:
                    lists[r].append(nxt)
                nxt += 1
        t = {u: rng.uniform(0.1, 2.0) for u in range(nxt)}
        got = simulate_schedule(lists, t, pp=pp, vpp=vpp)
        want = execute(lists, t, pp, vpp)
        assert got is not None and want is not None
        np.testing.assert_allclose(got.rank_finish_s, want, rtol=1e-12)


def test_megatron_tables_per_pipeline_deadlock_where_the_template_does_not():
    # unit 0 and 1 are rings over both pipelines; the short pipeline's own table runs 1's
    # chunk 1 before 0's backward, the long one the other way round
    lists = [[0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
    t = {u: 1.0 for u in range(8)}
    assert simulate_schedule(lists, t, pp=4, vpp=2, own_tables=True) is None
    assert simulate_schedule(lists, t, pp=4, vpp=2) is not None
    # Megatron forbids a last group of 1 to pp - 1 micro-batches: its table deadlocks alone
    assert simulate_schedule([list(range(5))], {i: 1.0 for i in range(5)}, pp=4, vpp=4, own_tables=True) is None
    assert simulate_schedule([list(range(5))], {i: 1.0 for i in range(5)}, pp=4, vpp=4) is not None


def test_the_table_is_megatrons():
    # the example in megatron-core's schedules.py: PP 2, group N 3, M 5 micro-batches, VP 2
    assert interleaved_table(5, 2, 3) == list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))
    for pp, vpp in ((2, 2), (4, 3), (3, 4)):
        ops = megatron_ops(2 * pp, pp, vpp, 0)
        assert [(i, c) for ph, i, c in ops if ph == "F"] == interleaved_table(2 * pp, vpp, pp)


# --------------------------------------------------------------------------- plans
def pp_plan(scheduler: str = "balance", pp: int = 4, seed: int = 0) -> tuple[StepPlan, object]:
    cm = small_cost_model(num_layers=16)
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(10, 200, 40), rng.integers(600, 1600, 4)]).tolist()
    plan = make_plan(lengths, scheduler=scheduler, hdp_size=8, capacity=256, cost_model=cm, pp_size=pp)
    return plan, cm


@pytest.mark.parametrize("scheduler", ["balance", "naive", "static"])
def test_vpp_1_is_todays_estimate_exactly(scheduler):
    plan, cm = pp_plan(scheduler)
    again = with_virtual_pipeline(plan, 1, cm)
    assert again.estimate == plan.estimate
    costs = micro_batch_costs(plan, cm)
    durations = dict(zip(costs.orders.tolist(), costs.seconds.tolist()))
    ours = time_plan(plan, cm)
    theirs = simulate(plan, durations, forward_fraction=cm.forward_fraction)
    assert ours.rank_finish_s.tolist() == theirs.rank_finish_s.tolist()  # the same floats
    assert ours.step_s == plan.estimate.step_time_s


def test_vpp_shrinks_a_plans_estimate_and_keeps_its_rings():
    plan, cm = pp_plan("balance")
    steps = {}
    for v in (1, 2, 4):
        p = with_virtual_pipeline(plan, v, cm)
        steps[v] = p.estimate.step_time_s
        assert p.ranks == plan.ranks and p.estimate.p2p_bytes == plan.estimate.p2p_bytes
        assert p.estimate.extra["lower_bound_s"] == plan.estimate.extra["lower_bound_s"]
        assert time_plan(plan, cm, vpp=v).step_s == pytest.approx(p.estimate.step_time_s, rel=1e-12)
    assert steps[4] < steps[2] < steps[1]
    assert "interleaved" in with_virtual_pipeline(plan, 2, cm).estimate.extra["model"]


def test_the_plan_carries_vpp_through_json_and_validates_it():
    plan, cm = pp_plan("balance")
    assert "virtual_pipeline_size" not in plan.to_dict()  # old plans keep their hash
    p2 = with_virtual_pipeline(plan, 2, cm)
    back = StepPlan.from_json(p2.to_json())
    assert back.virtual_pipeline_size == 2 and back.validate() is back
    assert back.content_hash() != plan.content_hash()
    with pytest.raises(PlanError, match=r"virtual_pipeline_size 3 does not divide the 4 layers"):
        with_virtual_pipeline(plan, 3, cm)
    with pytest.raises(PlanError, match=r"must be an integer >= 1"):
        replace(plan, virtual_pipeline_size=0).validate()
    flat, _ = pp_plan("balance", pp=1)
    with pytest.raises(PlanError, match=r"needs pipeline parallelism \(pp_size is 1\)"):
        with_virtual_pipeline(flat, 2, cm)
    data = json.loads(p2.to_json())
    data["virtual_pipeline_size"] = 1.5
    with pytest.raises(PlanError, match="virtual_pipeline_size"):
        StepPlan.from_dict(data)


def test_the_simulator_times_the_vpp_plan():
    from megatron_bytescale.sim.step import simulate_step
    from megatron_bytescale.sim.variants import VARIANTS, ClusterSetup, simulate_variants

    plan, cm = pp_plan("balance")
    lengths = [s.length for s in plan.sequences]
    outs = {}
    for v in (1, 2):
        setup = ClusterSetup(hdp_size=8, capacity=256, cost_model=cm, pp_size=4, virtual_pipeline_size=v)
        (o,) = simulate_variants(lengths, [VARIANTS["balance"]], setup)
        outs[v] = o.result.micro_batch_phase_s
    assert outs[1] == pytest.approx(plan.estimate.step_time_s, rel=1e-12)
    assert outs[2] == pytest.approx(with_virtual_pipeline(plan, 2, cm).estimate.step_time_s, rel=1e-12)
    assert simulate_step(with_virtual_pipeline(plan, 4, cm), cm).micro_batch_phase_s < outs[2]


# --------------------------------------------------------------------------- sequence chunks
def test_chunk_costs_add_up_and_grow_with_position():
    cm = small_cost_model(num_layers=16)
    plan, _ = pp_plan("balance")
    costs = micro_batch_costs(plan, cm)
    k = int(np.argmax(costs.seconds * (costs.ring_sizes > 1)))
    args = dict(sum_p=float(costs.sum_p[k]), sum_p2=float(costs.sum_p2[k]), ring_size=int(costs.ring_sizes[k]),
                layers=plan.layers_per_stage, seconds=float(costs.seconds[k]), intra_node=bool(costs.intra_node[k]),
                node_group=float(costs.node_group[k]), num_docs=float(costs.num_docs[k]))
    ideal = chunk_seconds(cm, chunks=4, costing="ideal", **args)
    assert ideal.sum() == pytest.approx(costs.seconds[k], rel=1e-12)
    assert np.all(np.diff(ideal) > 0)
    attn = plan.layers_per_stage * cm.alpha1 * costs.sum_p2[k] / costs.ring_sizes[k]
    np.testing.assert_allclose(np.diff(ideal), 2 * attn / 16, rtol=1e-9)  # (2i + 1) / k**2 of the attention
    for costing in ("cached", "ring"):  # one chunk is the micro-batch itself
        one = chunk_seconds(cm, chunks=1, costing=costing, **args)
        assert one[0] == pytest.approx(costs.seconds[k], rel=1e-12)
    ring, cached = chunk_seconds(cm, chunks=4, costing="ring", **args), chunk_seconds(cm, chunks=4, costing="cached", **args)
    assert ring[0] == pytest.approx(cached[0], rel=1e-12) and np.all(ring[1:] >= cached[1:])
    with pytest.raises(ValueError, match="unknown split costing 'free'"):
        chunk_seconds(cm, chunks=2, costing="free", **args)


def test_one_long_micro_batch_in_chunks_fills_the_pipeline_like_k_micro_batches():
    # linear work only: k equal chunks cross p stages like k micro-batches of t / k
    pp, t, k = 4, 8.0, 4
    units = list(range(k))
    res = simulate_schedule([units], {u: t / k for u in units}, pp=pp, chunk_groups={u: 0 for u in units},
                            record=True)
    assert res.rank_finish_s[0] == pytest.approx((k + pp - 1) * t / k, rel=1e-12)
    one = simulate_schedule([[0]], {0: t}, pp=pp).rank_finish_s[0]
    assert one == pytest.approx(pp * t, rel=1e-12)
    for s in range(pp):  # backward runs the chunks in reverse on every stage
        starts = [res.node_times[(u, "B", 0, s)][0] for u in units]
        assert starts == sorted(starts, reverse=True)


def test_splitting_a_plans_rings_keeps_its_tokens_and_removes_fill():
    plan, cm = pp_plan("balance")
    base = time_plan(plan, cm)
    split = time_plan(plan, cm, split_chunks=4, split_costing="ideal")
    assert split.split_micro_batches == int(np.sum(micro_batch_costs(plan, cm).ring_sizes > 1)) > 0
    assert split.lower_bound_s == pytest.approx(base.lower_bound_s, rel=1e-9)  # ideal: same work
    longest = time_plan(plan, cm, split_chunks=4, split_min_seconds=float(micro_batch_costs(plan, cm).seconds.max()))
    assert longest.split_micro_batches == 1
    with pytest.raises(ValueError, match="vpp 1 only"):
        time_plan(plan, cm, vpp=2, split_chunks=2)
    _, sim = simulate_plan(plan, cm)
    assert base.step_s == float(sim.rank_finish_s.max())


def test_the_gantt_draws_every_model_chunk():
    from megatron_bytescale.tools.gantt import rank_intervals

    plan, cm = pp_plan("balance")
    p2 = with_virtual_pipeline(plan, 2, cm)
    bars = rank_intervals(p2, cm)
    assert [len(b) for b in bars] == [4 * len(rp.micro_batches) for rp in plan.ranks]
    assert max(end for b in bars for _, end, _ in b) <= p2.estimate.step_time_s + 1e-12


def test_ring_costing_charges_only_the_chunk_s_own_linear_work():
    # with free links both ring costings are compute only: the prefix's tokens must not add linear work
    cm = small_cost_model(num_layers=16, p2p_bandwidth_intra=1e30, p2p_bandwidth_inter=1e30, p2p_latency_s=0.0)
    args = dict(sum_p=4096.0, sum_p2=4096.0**2, ring_size=4, layers=4, seconds=0.0, intra_node=True)
    ring, cached = chunk_seconds(cm, chunks=4, costing="ring", **args), chunk_seconds(cm, chunks=4, costing="cached", **args)
    np.testing.assert_allclose(ring, cached, rtol=1e-12)
    i = np.arange(4)
    want = 4 * (cm.beta1 * 4096 / 4 / 4 + cm.gamma + cm.alpha1 * 4096.0**2 / 4 * (2 * i + 1) / 16)
    np.testing.assert_allclose(cached, want, rtol=1e-12)


def test_cli_plans_with_virtual_stages(capsys):
    from megatron_bytescale.tools.plan_cmd import main

    base = ["--global-tokens", "300000", "--hdp-size", "8", "--model", "llama-70b", "--pp-size", "4",
            "--context-length", "65536", "--quiet", "--scheduler", "balance"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--vpp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "PP 4 x VPP 2" in out and "PP 4 x VPP" not in plain
    assert main(base + ["--vpp-size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("bytescale plan: error: virtual_pipeline_size 3 does not divide the 20 layers of a pipeline "
                   "stage; pick a divisor of it")


def test_simulate_cli_times_virtual_stages(capsys, tmp_path):
    from megatron_bytescale.tools.simulate_cmd import main

    argv = ["--hdp-size", "8", "--global-tokens", "300000", "--context-length", "65536", "--model", "llama-70b",
            "--pp-size", "4", "--variants", "balance", "--quiet"]
    phases = {}
    for v in (1, 4):
        out_json = tmp_path / f"v{v}.json"
        assert main([*argv, "--vpp-size", str(v), "--json", str(out_json)]) == 0
        assert ("x VPP 4" in capsys.readouterr().out.splitlines()[0]) == (v == 4)
        data = json.loads(out_json.read_text())
        assert data["virtual_pipeline_size"] == v
        phases[v] = data["results"][0]["micro_batch_phase_s"]
    assert phases[4] < phases[1]
    assert main([*argv, "--vpp-size", "3"]) == 2
    assert "virtual_pipeline_size 3 does not divide the 20 layers" in capsys.readouterr().err
