"""`bytescale simulate` end to end: table, JSON, plots, progress, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bytescale.tools.simulate_cmd import main

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_table_json_plots_end_to_end(tmp_path):
    out_json, plots = tmp_path / "sim.json", tmp_path / "plots"
    res = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.cli", "simulate", "--synthetic", "github",
         "--global-tokens", "4000000", "--hdp-size", "64", "--contexts", "64K,128K,256K", "--steps", "2",
         "--json", str(out_json), "--plot", str(plots)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("bytescale simulate: synthetic github (4,000,000 tokens per step, seed 0..1); "
                               "64 GPUs = 64 HDP ranks x TP 1 x PP 1")
    assert "ZeRO-1 over the HDP group" in lines[0]
    header = lines[1].split()
    assert header[:4] == ["context", "variant", "step", "(s)"] and "tokens/s/GPU" in header
    rows = [l.split() for l in lines[3:3 + 18]]
    assert [(r[0], r[1]) for r in rows[:6]] == [("64K", v) for v in
                                                ("static", "pow2", "naive", "naive+offload", "balance",
                                                 "balance+lookahead")]
    assert rows[0][4] == "1.00"  # throughput over the first variant, itself
    assert "throughput drop per context doubling: static" in res.stdout
    assert "[bytescale simulate] [36/36] context 256K, step 1, balance+lookahead" in res.stderr
    data = json.loads(out_json.read_text())
    assert data["num_gpus"] == 64 and len(data["results"]) == 18
    first = data["results"][0]
    assert first["variant"] == "static" and first["context_length"] == 65536 and first["steps"] == 2
    step = first["step_results"][0]
    assert len(step["rank_busy_s"]) == 64 and step["tokens"] == 4_000_000
    assert step["step_time_s"] == pytest.approx(
        step["data_wait_s"] + step["micro_batch_phase_s"] + step["grad_reduce_s"] + step["optimizer_s"])
    for name in ("throughput.png", "rank_times.png", "ablation.png"):
        assert (plots / name).read_bytes()[:8] == PNG


def test_cli_lengths_file_and_cost_model_file(tmp_path, capsys):
    from megatron_bytescale.planner.presets import preset_cost_model

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 5000, 40, 2048, 999, 7000, 12] * 5) + "\n")
    cm = tmp_path / "cm.json"
    preset_cost_model("llama-7b").with_(ranks_per_node=2).save(cm)
    assert main([str(lengths), "--cost-model", str(cm), "--hdp-size", "8", "--capacity", "4096",
                 "--variants", "static,balance", "--quiet", "--plan-time-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "gradient reduction and optimizer not modelled (pass --model-params)" in out
    assert "2 HDP ranks per node" in out
    rows = {l.split()[1]: l.split() for l in out.splitlines()[3:5]}
    assert set(rows) == {"static", "balance"}
    assert rows["balance"][7] == "0.5"  # the fixed planning time is waited for


@pytest.mark.parametrize("argv, match", [
    (["--variants", "static,magic"], r"unknown scheduler variant 'magic'; choose from static, pow2, naive, "
                                     r"naive\+offload, balance, balance\+lookahead"),
    (["--inter-node-bandwidth", "-5"], r"--inter-node-bandwidth \(-5\) must be a finite number > 0 GB/s"),
    (["--pcie-bandwidth", "0"], r"--pcie-bandwidth \(0\) must be a finite number > 0 GB/s"),
    (["--p2p-latency-us", "-1"], r"--p2p-latency-us \(-1\) must be a finite number >= 0 us"),
    (["--contexts", "256K,banana"], r"'banana' is not a token count"),
    (["--steps", "0"], r"argument --steps: 0 must be >= 1"),
    (["--load-s", "-2"], r"--load-s \(-2\) must be a finite number of seconds >= 0"),
    (["--model-params", "0"], r"--model-params \(0\) must be >= 1"),
    (["--context-length", "1000", "--contexts", "1K"], r"either --context-length or --contexts"),
    (["--hdp-size", "0"], r"argument --hdp-size: 0 must be >= 1"),
    (["--capacity", "16", "--context-length", "1000000", "--overlong", "error"], r"no variant could plan the batch: "),
    (["--model", "gpt-9"], r"unknown model preset 'gpt-9'"),
    (["--grad-reduce-bytes", "3"], r"argument --grad-reduce-bytes: invalid choice: 3"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, match, capsys):
    assert main(["--global-tokens", "100000", "--hdp-size", "16", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bytescale simulate: error: ")
    import re

    assert re.search(match, err[0]), err[0]


def test_cli_file_with_a_sweep_is_refused(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n200\n")
    assert main([str(lengths), "--contexts", "1K,2K", "--quiet"]) == 2
    assert "--contexts sweeps synthetic batches" in capsys.readouterr().err
    assert main([str(lengths), "--steps", "2", "--quiet"]) == 2
    assert "--steps > 1 needs --synthetic" in capsys.readouterr().err


def test_bytescale_lists_simulate():
    res = subprocess.run([sys.executable, "-m", "megatron_bytescale.cli", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "simulate" in res.stdout


def test_cli_hardware_preset_fitted_to_the_paper(capsys):
    """--hardware paper-fit (the default) plans with the fitted preset: same batch, the straggler
    wait on every ring that crosses nodes, so every variant's step is longer than on the datasheet
    preset."""
    argv = ["--hdp-size", "64", "--global-tokens", "2000000", "--context-length", "262144",
            "--variants", "static,balance", "--quiet"]
    steps = {}
    for hw in ("h100", "paper-fit"):
        assert main([*argv, "--hardware", hw]) == 0
        out = capsys.readouterr().out
        assert f"@{hw}" in out.splitlines()[0]
        steps[hw] = {l.split()[1]: float(l.split()[2]) for l in out.splitlines()[3:5]}
    assert set(steps["h100"]) == {"static", "balance"}
    assert all(steps["paper-fit"][v] > steps["h100"][v] for v in ("static", "balance"))
    assert main(argv) == 0
    assert "@paper-fit" in capsys.readouterr().out.splitlines()[0]


EP_ARGS = ["--global-tokens", "400000", "--hdp-size", "8", "--pp-size", "1", "--model", "mistral-8x7b",
           "--context-length", "65536", "--quiet"]


def test_cli_at_ep_plans_with_the_slot_rule_and_skips_naive_and_pow2(monkeypatch, capsys):
    """--expert-model-parallel-size E: static and balance are planned with ep_size E (what an EP
    run trains); naive, naive+offload and pow2 are skipped with a note, not priced."""
    from megatron_bytescale.sim import variants

    seen, real = [], variants.make_plan

    def spy(*args, **kwargs):
        seen.append((kwargs["scheduler"], kwargs["ep_size"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(variants, "make_plan", spy)
    assert main(EP_ARGS + ["--expert-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    rows = [l.split()[1] for l in out.splitlines()[3:] if l.startswith("64K")]
    assert rows == ["static", "balance", "balance+lookahead"]
    assert ("note: pow2, naive, naive+offload skipped: their schedulers do not guarantee every ring "
            "micro-batch the same local index on all its members, which --expert-model-parallel-size 2 "
            "needs") in out
    assert "note: with --expert-model-parallel-size 2 the members of an expert group wait" in out
    assert sorted(set(seen)) == [("balance", 2), ("static", 2)]
    seen.clear()
    assert main(EP_ARGS) == 0  # EP 1: every variant, no rule
    out = capsys.readouterr().out
    assert "skipped" not in out and "expert group wait" not in out
    assert sorted(set(seen)) == [("balance", 1), ("naive", 1), ("pow2", 1), ("static", 1)]


@pytest.mark.parametrize("argv, match", [
    (["--ep-size", "2", "--variants", "naive,pow2"],
     r"--variants naive,pow2: none of them plans for --expert-model-parallel-size 2 .*use balance, "
     r"balance\+lookahead or static"),
    (["--ep-size", "3"], r"--expert-model-parallel-size \(3\) must divide --hdp-size \(8\)"),
])
def test_cli_ep_bad_input_is_one_line_exit_2(argv, match, capsys):
    import re

    assert main(EP_ARGS + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bytescale simulate: error: ")
    assert re.search(match, err[0]), err[0]


def test_cli_expert_tensor_parallel_size_plans_the_expert_groups_hdp_ranks(monkeypatch, capsys):
    """--expert-tensor-parallel-size P with E: plans keep max(1, P E / TP) HDP ranks in step (TP 4
    here), the cost model and the expert weights' reduction follow P."""
    from megatron_bytescale.sim import variants

    seen, real = [], variants.make_plan

    def spy(*args, **kwargs):
        seen.append((kwargs["scheduler"], kwargs["ep_size"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(variants, "make_plan", spy)
    assert main(EP_ARGS + ["--ep-size", "8", "--etp-size", "2", "--variants", "static,balance,naive"]) == 0
    out = capsys.readouterr().out
    assert sorted(set(seen)) == [("balance", 4), ("static", 4)]
    assert "cost model mistral-8x7b-tp4-ep8-etp2@paper-fit" in out
    assert "(experts over the 8-way expert-parallel split's data-parallel groups, each expert over 2 GPUs)" in out
    assert ("naive skipped: their schedulers do not guarantee every ring micro-batch the same local index on "
            "all its members, which --expert-tensor-parallel-size 2 x --expert-model-parallel-size 8 "
            "(expert groups of 4 HDP ranks) needs") in out
    seen.clear()
    assert main(EP_ARGS + ["--ep-size", "2", "--etp-size", "1", "--variants", "static,naive"]) == 0  # in a TP group
    assert sorted(set(seen)) == [("naive", 1), ("static", 1)]
    assert main(EP_ARGS + ["--etp-size", "3"]) == 2
    assert "--expert-tensor-parallel-size 3 x --expert-model-parallel-size 1 = 3" in capsys.readouterr().err


def test_cli_overheads_split_each_expert_over_the_expert_tensor_parallel_size():
    from megatron_bytescale.planner.presets import model_spec
    from megatron_bytescale.sim.overheads import parameter_count
    from megatron_bytescale.tools.simulate_cmd import _overheads, build_parser

    spec = model_spec("mistral-8x7b")
    counts = parameter_count(spec)
    experts = counts["experts_per_layer"] * spec.num_layers
    args = build_parser().parse_args(EP_ARGS + ["--ep-size", "8", "--etp-size", "2"])
    o, _ = _overheads(args, tp=4, pp=1)
    assert o.expert_params_per_rank == pytest.approx(experts / 8 / 2)  # 1 of 8 experts, half of it
    assert o.params_per_rank == pytest.approx((counts["total"] - experts) / 4 + experts / 8 / 2)
    assert (o.tensor_parallel_size, o.expert_tensor_parallel_size, o.expert_data_parallel_size(8)) == (4, 2, 2)
    same, _ = _overheads(build_parser().parse_args(EP_ARGS + ["--ep-size", "8", "--etp-size", "4"]), tp=4, pp=1)
    before, _ = _overheads(build_parser().parse_args(EP_ARGS + ["--ep-size", "8"]), tp=4, pp=1)
    assert same.params_per_rank == before.params_per_rank == (counts["total"] - experts + experts / 8) / 4
    assert same.expert_params_per_rank == before.expert_params_per_rank == experts / 8 / 4
