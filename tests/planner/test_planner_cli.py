"""`bytescale plan` end to end, import hygiene and determinism across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.plan import StepPlan
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
from megatron_bytescale.tools.plan_cmd import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_bytescale.cli", "plan", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)


def test_cli_compare_json_plot_end_to_end(tmp_path):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "out" / "plan.png"
    res = run_cli("--compare", "--global-tokens", "4000000", "--hdp-size", "64",
                  "--context-length", "262144", "--json", str(out_json), "--plot", str(out_png), "--validate")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = next(l for l in lines if l.startswith("scheduler"))
    assert "step (s)" in header and "x balance" in header and "P2P" in header and "rings" in header
    rows = {l.split()[0]: l.split() for l in lines if l.split() and l.split()[0] in ("balance", "naive", "static", "pow2")}
    assert set(rows) == {"balance", "naive", "static", "pow2"}
    assert rows["balance"][2] == "1.00"  # ratio to itself
    assert "plan valid and deadlock-free" in res.stdout
    assert "[bytescale plan]" in res.stderr  # progress
    plan = StepPlan.from_json(out_json.read_text())
    plan.validate()
    assert plan.scheduler == "balance" and plan.hdp_size == 64 and plan.total_tokens == 4_000_000
    assert plan.estimate is not None and plan.meta["cost_model"].startswith("llama-7b")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    res = run_cli(str(tmp_path / "missing.txt"))
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "missing.txt' does not exist" in err[0] and "Traceback" not in res.stderr


@pytest.mark.parametrize("argv, match", [
    (["--hdp-size", "0"], r"argument --hdp-size: 0 must be >= 1"),
    (["--capacity", "-1"], r"argument --capacity: -1 must be >= 1"),
    (["--pp-size", "0"], r"argument --pp-size: 0 must be >= 1"),
    (["--pp-size", "3"], r"pp_size \(3\) must divide"),
    (["--scheduler", "magic"], r"argument --scheduler: invalid choice: 'magic'"),
    (["--model", "gpt-9"], r"unknown model preset 'gpt-9'"),
    (["--synthetic", "pile"], r"invalid choice: 'pile'"),
    (["--hdp-size", "abc"], r"argument --hdp-size: 'abc' is not an integer"),
    (["--no-offload", "--hdp-size", "8"], r"sequence \d+ has \d+ tokens but at most 65536 fit.*--overlong drop\|truncate"),
    (["--scheduler", "static", "--hdp-size", "100", "--context-length", "2097152"], r"static: no context-parallel size fits"),
])
def test_cli_bad_arguments(capsys, argv, match):
    assert main(["--global-tokens", "3000000", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bytescale plan: error:")
    assert __import__("re").search(match, err), err


def test_cli_overlong_drop_and_truncate_are_reported(capsys):
    base = ["--global-tokens", "3000000", "--hdp-size", "8", "--no-offload", "--quiet"]
    assert main(base + ["--overlong", "drop"]) == 0
    assert "balance: dropped" in capsys.readouterr().out
    assert main(base + ["--overlong", "truncate"]) == 0
    assert "balance: truncated" in capsys.readouterr().out


def test_cli_reads_files_and_marks_inapplicable_schedulers(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(["30000", "9000", "500", "100"] * 20) + "\n")
    assert main([str(f), "--hdp-size", "6", "--compare", "--quiet", "--pp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "file " in out and "PP 2" in out
    assert "pow2: not applicable: scheduler 'pow2'" in out
    j = tmp_path / "lengths.json"
    j.write_text(json.dumps([30000, 9000, 500]))
    assert main([str(j), "--hdp-size", "8", "--quiet", "--scheduler", "naive"]) == 0
    assert "naive" in capsys.readouterr().out


def test_planner_imports_neither_torch_nor_megatron():
    code = (
        "import sys\n"
        "import megatron_bytescale.planner, megatron_bytescale.planner.schedulers\n"
        "import megatron_bytescale.data.synthetic, megatron_bytescale.data.lengths\n"
        "import megatron_bytescale.tools.plan_cmd, megatron_bytescale.tools.gantt\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'matplotlib')]\n"
        "print(bad)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


HASH_SCRIPT = """
import sys
from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan
lengths = synthetic_lengths("github", 3_000_000, seed=3, max_length=262144)
for s in ("naive", "balance", "static", "pow2"):
    p = make_plan(lengths, scheduler=s, hdp_size=48, capacity=8192, cost_model=preset_cost_model(), estimate=False)
    print(s, p.content_hash())
p = make_plan(lengths, scheduler="balance", hdp_size=48, capacity=8192, cost_model=preset_cost_model(), pp_size=2, estimate=False)
print("balance-pp2", p.content_hash())
"""


def test_same_plan_hash_in_two_processes():
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", HASH_SCRIPT], cwd=REPO, capture_output=True, text=True,
                             timeout=120, env=env)
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout)
    assert outs[0] == outs[1]
    lengths = synthetic_lengths("github", 3_000_000, seed=3, max_length=262144)
    here = make_plan(lengths, scheduler="balance", hdp_size=48, capacity=8192, cost_model=preset_cost_model())
    assert f"balance {here.content_hash()}" in outs[0]


def test_cli_says_what_a_moe_preset_plan_is(capsys):
    """A Mistral (MoE) preset's plan says how its experts and token dispatch are modelled and what the
    plugin trains; a dense preset's says nothing of the kind."""
    base = ["--global-tokens", "400000", "--hdp-size", "8", "--no-offload", "--quiet"]
    assert main(base + ["--model", "mistral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "note: mistral-8x7b is a mixture-of-experts model (8 experts, top-2)" in out
    assert ("tensor parallelism, pipeline parallelism or both, with or without expert "
            "parallelism" in out)
    assert main(base + ["--model", "llama-7b"]) == 0
    assert "mixture-of-experts" not in capsys.readouterr().out


EP_ARGS = ["--global-tokens", "400000", "--hdp-size", "8", "--pp-size", "1", "--no-offload", "--quiet",
           "--model", "mistral-8x7b", "--context-length", "65536"]


@pytest.mark.parametrize("scheduler", ["balance", "static"])
def test_cli_plans_carry_the_expert_parallel_slot_rule(scheduler, tmp_path, capsys):
    """--expert-model-parallel-size E reaches make_plan: the written plan holds ep_size E and
    passes validate(), which rejects a ring micro-batch at different local indices."""
    out = tmp_path / "plan.json"
    assert main(EP_ARGS + ["--scheduler", scheduler, "--expert-model-parallel-size", "2", "--validate",
                           "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EP 2 (ring micro-batches at one slot on all members)" in printed
    assert "note: with --expert-model-parallel-size 2 the members of an expert group wait" in printed
    plan = StepPlan.from_json(out.read_text())
    assert plan.ep_size == 2 and plan.scheduler == scheduler
    plan.validate()
    assert main(EP_ARGS + ["--scheduler", scheduler, "--json", str(out)]) == 0  # EP 1: no rule recorded
    assert StepPlan.from_json(out.read_text()).ep_size == 1
    assert "expert group wait" not in capsys.readouterr().out


@pytest.mark.parametrize("scheduler", ["naive", "pow2"])
def test_cli_refuses_schedulers_without_the_slot_rule_at_ep(scheduler, capsys):
    assert main(EP_ARGS + ["--scheduler", scheduler, "--ep-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bytescale plan: error: ")
    assert f"scheduler '{scheduler}' cannot plan for --expert-model-parallel-size 2" in err[0]
    assert "use --scheduler balance or --scheduler static" in err[0]
    assert main(EP_ARGS + ["--scheduler", scheduler]) == 0  # fine without expert parallelism


def test_cli_compare_at_ep_says_which_rows_cannot_plan(capsys):
    assert main(EP_ARGS + ["--compare", "--ep-size", "2"]) == 0
    out = capsys.readouterr().out
    rows = {l.split()[0]: l.split() for l in out.splitlines() if l.split() and l.split()[0] in
            ("balance", "naive", "static", "pow2", "megatron-hybrid-cp")}
    assert rows["balance"][1] != "n/a" and rows["static"][1] != "n/a"
    for name in ("naive", "pow2", "megatron-hybrid-cp"):
        assert rows[name][1] == "n/a"
        assert f"{name}: not applicable: scheduler '{name}' cannot plan for --expert-model-parallel-size 2" in out


def test_cli_ep_of_a_cost_model_file(tmp_path, capsys):
    """A cost model file's expert-parallel size (bytescale profile --num-experts ...
    --expert-model-parallel-size E) binds the plan too, and must divide --hdp-size."""
    path = tmp_path / "cm.json"
    preset_cost_model("mistral-8x7b", expert_parallel_size=2).save(path)
    base = ["--global-tokens", "200000", "--no-offload", "--quiet", "--cost-model", str(path),
            "--context-length", "65536"]
    out = tmp_path / "plan.json"
    assert main(base + ["--hdp-size", "6", "--json", str(out)]) == 0
    assert StepPlan.from_json(out.read_text()).ep_size == 2
    capsys.readouterr()
    assert main(base + ["--hdp-size", "7"]) == 2
    err = capsys.readouterr().err
    assert "expert-parallel size 2 (of the cost model) must divide --hdp-size (7)" in err


def test_cli_expert_tensor_parallel_size_sets_the_plans_expert_groups(tmp_path, capsys):
    """--expert-tensor-parallel-size P: an expert group is P x E GPUs, so the plan keeps
    max(1, P E / TP) HDP ranks in step (mistral-8x7b is TP 4), not E."""
    out = tmp_path / "plan.json"
    assert main(EP_ARGS + ["--scheduler", "balance", "--ep-size", "8", "--etp-size", "2", "--validate",
                           "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ETP 2 x EP 8: expert groups of 4 HDP ranks (ring micro-batches at one slot on all members)" in printed
    assert "cost model mistral-8x7b-tp4-ep8-etp2@h100" in printed
    assert ("note: with --expert-tensor-parallel-size 2 x --expert-model-parallel-size 8 (expert groups of 4 "
            "HDP ranks) the members of an expert group wait") in printed
    assert StepPlan.from_json(out.read_text()).ep_size == 4
    # ETP 2 x EP 2 = 4 GPUs = one HDP rank's TP group: no slot rule, every scheduler plans
    assert main(EP_ARGS + ["--scheduler", "naive", "--ep-size", "2", "--etp-size", "2", "--json", str(out)]) == 0
    assert StepPlan.from_json(out.read_text()).ep_size == 1
    assert "expert group wait" not in capsys.readouterr().out
    assert main(EP_ARGS + ["--scheduler", "pow2", "--ep-size", "8", "--etp-size", "1"]) == 2  # 2 HDP ranks
    assert ("scheduler 'pow2' cannot plan for --expert-tensor-parallel-size 1 x --expert-model-parallel-size 8 "
            "(expert groups of 2 HDP ranks)") in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--etp-size", "3"], "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 = 3 and "
                          "--tensor-model-parallel-size 4 do not divide one another, which HDP plans cannot "
                          "keep in step"),
    (["--ep-size", "8", "--etp-size", "2", "--hdp-size", "6"],
     "an expert group of --expert-tensor-parallel-size 2 x --expert-model-parallel-size 8 GPUs (4 HDP ranks "
     "of TP 4) must divide --hdp-size (6)"),
    (["--model", "llama-7b", "--etp-size", "2"], "--expert-tensor-parallel-size 2 needs a mixture-of-experts"),
])
def test_cli_bad_expert_tensor_parallel_sizes_are_refused_by_flag(argv, match, capsys):
    assert main(EP_ARGS + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


def test_cli_expert_tensor_parallel_size_of_a_cost_model_file(tmp_path, capsys):
    path = tmp_path / "cm.json"
    preset_cost_model("mistral-8x7b", expert_parallel_size=8, expert_tensor_parallel_size=2).save(path)
    base = ["--global-tokens", "200000", "--no-offload", "--quiet", "--cost-model", str(path),
            "--context-length", "65536"]
    out = tmp_path / "plan.json"
    assert main(base + ["--hdp-size", "8", "--json", str(out)]) == 0
    assert StepPlan.from_json(out.read_text()).ep_size == 4  # the file's lockstep, not its E 8
    capsys.readouterr()
    assert main(base + ["--hdp-size", "8", "--etp-size", "2"]) == 2
    assert "--expert-tensor-parallel-size 2 applies to a --model preset" in capsys.readouterr().err


def test_cli_vpp_size_plans_for_the_virtual_stages(tmp_path):
    """--vpp-size V reaches make_plan: the written plan holds V and is balance's pick for it."""
    out = tmp_path / "plan.json"
    assert main(["--synthetic", "byted", "--global-tokens", "1000000", "--hdp-size", "16", "--pp-size", "4",
                 "--vpp-size", "2", "--quiet", "--validate", "--json", str(out)]) == 0
    plan = StepPlan.from_json(out.read_text())
    assert plan.virtual_pipeline_size == 2 and plan.meta["interleaved_timed"] >= 1
    plan.validate()
