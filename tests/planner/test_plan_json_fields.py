"""`StepPlan.from_dict` field by field: defaults of the optional fields, the estimate's extra
entries, and the path every refusal names.

A plan file edited by hand (or written by another version) must read as the plan written or be
refused with the path of the field to fix; the bad-input table checks a few fields, this checks
every one the reader types.
"""

from __future__ import annotations

import copy
import json

import pytest

from megatron_bytescale.planner.plan import PlanError, StepPlan
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan


def _plan(**kw) -> dict:
    plan = make_plan([3000, 500, 700, 200], scheduler="balance", hdp_size=4, capacity=1024,
                     cost_model=preset_cost_model("llama-7b"), **kw)
    return json.loads(plan.to_json())


def test_optional_fields_left_out_read_as_their_defaults():
    data = _plan()
    for key in ("pp_size", "layers_per_stage", "virtual_pipeline_size", "ep_size", "align"):
        data.pop(key, None)
    for rank in data["ranks"]:
        for mb in rank["micro_batches"]:
            mb.pop("offload_ratio", None)
            mb.pop("seqs")  # read from the pieces, in order of first appearance
    plan = StepPlan.from_dict(data)
    assert (plan.pp_size, plan.layers_per_stage, plan.virtual_pipeline_size, plan.ep_size, plan.align) == (1, 1, 1, 1, 1)
    original = StepPlan.from_dict(_plan())
    assert [[(mb.seqs, mb.offload_ratio) for mb in r.micro_batches] for r in plan.ranks] == \
        [[(mb.seqs, 0.0) for mb in r.micro_batches] for r in original.ranks]


def test_every_field_round_trips_and_the_estimate_keeps_its_extra_entries():
    data = _plan()
    data["estimate"]["critical_path_s"] = 1.25
    data.update(pp_size=1, layers_per_stage=32, ep_size=2, align=8)
    plan = StepPlan.from_dict(data)
    assert plan.estimate is not None and plan.estimate.extra == {
        k: v for k, v in data["estimate"].items() if k not in ("step_time_s", "rank_time_s", "p2p_bytes")}
    assert plan.estimate.extra["critical_path_s"] == 1.25
    assert plan.estimate.step_time_s == data["estimate"]["step_time_s"]
    assert (plan.layers_per_stage, plan.ep_size, plan.align) == (32, 2, 8)
    assert StepPlan.from_dict({**data, "virtual_pipeline_size": 2, "pp_size": 2}).virtual_pipeline_size == 2
    assert plan.version == data["version"]


def _edit(path: str, value):
    data = _plan()
    where, key = data, path.split(".")
    for k in key[:-1]:
        where = where[int(k)] if k.isdigit() else where[k]
    last = key[-1]
    if value is _DELETE:
        del where[last]
    else:
        where[int(last) if last.isdigit() else last] = value
    return data


_DELETE = object()

REFUSED = [  # (field path to edit, bad value, what the message must name)
    ("pp_size", 1.5, "pp_size must be an integer"),
    ("layers_per_stage", "4", "layers_per_stage must be an integer"),
    ("virtual_pipeline_size", True, "virtual_pipeline_size must be an integer"),
    ("ep_size", 2.0, "ep_size must be an integer"),
    ("align", None, "align must be an integer"),
    ("sequences", {"0": 1}, "sequences must be a list"),
    ("sequences.0.id", "0", "sequences[0].id must be an integer"),
    ("ranks.0.rank", 0.0, "ranks[0].rank must be an integer"),
    ("ranks.0.micro_batches.0.seqs", "0", "ranks[0].micro_batches[0].seqs must be a list"),
    ("ranks.0.micro_batches.0.seqs.0", 0.5, "ranks[0].micro_batches[0].seqs must be an integer"),
    ("ranks.0.micro_batches.0.pieces.0.seq", "0", "ranks[0].micro_batches[0].pieces[0].seq must be an integer"),
    ("ranks.0.micro_batches.0.pieces.0.start", 0.0, "ranks[0].micro_batches[0].pieces[0].start must be an integer"),
    ("ranks.0.micro_batches.0.chunk", "01", "ranks[0].micro_batches[0].chunk must be a list"),
    ("ranks.0.micro_batches.0.chunk", [0.0, 2], "ranks[0].micro_batches[0].chunk must be an integer"),
    ("ranks.0.micro_batches.0.chunk", [0, "2"], "ranks[0].micro_batches[0].chunk must be an integer"),
    ("estimate.rank_time_s", 1.0, "estimate.rank_time_s must be a list"),
    ("estimate.p2p_bytes", 1.5, "estimate.p2p_bytes must be an integer"),
    ("estimate.step_time_s", True, "estimate.step_time_s must be a finite number of seconds"),
    ("estimate.step_time_s", "1", "estimate.step_time_s must be a finite number of seconds"),
    ("estimate.step_time_s", -1.0, "estimate.step_time_s must be a finite number of seconds"),
    ("estimate.step_time_s", float("inf"), "estimate.step_time_s must be a finite number of seconds"),
    ("meta.dropped", [0.5], "meta.dropped must be an integer"),
    ("meta.dropped_tokens", -1, "meta.dropped_tokens (-1) must be >= 0"),
    ("meta.truncated_tokens", -1, "meta.truncated_tokens (-1) must be >= 0"),
    ("meta.truncated_tokens", 2.5, "meta.truncated_tokens must be an integer"),
]


@pytest.mark.parametrize("path, value, said", REFUSED, ids=[f"{p}={v!r}" for p, v, _ in REFUSED])
def test_a_bad_field_is_refused_naming_its_path(path, value, said):
    with pytest.raises(PlanError) as exc:
        StepPlan.from_dict(_edit(path, value))
    assert said in str(exc.value), str(exc.value)


def test_counts_of_zero_are_accepted_in_meta():
    data = _plan()
    data["meta"].update(dropped=[], dropped_tokens=0, truncated_tokens=0)
    plan = StepPlan.from_dict(data)
    assert plan.meta["dropped_tokens"] == 0 and plan.meta["truncated_tokens"] == 0
    assert copy.deepcopy(plan.meta["dropped"]) == []
