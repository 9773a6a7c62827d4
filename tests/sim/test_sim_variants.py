"""Variants side by side, timing-only plans, sweeps and their summaries."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.plan import PlanError
from megatron_bytescale.planner.presets import model_spec, preset_cost_model
from megatron_bytescale.planner.schedulers import SCHEDULERS, make_plan
from megatron_bytescale.sim.variants import plan_for
from megatron_bytescale.sim import (
    ABLATION,
    VARIANTS,
    ClusterSetup,
    StepOverheads,
    drop_per_doubling,
    format_tokens,
    parse_tokens,
    parse_variants,
    preset_overheads,
    run_sweep,
    simulate_step,
    simulate_variants,
    summarize,
)


@pytest.fixture(scope="module")
def byted_batch() -> np.ndarray:
    return synthetic_lengths("byted", 2_000_000, seed=3, max_length=262144)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_timing_only_plan_times_like_the_full_plan(byted_batch, scheduler):
    """pieces=False keeps rings, sequences and orders: the same estimate, and a simulated step
    equal to the full plan's; the validator refuses it (it cannot be trained)."""
    cm = preset_cost_model("llama-7b")
    kwargs = dict(scheduler=scheduler, hdp_size=64, capacity=8192, cost_model=cm, context_length=262144)
    full = make_plan(byted_batch, **kwargs)
    light = make_plan(byted_batch, pieces=False, **kwargs)
    assert light.estimate.rank_time_s == full.estimate.rank_time_s
    assert light.estimate.p2p_bytes == full.estimate.p2p_bytes
    assert light.meta["pieces"] is False and "pieces" not in full.meta
    a, b = simulate_step(full, cm), simulate_step(light, cm)
    assert a.step_time_s == b.step_time_s and np.array_equal(a.rank_busy_s, b.rank_busy_s)
    with pytest.raises(PlanError):
        light.validate()


def test_variants_share_plans_and_lookahead_hides_planning(byted_batch):
    cm = preset_cost_model("llama-7b")
    setup = ClusterSetup(hdp_size=64, capacity=8192, cost_model=cm,
                         overheads=StepOverheads(plan_s=2.0, load_s=1.0))
    out = {o.variant.name: o for o in simulate_variants(byted_batch, list(VARIANTS.values()), setup,
                                                         context_length=262144)}
    assert list(out) == list(VARIANTS)
    assert all(o.result is not None for o in out.values()), {k: o.error for k, o in out.items()}
    bal, ahead = out["balance"].result, out["balance+lookahead"].result
    assert bal.micro_batch_phase_s == ahead.micro_batch_phase_s  # one plan for both
    assert bal.data_wait_s == 3.0 and ahead.data_wait_s == 0.0
    assert bal.step_time_s - ahead.step_time_s == pytest.approx(3.0)
    assert out["naive"].result.offloaded_micro_batches == 0
    assert out["static"].result.meta["cp_size"] == 32
    # the balance scheduler is never slower than the fill of the same units
    assert bal.micro_batch_phase_s <= out["naive+offload"].result.micro_batch_phase_s


def test_inapplicable_variant_is_reported_not_raised():
    cm = preset_cost_model("llama-70b")  # PP 4 in the preset; pow2 refuses PP
    lengths = synthetic_lengths("github", 1_000_000, seed=0, max_length=131072)
    setup = ClusterSetup(hdp_size=16, capacity=8192, cost_model=cm, pp_size=4, tensor_parallel_size=8)
    out = simulate_variants(lengths, parse_variants("pow2,balance"), setup, context_length=131072)
    assert out[0].result is None and "does not support pipeline parallelism" in out[0].error
    assert out[1].result is not None and out[1].result.pp_size == 4 and out[1].result.num_gpus == 16 * 4 * 8


def test_parse_variants_names_the_choices():
    assert [v.name for v in parse_variants("static, balance+lookahead,static")] == ["static", "balance+lookahead"]
    with pytest.raises(ValueError, match=r"unknown scheduler variant 'magic'; choose from static, pow2, naive"):
        parse_variants("static,magic")
    with pytest.raises(ValueError, match="no scheduler variant given"):
        parse_variants(" , ")
    assert ABLATION[0] == "static" and ABLATION[-1] == "balance+lookahead"


def test_sweep_summaries_and_drop_per_doubling():
    cm = preset_cost_model("llama-7b")
    setup = ClusterSetup(hdp_size=64, capacity=8192, cost_model=cm,
                         overheads=preset_overheads(model_spec("llama-7b"), tensor_parallel_size=1, pp_size=1,
                                                    plan_s=0.0))
    messages: list[str] = []
    points = run_sweep(lambda c, s: synthetic_lengths("github", 1_000_000, seed=s, max_length=c),
                       contexts=[65536, 131072], steps=2, variants=parse_variants("static,balance"),
                       setup=setup, progress=messages.append)
    assert len(points) == 4 and len(messages) == 8
    assert messages[-1].startswith("[8/8] context 128K, step 1, balance: step ")
    summaries = summarize(points)
    assert [(s.context_length, s.variant.name, s.steps) for s in summaries] == [
        (65536, "static", 2), (65536, "balance", 2), (131072, "static", 2), (131072, "balance", 2)]
    for s in summaries:
        results = s.results
        assert s.tokens_per_s == pytest.approx(sum(r.tokens for r in results) / sum(r.step_time_s for r in results))
        assert s.tokens_per_s_per_gpu == pytest.approx(s.tokens_per_s / 64)
        assert sum(s.fractions[t] for t in ("compute", "exposed_comm", "step_overhead", "exposed_offload", "idle")) \
            == pytest.approx(1.0)
        assert s.grad_reduce_s > 0 and s.optimizer_s > 0
    tput = {(s.context_length, s.variant.name): s.tokens_per_s for s in summaries}
    assert drop_per_doubling(summaries, "static") == pytest.approx(tput[65536, "static"] / tput[131072, "static"])
    assert math.isnan(drop_per_doubling(summaries, "naive"))


def test_token_counts_parse_and_format():
    assert parse_tokens("256K") == 262144 and parse_tokens("2M") == 2097152 and parse_tokens("1000") == 1000
    assert parse_tokens("1.5M") == 1572864 and parse_tokens("1g") == 2**30
    for bad in ("abc", "0", "1.5", "-2K"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    assert format_tokens(262144) == "256K" and format_tokens(2097152) == "2M" and format_tokens(1000) == "1,000"


def test_simulated_step_does_not_depend_on_this_machines_clock(byted_batch, monkeypatch):
    """Planning here is slow or fast with the machine's load; no simulated time may move with it.
    The planner wall time is reported apart, and a modelled plan_s is the only planning cost."""
    import megatron_bytescale.sim.variants as variants_mod

    cm = preset_cost_model("llama-7b")
    setup = ClusterSetup(hdp_size=64, capacity=8192, cost_model=cm)
    names = ["static", "naive", "balance", "balance+lookahead"]

    def run(tick: float) -> dict:
        clock = iter(float(i) * tick for i in range(10_000))
        monkeypatch.setattr(variants_mod.time, "perf_counter", lambda: next(clock))
        out = simulate_variants(byted_batch, parse_variants(names), setup, context_length=262144)
        return {o.variant.name: o.result for o in out}

    fast, slow = run(1e-6), run(1e3)
    for name in names:
        assert slow[name].planner_wall_s == pytest.approx(1e3) and fast[name].planner_wall_s == pytest.approx(1e-6)
        assert slow[name].step_time_s == fast[name].step_time_s, name
        assert slow[name].data_wait_s == 0.0 and slow[name].plan_s == 0.0
    # a modelled planning cost is waited for without lookahead and hidden with it
    modelled = dataclasses.replace(setup, overheads=StepOverheads(plan_s=0.25))
    out = {o.variant.name: o.result for o in simulate_variants(
        byted_batch, parse_variants(["balance", "balance+lookahead"]), modelled, context_length=262144)}
    assert out["balance"].step_time_s == pytest.approx(fast["balance"].step_time_s + 0.25)
    assert out["balance+lookahead"].step_time_s == fast["balance+lookahead"].step_time_s


def test_cluster_setup_ep_size_binds_the_plans():
    """ClusterSetup.ep_size reaches make_plan: balance and static plans carry the slot rule; a
    pow2 plan that breaks it becomes an error outcome naming the scheduler, not a priced step."""
    cm = preset_cost_model("mistral-8x7b", "h100", expert_parallel_size=2)
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match=r"ep_size .* must be an integer >= 1 that divides hdp_size \(8\)"):
            ClusterSetup(hdp_size=8, capacity=8192, cost_model=cm, ep_size=bad)
    setup = ClusterSetup(hdp_size=8, capacity=8192, cost_model=cm, ep_size=2)
    lengths = synthetic_lengths("github", 400_000, seed=0, max_length=65536)
    for name in ("static", "balance"):
        plan, _ = plan_for(lengths, VARIANTS[name], setup)
        assert plan.ep_size == 2
    pow2 = simulate_variants(lengths, [VARIANTS["pow2"]], setup)[0]
    assert pow2.result is None and "scheduler 'pow2' cannot plan for expert parallelism (ep_size 2)" in pow2.error
    assert simulate_variants(lengths, [VARIANTS["pow2"]], dataclasses.replace(setup, ep_size=1))[0].result


def test_seq_split_is_refused_with_expert_parallelism():
    """The sequence split and the EP slot rule do not combine (one line naming both)."""
    import pytest

    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.sim.variants import ClusterSetup

    cm = CostModel(num_layers=4, alpha1=1e-9, beta1=1e-6, gamma=1e-4, alpha2=1e3, d2h_bandwidth=1e10,
                   h2d_bandwidth=1e10, kv_bytes_per_token=64.0, p2p_bandwidth_intra=1e9,
                   p2p_bandwidth_inter=1e9)
    with pytest.raises(ValueError, match="expert groups of 2 HDP ranks"):
        ClusterSetup(hdp_size=4, capacity=1024, cost_model=cm, pp_size=2, seq_split=True, ep_size=2)
    assert ClusterSetup(hdp_size=4, capacity=1024, cost_model=cm, pp_size=2, seq_split=True).seq_split
