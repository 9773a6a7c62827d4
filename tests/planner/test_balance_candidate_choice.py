"""Balance's choice among its candidates: skipping by a floor never changes the winner.

`balance` plans several candidates (per unit set of selective offload: DP-Balance's LPT and fill;
with PP the level steps, PP-Balance's runs, the aligned fill, each also short-first) and keeps
the fastest by the estimate, ties to the earlier one. To save estimates it skips a unit set or
a candidate whose lower bound (`_units_floor`, `order_free_floor`, `alone_floors`) is already
slower than the best so far, and stops timing a candidate once its step is known to exceed the best. That skip is
only an optimisation: here every plan is compared with the plan made with both floors at zero
and every candidate timed to its end (nothing skipped), on seeded batches where the floors are in force (no node
map, flat rings, the network slower than a node's links) and where they are not. A floor
compared the wrong way, a skip that ends the loop early, ties that go to the later candidate or
a floor that is not a lower bound all change some of these plans.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import megatron_bytescale.planner.schedulers.balance as balance_mod
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.planner.topology import Topology
from planner_cases import nothing_skipped, small_cost_model

# (dataset, seed, tokens, HDP ranks, PP, offload, node map, two-level rings)
CASES = [(ds, seed, tokens, hdp, pp, offload, nodes, two_level)
         for ds in ("github", "byted") for seed in (0, 1)
         for tokens, hdp, pp in ((60_000, 8, 1), (120_000, 16, 1), (60_000, 8, 2), (120_000, 8, 4))
         for offload in (False, True)
         for nodes, two_level in ((None, False), ("irregular", False), (None, True))]
LONGEST = 16_384
CAPACITY = 2_048


def _cost_model(two_level: bool):
    return small_cost_model(two_level_ring=two_level)


def _plan(case):
    ds, seed, tokens, hdp, pp, offload, nodes, two_level = case
    lengths = synthetic_lengths(ds, tokens, seed=seed, max_length=LONGEST)
    topology = None
    if nodes == "irregular":  # nodes of 3 and 5 ranks
        topology = Topology.from_node_map([r // 4 if r % 8 < 3 else r // 4 + 100 for r in range(hdp)])
    return make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=CAPACITY, cost_model=_cost_model(two_level),
                     pp_size=pp, offload=offload, topology=topology, context_length=LONGEST)


def _key(plan):
    return plan.content_hash(), plan.meta.get("assignment"), plan.meta.get("offload_choice"), plan.estimate.step_time_s


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_skipping_by_the_floors_never_changes_the_plan(case, monkeypatch):
    planned = _key(_plan(case))
    nothing_skipped(monkeypatch)
    assert planned == _key(_plan(case))


def test_the_unit_set_floor_by_hand():
    """Three single-rank units of 1 s on 2 pipelines: at PP 1 the floor is their work over the
    pipelines, 1.5 s (the assignment floor, 2 s by pigeonhole, is for PP only: at PP 1 the
    skip keeps the bound it had); at PP 2 some pipeline holds two of them, which 1F1B makes
    (PP + 1) x 1 = 3 s, above both the work and PP x the longest (2 s). With a different
    unwidened set the floor is the smaller of the two sets' (each holds for its own
    candidates), and where a node map, two-level rings or a network faster than a node's links
    could make placed times shorter, it is 0."""
    from types import SimpleNamespace

    from planner_cases import LINEAR_CM
    from megatron_bytescale.planner.sharding import Unit

    def one(seq, seconds, ring=1):
        return Unit(seqs=(seq,), lengths=(1,), ring_size=ring, min_ring_size=ring, time=seconds)

    def request(pp, cm=LINEAR_CM, topology=None):
        return SimpleNamespace(cost_model=cm, topology=topology, hdp_size=2, pp_size=pp)

    units = [one(0, 1.0), one(1, 1.0), one(2, 1.0)]
    assert balance_mod._units_floor(units, units, request(1)) == 1.5
    assert balance_mod._units_floor(units, units, request(2)) == pytest.approx(3.0)
    widened, base = [one(0, 1.0, ring=2)], [one(0, 0.5)]
    assert balance_mod._units_floor(widened, base, request(1)) == 0.5
    assert balance_mod._units_floor(base, widened, request(1)) == 0.5
    assert balance_mod._units_floor(units, units, request(2, LINEAR_CM.with_(two_level_ring=True))) == 0.0
    assert balance_mod._units_floor(units, units, request(2, topology=Topology(ranks_per_node=1))) == 0.0


def test_the_cases_exercise_the_skip_and_more_than_one_winner(monkeypatch):
    """Without this the test above could pass with floors that never skip anything."""
    skipped = 0
    names = set()
    calls = {"n": 0}

    def counting(real):
        def count(*args, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)
        return count

    # candidates are estimated from their plan (PP 1) or timed without one (PP > 1)
    monkeypatch.setattr(balance_mod, "estimate_plan", counting(balance_mod.estimate_plan))
    monkeypatch.setattr(balance_mod, "candidate_finish_times", counting(balance_mod.candidate_finish_times))
    for case in CASES:
        if case[6] is not None or case[7]:
            continue  # floors in force only without a node map and with flat rings
        calls["n"] = 0
        plan = _plan(case)
        with_floors = calls["n"]
        with monkeypatch.context() as floors_off:
            nothing_skipped(floors_off)
            calls["n"] = 0
            _plan(case)
            without = calls["n"]
        skipped += without > with_floors
        names.add((plan.meta.get("assignment"), plan.meta.get("offload_choice")))
    assert skipped >= 4, skipped
    assert len(names) >= 3, names


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_a_tie_goes_to_the_first_candidate(pp):
    """Eight equal documents on eight ranks: every candidate places one per rank, so all tie
    and the first one listed must win (the level steps, PP 1 included through the count groups
    of expert groups: DP-Balance's LPT)."""
    plan = make_plan([1_000] * 8, scheduler="balance", hdp_size=8, capacity=CAPACITY,
                     cost_model=_cost_model(False), pp_size=pp, offload=False, context_length=LONGEST,
                     ep_size=2 if pp == 1 else 1)
    assert plan.meta["assignment"] in ("pp-steps", "pp-steps+short-first"), plan.meta["assignment"]
    lpt = make_plan([1_000] * 8, scheduler="balance", hdp_size=8, capacity=CAPACITY,
                    cost_model=_cost_model(False), pp_size=1, offload=False, context_length=LONGEST)
    assert lpt.meta["assignment"] == "lpt"


def _straddling_rings(plan, ranks_per_node: int = 4) -> int:
    rings = {mb.ring for rank in plan.ranks for mb in rank.micro_batches if len(mb.ring) > 1}
    return sum(len({r // ranks_per_node for r in ring}) > 1 for ring in rings if len(ring) <= ranks_per_node)


@pytest.mark.parametrize("pp", [1, 2])
def test_the_fill_candidate_is_alg1_on_the_unwidened_units_and_the_nodes(pp, monkeypatch):
    """The fill (Alg. 1, balance's safety net) rarely wins, so it is made to win here: its
    makespan (DP) or its estimate (PP) is reported as zero. It must then be what balance returns,
    named ``fill``, with no widened units, every token planned once, and its rings of 3 on
    4-rank nodes inside one node each (first fit without the nodes puts the second on 3-5)."""
    lengths = [5_000] * 6 + [700] * 40
    real = balance_mod.estimate_plan

    def fill_wins(plan, *args, **kwargs):
        estimate = real(plan, *args, **kwargs)
        if plan.meta.get("assignment") == "fill":
            estimate = replace(estimate, step_time_s=0.0)
        return estimate

    monkeypatch.setattr(balance_mod, "estimate_plan", fill_wins)
    monkeypatch.setattr(balance_mod, "times_without_plan", lambda request: False)  # every candidate estimated
    monkeypatch.setattr(balance_mod, "makespan_below",
                        lambda steps, *args, **kwargs: ([p for s in steps for p in s], 0.0))
    monkeypatch.setattr(balance_mod, "alone_floors", lambda candidates, *args, **kwargs: [0.0] * len(candidates))
    monkeypatch.setattr(balance_mod, "_units_floor", lambda *args: 0.0)
    plan = make_plan(lengths, scheduler="balance", hdp_size=8, capacity=CAPACITY, cost_model=_cost_model(False),
                     pp_size=pp, offload=False, context_length=LONGEST, estimate=False)
    assert plan.meta["assignment"] == "fill" and plan.meta["widened_units"] == 0
    plan.validate()
    trained = sorted(s for rank in plan.ranks for mb in rank.micro_batches for s in mb.seqs
                     if mb.ring[0] == rank.rank)
    assert trained == list(range(len(lengths)))  # every sequence once, on its ring's first rank
    rings = {mb.ring for rank in plan.ranks for mb in rank.micro_batches if len(mb.ring) > 1}
    assert len(rings) >= 2 and {len(r) for r in rings} == {3}
    assert _straddling_rings(plan) == 0


@pytest.mark.parametrize("pp, dataset, seed", [(1, "byted", 1), (1, "github", 0), (2, "byted", 4), (2, "github", 0)])
def test_expert_group_plans_are_evened_once_and_named_balance(pp, dataset, seed):
    """With expert groups, PP 1 evens every candidate and PP > 1 the winner; evening the
    result again changes nothing, and the plan is still the balance scheduler's, whether the
    slots stayed as placed or were re-sorted (a re-emitted plan)."""
    from megatron_bytescale.planner.schedulers import DEFAULT_DELTA, DEFAULT_NUM_BUCKETS, build_request, ep_slots

    lengths = synthetic_lengths(dataset, 60_000, seed=seed, max_length=LONGEST)
    kw = dict(hdp_size=8, capacity=CAPACITY, cost_model=_cost_model(False), pp_size=pp, offload=False,
              context_length=LONGEST, ep_size=2)
    plan = make_plan(lengths, scheduler="balance", **kw)
    assert plan.scheduler == "balance"
    # a family, then the reordering that won (at PP 1 with expert groups short first is the one)
    assert re.fullmatch(r"(pp-steps|pp-steps-eq3|pp-runs|pp-runs-1f1b|pp-runs-floor|pp-runs-isolated|fill)"
                        r"(\+(short-first|next-levels-first|singles-first))?", plan.meta["assignment"])
    assert plan.meta["expert_slots"] == ("as placed" if seed == 0 else "longest-first")  # both kinds
    request = build_request(lengths, scheduler="balance", overlong="error", align=1, delta=DEFAULT_DELTA,
                            num_buckets=DEFAULT_NUM_BUCKETS, topology=None, pieces=True, seq_split=False,
                            even_expert_slots=True, **kw)
    again = ep_slots.even_expert_slots(plan, request, kw["cost_model"], "balance")
    assert again.content_hash() == plan.content_hash()  # the same micro-batches in the same slots


@pytest.mark.parametrize("name, pp, dataset, seed, tokens", [
    ("pp-runs-1f1b", 4, "github", 1, 120_000), ("pp-runs-1f1b", 2, "byted", 1, 60_000),
    ("pp-runs-1f1b+singles-first", 2, "byted", 0, 60_000),
    ("pp-runs-1f1b+singles-first", 2, "byted", 1, 120_000)])  # here a lead of PP + 1 would lift more
def test_the_1f1b_runs_are_pp_balance_with_the_fill_and_drain_of_the_stages(name, pp, dataset, seed, tokens,
                                                                            monkeypatch):
    """PP-Balance's second pipeline load charges each pipeline PP - 1 times its longest
    micro-batch (1F1B's fill and drain). Made to win, the candidate must be exactly that run,
    built here from the public pieces (and its singles-first variant, exactly that moved)."""
    from megatron_bytescale.planner.schedulers import DEFAULT_DELTA, DEFAULT_NUM_BUCKETS, build_request
    from megatron_bytescale.planner.schedulers._common import emit_plan, unit_sort_key
    from megatron_bytescale.planner.schedulers.pp_balance import pp_balance, singles_first
    from megatron_bytescale.planner.schedulers.selective import unit_options
    from megatron_bytescale.planner.schedulers.widen import widen_for_balance

    lengths = synthetic_lengths(dataset, tokens, seed=seed, max_length=LONGEST)
    kw = dict(hdp_size=8, capacity=CAPACITY, cost_model=_cost_model(False), pp_size=pp, offload=False,
              context_length=LONGEST, topology=None, pieces=True)
    real = balance_mod.estimate_plan

    def wins(plan, *args, **kwargs):
        estimate = real(plan, *args, **kwargs)
        return replace(estimate, step_time_s=0.0) if plan.meta.get("assignment") == name else estimate

    monkeypatch.setattr(balance_mod, "estimate_plan", wins)
    monkeypatch.setattr(balance_mod, "times_without_plan", lambda request: False)  # every candidate estimated
    monkeypatch.setattr(balance_mod, "alone_floors", lambda candidates, *args, **kwargs: [0.0] * len(candidates))
    monkeypatch.setattr(balance_mod, "_units_floor", lambda *args: 0.0)
    plan = make_plan(lengths, scheduler="balance", estimate=False, **kw)
    assert plan.meta["assignment"] == name
    request = build_request(lengths, scheduler="balance", overlong="error", align=1, delta=DEFAULT_DELTA,
                            num_buckets=DEFAULT_NUM_BUCKETS, seq_split=False, even_expert_slots=True,
                            ep_size=1, **kw)
    [(_, ctx, base)] = unit_options(request)
    units, _ = widen_for_balance(list(base), ctx, 8, pp_size=pp)
    units.sort(key=unit_sort_key)
    placements = pp_balance(units, ctx, 8, delta=DEFAULT_DELTA, num_buckets=DEFAULT_NUM_BUCKETS, fill_drain=pp - 1)
    if name.endswith("+singles-first"):
        placements = singles_first(placements, units, pp - 1)
        assert placements is not None
    expected = emit_plan(request, placements, scheduler="balance")
    assert plan.content_hash() == expected.content_hash()


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_without_expert_groups_no_plan_is_evened(pp):
    """Evening slots (for expert groups meeting slot by slot) is only for ep_size > 1."""
    lengths = synthetic_lengths("byted", 60_000, seed=1, max_length=LONGEST)
    plan = make_plan(lengths, scheduler="balance", hdp_size=8, capacity=CAPACITY, cost_model=_cost_model(False),
                     pp_size=pp, offload=False, context_length=LONGEST)
    assert "expert_slots" not in plan.meta
