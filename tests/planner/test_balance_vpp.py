"""PP-Balance with interleaved stages: ``make_plan(virtual_pipeline_size=v)`` ranks the
candidates by plain 1F1B and keeps the fastest interleaved of the close ones
(``planner/schedulers/pp_vpp.py``). Seeded batches for the property (never slower interleaved
than the 1F1B winner) and for a strict gain, fake estimates for the selection rule, and the
inputs it refuses."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.estimate import estimate_plan, with_virtual_pipeline
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import candidate_time, make_plan, pp_vpp
from megatron_bytescale.planner.schedulers._common import emit_plan
from megatron_bytescale.planner.schedulers.pp_vpp import INTERLEAVED_SLACK, fastest_interleaved
from megatron_bytescale.planner.topology import Topology

CM = preset_cost_model("llama-7b")  # 32 layers: 8 per stage at PP 4, 16 at PP 2


def plans(dataset: str, seed: int, hdp: int, pp: int, vpp: int, **kw):
    """The plain 1F1B plan and the interleaved pick of one seeded batch."""
    lengths = synthetic_lengths(dataset, 2**19, seed=seed, max_length=65536)
    kw = dict(scheduler="balance", hdp_size=hdp, capacity=4096, cost_model=CM, pp_size=pp, **kw)
    return make_plan(lengths, **kw), make_plan(lengths, virtual_pipeline_size=vpp, **kw)


@pytest.mark.parametrize("dataset, seed, hdp, pp, vpp, offload, align", [
    ("github", 3, 16, 4, 2, True, 1), ("byted", 4, 16, 4, 4, False, 8), ("github", 5, 16, 2, 2, False, 1),
    ("byted", 6, 12, 2, 8, True, 16), ("github", 7, 16, 4, 8, True, 1),
])
def test_the_interleaved_pick_is_never_slower_interleaved_than_the_1f1b_winner(dataset, seed, hdp, pp, vpp, offload,
                                                                              align):
    flat, picked = plans(dataset, seed, hdp, pp, vpp, offload=offload, align=align)
    assert picked.virtual_pipeline_size == vpp and flat.virtual_pipeline_size == 1
    picked.validate()  # pieces and all: the plan training runs
    assert "interleaved" in picked.estimate.extra["model"]
    # the estimate it carries is its own (timed on a timing-only twin of the same placements)
    assert picked.estimate.step_time_s == estimate_plan(picked, CM).step_time_s
    assert picked.estimate.step_time_s <= with_virtual_pipeline(flat, vpp, CM).estimate.step_time_s * (1 + 1e-12)
    assert 0 <= picked.meta["interleaved_rank"] < picked.meta["interleaved_timed"]
    assert "interleaved_timed" not in flat.meta


def test_where_singles_first_fills_the_1f1b_window_another_candidate_runs_faster_interleaved():
    """Seed 0, GitHub-like, 16 pipelines x PP 4: the 1F1B winner lifts singles before the
    rings; interleaved with 2 virtual stages it takes 1.694 s, the pick 1.550 s (1.09x)."""
    flat, picked = plans("github", 0, 16, 4, 2, offload=True)
    assert flat.meta["assignment"].endswith("+singles-first")
    assert picked.meta["assignment"] != flat.meta["assignment"]
    as_planned = with_virtual_pipeline(flat, 2, CM).estimate.step_time_s
    assert picked.estimate.step_time_s < as_planned / 1.05
    # and in plain 1F1B the pick is no better than the winner, or it would have won there
    assert estimate_plan(replace(picked, virtual_pipeline_size=1), CM).step_time_s >= flat.estimate.step_time_s


def test_other_schedulers_carry_the_virtual_stages_and_their_estimate():
    lengths = synthetic_lengths("byted", 2**18, seed=1, max_length=32768)
    for scheduler in ("naive", "static"):
        kw = dict(scheduler=scheduler, hdp_size=8, capacity=4096, cost_model=CM, pp_size=2)
        flat = make_plan(lengths, **kw)
        plan = make_plan(lengths, virtual_pipeline_size=4, **kw)
        assert plan.virtual_pipeline_size == 4
        assert plan.estimate.step_time_s == with_virtual_pipeline(flat, 4, CM).estimate.step_time_s


@pytest.mark.parametrize("kw, words", [
    (dict(pp_size=4, virtual_pipeline_size=3), "does not divide the 8 layers"),
    (dict(pp_size=1, virtual_pipeline_size=2), "needs pipeline parallelism"),
    (dict(pp_size=2, virtual_pipeline_size=0), "must be an integer >= 1"),
    (dict(pp_size=2, virtual_pipeline_size=2.0), "must be an integer >= 1"),
    (dict(pp_size=2, virtual_pipeline_size=2, seq_split=True), "virtual stages"),
])
def test_virtual_stages_that_cannot_run_are_refused_by_name(kw, words):
    with pytest.raises(ValueError, match=words):
        make_plan([5000, 300, 200], scheduler="balance", hdp_size=4, capacity=4096, cost_model=CM, **kw)


def test_every_candidate_is_timed_interleaved_as_its_plan_would_be(monkeypatch):
    """Timed from placements (``candidate_time.finish_times(vpp=...)``): the floats of the
    emitted plan's interleaved estimate, on the regular and an irregular node map, two-level
    rings and offload."""
    checked = {"n": 0, "rings": 0, "stopped": 0}

    def checking(request, placements, cost_model, seconds=None, stop_above=None, vpp=1):
        got = candidate_time.finish_times(request, placements, cost_model, seconds, stop_above, vpp=vpp)
        plan = emit_plan(replace(request, pieces=False, virtual_pipeline_size=vpp), placements, scheduler="balance")
        assert plan.virtual_pipeline_size == vpp > 1
        want = np.asarray(estimate_plan(plan, cost_model).rank_time_s)
        assert got is not None
        if np.isinf(got).all():  # stopped: it could not beat the best so far
            assert stop_above is not None and want.max() > stop_above
            checked["stopped"] += 1
        else:
            assert np.array_equal(got, want)
        checked["n"] += 1
        checked["rings"] += any(len(p.ring) > 1 for p in placements)
        return got

    monkeypatch.setattr(pp_vpp, "finish_times", checking)
    irregular = Topology.from_node_map([r // 4 if r % 8 < 3 else r // 4 + 100 for r in range(16)])
    for dataset, seed, pp, vpp, kw in (("github", 0, 4, 2, {}), ("byted", 1, 2, 4, dict(topology=irregular)),
                                       ("github", 2, 4, 4, dict(cost_model=CM.with_(two_level_ring=True)))):
        lengths = synthetic_lengths(dataset, 2**19, seed=seed, max_length=65536)
        plan = make_plan(lengths, **{**dict(scheduler="balance", hdp_size=16, capacity=4096, cost_model=CM, pp_size=pp,
                                            virtual_pipeline_size=vpp), **kw})
        assert plan.estimate.step_time_s == estimate_plan(replace(plan, estimate=None), kw.get("cost_model", CM),
                                                          kw.get("topology")).step_time_s
    assert checked["n"] >= 10 and checked["rings"] >= 10 and 0 < checked["stopped"] < checked["n"]


@pytest.mark.parametrize("dataset, seed, pp, vpp", [("github", 0, 4, 2), ("byted", 1, 2, 4), ("github", 7, 4, 8)])
def test_stopping_the_candidates_that_cannot_win_changes_no_pick(monkeypatch, dataset, seed, pp, vpp):
    lengths = synthetic_lengths(dataset, 2**19, seed=seed, max_length=65536)
    kw = dict(scheduler="balance", hdp_size=16, capacity=4096, cost_model=CM, pp_size=pp, virtual_pipeline_size=vpp)
    stopping = make_plan(lengths, **kw)
    full = candidate_time.finish_times
    monkeypatch.setattr(pp_vpp, "finish_times", lambda *a, stop_above=None, **k: full(*a, **k))
    assert stopping == make_plan(lengths, **kw)


@dataclass(frozen=True)
class _Plan:
    placements: str
    meta: dict
    estimate: object = None


@dataclass(frozen=True)
class _Request:
    pieces: bool = True
    virtual_pipeline_size: int = 2


def _fake_timing(monkeypatch, interleaved: dict[str, float]) -> list[tuple[str, bool]]:
    """Candidates timed from their plans, with emit and estimate replaced: a candidate's
    placements are its name, its interleaved step ``interleaved[name]``. Returns (name, pieces)
    of every plan emitted, in order."""
    emitted = []

    def emit(request, placements, *, scheduler, meta):
        assert scheduler == "balance" and request.virtual_pipeline_size == 2
        emitted.append((placements, request.pieces))
        return _Plan(placements, meta)

    monkeypatch.setattr(pp_vpp, "times_without_plan", lambda request: False)
    monkeypatch.setattr(pp_vpp, "emit_plan", emit)
    monkeypatch.setattr(pp_vpp, "estimate_plan",
                        lambda plan, cm: SimpleNamespace(step_time_s=interleaved[plan.placements]))
    return emitted


def _finalist(step: float, index: tuple, name: str) -> tuple:
    return (step, index), (name, {"assignment": name}, CM), {}


def test_every_candidate_within_the_slack_is_timed_and_ties_keep_the_key_order(monkeypatch):
    emitted = _fake_timing(monkeypatch, {"a": 5.0, "b": 4.0, "c": 4.0, "d": 1.0, "e": 4.5})
    edge = 10.0 * (1 + INTERLEAVED_SLACK)
    finalists = [_finalist(edge * 1.001, (1, (0, 2)), "d"),  # just past the slack: never timed
                 _finalist(edge, (1, (0, 1)), "c"),  # on the edge: timed, ties with b, comes later
                 _finalist(10.5, (0, (3, 1)), "b"),
                 _finalist(10.2, (0, (2, 2)), "e"),
                 _finalist(10.0, (0, (2, 1)), "a")]
    plan, cost_model = fastest_interleaved(_Request(), finalists, 10.0, scheduler="balance")
    assert [name for name, _ in emitted] == ["a", "e", "b", "c", "b"]  # by key; the winner emitted again
    assert [pieces for _, pieces in emitted] == [False] * 4 + [True]  # timed without token pieces
    assert plan.placements == "b" and plan.estimate.step_time_s == 4.0 and cost_model is CM
    assert plan.meta == {"assignment": "b", "interleaved_timed": 4, "interleaved_rank": 2}


def test_the_1f1b_winner_stays_when_nothing_is_faster_interleaved(monkeypatch):
    _fake_timing(monkeypatch, {"a": 3.0, "b": 3.0, "c": 3.5})
    finalists = [_finalist(10.1, (0, (1, 1)), "b"), _finalist(10.0, (0, (0, 1)), "a"),
                 _finalist(10.2, (0, (2, 1)), "c")]
    plan, _ = fastest_interleaved(_Request(pieces=False), finalists, 10.0, scheduler="balance")
    assert plan.placements == "a" and plan.meta["interleaved_rank"] == 0


def test_no_finalist_within_the_slack_is_an_error(monkeypatch):
    _fake_timing(monkeypatch, {})
    with pytest.raises(ValueError, match="1F1B winner"):
        fastest_interleaved(_Request(), [_finalist(2.0, (0, (0, 1)), "a")], 1.0, scheduler="balance")


def test_with_expert_groups_the_candidates_are_timed_interleaved_from_their_plans(monkeypatch):
    """Expert groups in lockstep are timed slot by slot, which only a built plan's estimate
    does: the finalists are emitted and estimated with the virtual stages."""
    cm = preset_cost_model("mistral-8x7b", "paper-fit", expert_parallel_size=2)
    lengths = synthetic_lengths("byted", 600_000, seed=3, max_length=1 << 17)
    timed = []

    def counting(plan, cost_model, *args):
        timed.append(plan.virtual_pipeline_size)
        return estimate_plan(plan, cost_model, *args)

    monkeypatch.setattr(pp_vpp, "estimate_plan", counting)
    plan = make_plan(lengths, scheduler="balance", hdp_size=16, capacity=8192, cost_model=cm, pp_size=4, ep_size=2,
                     virtual_pipeline_size=2)
    assert plan.virtual_pipeline_size == 2 and plan.ep_size == 2
    assert len(timed) == plan.meta["interleaved_timed"] >= 1 and set(timed) == {2}
    assert "interleaved" in plan.estimate.extra["model"] and "lockstep" in plan.estimate.extra["model"]
    assert plan.estimate.step_time_s == estimate_plan(replace(plan, estimate=None), cm).step_time_s
    plan.validate()
