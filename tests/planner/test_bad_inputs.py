"""Every bad input of ``bytescale plan``/``simulate``, their files and the plan JSON that once
escaped as a traceback, a hang or a silent acceptance, as one table: each row is one case and
the fragment its one-line error must contain (docs/testing.md, "Bad input").

Rows run in-process (the command's ``main`` with an argv, stderr captured), so the table is
cheap; the launcher-side cases (demo, profile, .idx datasets, jsonl corpora) are in
tests/integration/test_bad_inputs_launchers.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import pytest

from megatron_bytescale.planner.plan import PlanError, StepPlan
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.tools import plan_cmd, simulate_cmd

NESTED = "[" * 5000 + "]" * 5000
BIG400 = "1" + "0" * 400
BIG30 = "1" + "0" * 30
BIG29 = "1" + "0" * 29


def _files(tmp: Path) -> dict[str, Path]:
    """The files the rows name, written once per test."""
    cost_model = preset_cost_model("llama-7b").to_dict()

    def cm(**changes) -> str:
        return json.dumps({**cost_model, **changes})

    texts = {
        "lengths.txt": "4096\n812\n131072\n",
        "nested.json": NESTED,
        "underscore.txt": "4096\n5_000\n",
        "arabic.txt": "4096\n\u0664\u0660\u0669\u0666\n",
        "fullwidth.txt": "4096\n\uff14\uff10\uff19\uff16\n",
        "formfeed.txt": "4096\x0c812\n",
        "vtab.txt": "4096\x0b812\n",
        "filesep.txt": "4096\x1c812\n",
        "linesep.txt": "4096\u2028812\n",
        "digits4300.txt": "4096\n" + "9" * 4300 + "\n",
        "cm_nested.json": '{"name": ' + NESTED + "}",
        "cm_big.json": cm(alpha1=0).replace('"alpha1": 0', f'"alpha1": {BIG400}'),
        "cm_ranks.json": cm(ranks_per_node=0).replace('"ranks_per_node": 0', f'"ranks_per_node": {BIG30}'),
        "cm_ranks29.json": cm(ranks_per_node=0).replace('"ranks_per_node": 0', f'"ranks_per_node": {BIG29}'),
        "cm_name.json": cm(name={"x": 1}),
        "cm.json": cm(),
        "nodes_nested.json": NESTED,
        "nodes_big.json": f"[0, 0, 1, {BIG30}]",
        "nodes_big29.json": f"[0, 0, 1, {BIG29}]",
        "nodes_big.txt": f"0\n0\n1\n{BIG30}\n",
    }
    for name, text in texts.items():
        (tmp / name).write_text(text, encoding="utf-8")
    for name in ("fifo", "fifo.idx"):
        os.mkfifo(tmp / name)
    return {name: tmp / name for name in [*texts, "fifo", "fifo.idx"]}


# (case id, command, argv with {file} placeholders, fragment of the one-line error)
CLI_CASES = [
    # tracebacks
    ("lengths-nested-json", "plan", ["{nested.json}"], "nests 5,000 levels deep"),
    ("cost-model-nested-json", "plan", ["{lengths.txt}", "--cost-model", "{cm_nested.json}"], "nests 5,001 levels deep"),
    ("node-map-nested-json", "plan", ["{lengths.txt}", "--hdp-size", "4", "--node-map", "{nodes_nested.json}"],
     "nests 5,000 levels deep"),
    ("cost-model-10^400", "plan", ["{lengths.txt}", "--cost-model", "{cm_big.json}"], "a number of 401 digits"),
    ("cost-model-ranks-per-node-10^30", "plan", ["{lengths.txt}", "--cost-model", "{cm_ranks.json}"],
     "holds a number of 31 digits"),
    ("cost-model-ranks-per-node-10^29", "plan", ["{lengths.txt}", "--cost-model", "{cm_ranks29.json}"],
     "ranks_per_node (100000000000000000000000000000) must be between 1 and 2,147,483,647"),
    ("ranks-per-node-flag-10^30", "plan", ["{lengths.txt}", "--ranks-per-node", BIG30],
     "must be >= 1 (at most 2,147,483,647)"),
    ("node-id-10^30-json", "plan", ["{lengths.txt}", "--hdp-size", "4", "--node-map", "{nodes_big.json}"],
     "holds a number of 31 digits"),
    ("node-id-10^29-json", "plan", ["{lengths.txt}", "--hdp-size", "4", "--node-map", "{nodes_big29.json}"],
     "HDP rank 3 is on node an integer of over 12 digits"),
    ("node-id-10^30-text", "plan", ["{lengths.txt}", "--hdp-size", "4", "--node-map", "{nodes_big.txt}"],
     "line 4: a number of 31 digits"),
    ("simulate-contexts-empty", "simulate", ["--contexts", ",,"], "--contexts ',,': '' is not a token count"),
    ("simulate-contexts-1e100", "simulate", ["--contexts", "1e100"], "'1e100' is longer than the"),
    ("plan-global-tokens-1e15", "plan", ["--global-tokens", "1000000000000000"],
     "--global-tokens (1,000,000,000,000,000) is more than"),
    ("simulate-global-tokens-1e15", "simulate", ["--global-tokens", "1000000000000000"],
     "--global-tokens (1,000,000,000,000,000) is more than"),
    # hangs: a FIFO blocks open() until a writer comes
    ("lengths-fifo", "plan", ["{fifo}"], "is a FIFO (named pipe); give a regular file"),
    ("index-fifo", "plan", ["{fifo.idx}"], "is a FIFO (named pipe); give a regular file"),
    ("cost-model-fifo", "plan", ["{lengths.txt}", "--cost-model", "{fifo}"], "is a FIFO (named pipe)"),
    ("node-map-fifo", "plan", ["{lengths.txt}", "--hdp-size", "4", "--node-map", "{fifo}"], "is a FIFO (named pipe)"),
    ("simulate-lengths-fifo", "simulate", ["{fifo}"], "is a FIFO (named pipe)"),
    # silent accepts
    ("length-5_000", "plan", ["{underscore.txt}"], "line 2: '5_000' is not an integer written in the digits 0-9"),
    ("length-arabic-indic", "plan", ["{arabic.txt}"], "line 2: '\u0664\u0660\u0669\u0666' is not an integer"),
    ("length-fullwidth", "plan", ["{fullwidth.txt}"], "line 2: '\uff14\uff10\uff19\uff16' is not an integer"),
    ("length-form-feed", "plan", ["{formfeed.txt}"], r"line 1: '4096\x0c812' is not an integer"),
    ("length-vertical-tab", "plan", ["{vtab.txt}"], r"line 1: '4096\x0b812' is not an integer"),
    ("length-file-separator", "plan", ["{filesep.txt}"], r"line 1: '4096\x1c812' is not an integer"),
    ("length-U+2028", "plan", ["{linesep.txt}"], r"line 1: '4096\u2028812' is not an integer"),
    ("cost-model-and-model", "plan", ["{lengths.txt}", "--cost-model", "{cm.json}", "--model", "llama-70b"],
     "give either --model llama-70b or --cost-model"),
    ("simulate-cost-model-and-model", "simulate", ["{lengths.txt}", "--cost-model", "{cm.json}", "--model", "llama-70b"],
     "give either --model llama-70b or --cost-model"),
    ("cost-model-name-object", "plan", ["{lengths.txt}", "--cost-model", "{cm_name.json}"],
     "cost model field 'name' ({'x': 1}) must be a string"),
    # messages that named nothing
    ("length-4300-digits", "plan", ["{digits4300.txt}"], "line 2: a number of 4,300 digits (999999999999...) is out of range"),
]


@pytest.mark.parametrize("case, command, argv, fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input_is_one_line_naming_it(tmp_path, capsys, case, command, argv, fragment):
    files = _files(tmp_path)
    args = [str(files[a[1:-1]]) if a.startswith("{") else a for a in argv]
    main = {"plan": plan_cmd.main, "simulate": simulate_cmd.main}[command]
    start = time.monotonic()
    code = main([*args, "--quiet"])
    err = capsys.readouterr().err
    assert time.monotonic() - start < 30, case  # a FIFO or a huge batch is refused, not waited on
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"bytescale {command}: error:"), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err and "Error:" not in lines[0].split("error:", 1)[1], lines[0]


# ----------------------------------------------------------------------------- StepPlan JSON
def _plan_dict() -> dict:
    plan = make_plan([3000, 500, 9000, 20], scheduler="naive", hdp_size=2, capacity=8192,
                     cost_model=preset_cost_model("llama-7b"), overlong="drop", context_length=8192,
                     offload=False)
    data = json.loads(plan.to_json())
    assert data["meta"]["dropped"] == [2]  # the 9000-token sequence is over the context
    return data


def _edit(path: list, value) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


MB0 = ["ranks", 0, "micro_batches", 0]
PLAN_CASES = [
    ("plan-nested-json", None, "plan is not valid JSON here: it nests"),
    ("plan-offload-ratio-string", _edit([*MB0, "offload_ratio"], "0"), "offload_ratio must be a number, got '0'"),
    ("plan-scheduler-list", _edit(["scheduler"], ["x"]), "scheduler must be a string, got ['x']"),
    ("plan-negative-step-time", _edit(["estimate", "step_time_s"], -1.0),
     "estimate.step_time_s must be a finite number of seconds >= 0, got -1.0"),
    ("plan-nan-rank-time", _edit(["estimate", "rank_time_s", 1], float("nan")),
     "estimate.rank_time_s[1] must be a finite number of seconds >= 0, got nan"),
    ("plan-negative-p2p-bytes", _edit(["estimate", "p2p_bytes"], -5), "estimate.p2p_bytes (-5) must be >= 0"),
    ("plan-dropped-names-a-trained-sequence", _edit(["meta", "dropped"], [2, 0]),
     "meta.dropped names sequences [0] that the plan trains"),
    ("plan-dropped-not-a-list", _edit(["meta", "dropped"], "2"), "meta.dropped must be a list"),
    ("plan-dropped-tokens-negative", _edit(["meta", "dropped_tokens"], -9000), "meta.dropped_tokens (-9000) must be >= 0"),
]


@pytest.mark.parametrize("case, edit, fragment", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_json_is_refused_naming_the_field(case, edit, fragment):
    if edit is None:
        text = NESTED
    else:
        data = _plan_dict()
        StepPlan.from_dict(data).validate()  # the unedited plan is fine
        edit(data)
        text = json.dumps(data)
    with pytest.raises(PlanError) as info:
        StepPlan.from_json(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_table_size():
    """The counts docs/testing.md quotes for this file."""
    assert (len(CLI_CASES), len(PLAN_CASES)) == (30, 9)
