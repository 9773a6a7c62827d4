"""ByteScaleConfig and its --bytescale-* flags (no processes, no megatron model)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_bytescale.integration.config import (
    ByteScaleConfig,
    add_bytescale_args,
    field_docstrings,
    given_flags,
)

EXPECTED_FLAGS = {
    "--bytescale-hdp",
    "--no-bytescale-hdp",
    "--bytescale-capacity",
    "--bytescale-scheduler",
    "--bytescale-offload",
    "--no-bytescale-offload",
    "--bytescale-host-memory-gb",
    "--bytescale-plan-mode",
    "--bytescale-align",
    "--bytescale-context-length",
    "--bytescale-overlong",
    "--bytescale-attention-backend",
    "--bytescale-dkv-wire-dtype",
    "--bytescale-plan-prefetch",
    "--bytescale-cost-model",
    "--bytescale-ranks-per-node",
    "--bytescale-two-level-ring",
    "--no-bytescale-two-level-ring",
    "--bytescale-seq-split",
    "--no-bytescale-seq-split",
    "--bytescale-check-plan-hash",
    "--no-bytescale-check-plan-hash",
    "--bytescale-dataloader",
    "--bytescale-ray-address",
    "--bytescale-ray-readers",
    "--bytescale-ray-lookahead",
}


def _parser() -> argparse.ArgumentParser:
    return add_bytescale_args(argparse.ArgumentParser())


def test_flag_set_is_pinned():
    flags = {
        option
        for action in _parser()._actions
        for option in action.option_strings
        if "bytescale" in option
    }
    assert flags == EXPECTED_FLAGS


def test_every_field_has_a_docstring_that_becomes_help():
    docs = field_docstrings()
    names = [f.name for f in dataclasses.fields(ByteScaleConfig)]
    assert sorted(docs) == sorted(names)
    helps = {
        a.dest: a.help
        for a in _parser()._actions
        if a.dest.startswith("bytescale_") and not a.option_strings[0].startswith("--no-")
    }
    for name in names:
        assert docs[name] and docs[name] in helps[f"bytescale_{name}"]


def test_defaults_round_trip_through_argparse():
    args = _parser().parse_args([])
    assert ByteScaleConfig.from_args(args) == ByteScaleConfig()


def test_values_and_bool_pairs_parse():
    args = _parser().parse_args(
        [
            "--bytescale-hdp",
            "--bytescale-capacity",
            "512",
            "--bytescale-scheduler",
            "naive",
            "--no-bytescale-offload",
            "--bytescale-plan-mode",
            "rank0_broadcast",
            "--bytescale-align",
            "8",
            "--no-bytescale-check-plan-hash",
        ]
    )
    config = ByteScaleConfig.from_args(args)
    assert config.hdp and not config.offload and not config.check_plan_hash
    assert (config.capacity, config.scheduler, config.plan_mode, config.align) == (
        512,
        "naive",
        "rank0_broadcast",
        8,
    )


def test_capacity_and_context_default_from_megatron_seq_length():
    args = _parser().parse_args([])
    args.seq_length = 8192
    config = ByteScaleConfig.from_args(args)
    assert config.capacity == 8192 and config.context_length == 8192
    args.bytescale_capacity = 2048  # the per-rank share a static CP = 4 run had
    assert ByteScaleConfig.from_args(args).capacity == 2048


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--bytescale-capacity", "0"], "--bytescale-capacity"),
        (["--bytescale-align", "0"], "--bytescale-align"),
        (["--bytescale-context-length", "-5"], "--bytescale-context-length"),
        (["--bytescale-capacity", "4", "--bytescale-align", "8"], "--bytescale-capacity"),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    args = _parser().parse_args(argv)
    with pytest.raises(ValueError, match=flag):
        ByteScaleConfig.from_args(args)


def test_bad_choice_in_dataclass_names_the_flag():
    with pytest.raises(ValueError, match="--bytescale-scheduler"):
        ByteScaleConfig(scheduler="fastest")  # type: ignore[arg-type]


def test_argparse_rejects_unknown_choice():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--bytescale-plan-mode", "sometimes"])


def test_host_memory_budget_flag():
    args = _parser().parse_args(["--bytescale-host-memory-gb", "96"])
    assert ByteScaleConfig.from_args(args).host_memory_gb == 96.0
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=r"--bytescale-host-memory-gb \(.*\) must be a positive"):
            ByteScaleConfig.from_args(_parser().parse_args(["--bytescale-host-memory-gb", bad]))


def test_the_host_memory_budget_reaches_the_planner():
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.planner.cost_model import CostModel

    cm = CostModel(num_layers=4, alpha1=2e-8, beta1=2e-5, gamma=1e-4, alpha2=1000.0,
                   d2h_bandwidth=1e10, h2d_bandwidth=1e10, kv_bytes_per_token=64.0,
                   p2p_bandwidth_intra=5e8, p2p_bandwidth_inter=5e8, ranks_per_node=4)
    rings = {}
    for budget in (None, 1e-6):  # 1 KB: no offload fits
        config = ByteScaleConfig(hdp=True, capacity=64, context_length=256, offload=True,
                                 scheduler="naive", host_memory_gb=budget)
        plan = make_step_planner(config, hdp_size=4, cost_model=cm)([150, 30, 20])
        rings[budget] = plan.ring_sizes()[0]
        assert plan.estimate.extra["host_memory_bytes"] == (None if budget is None else budget * 1e9)
    assert rings == {None: 2, 1e-6: 3}


def test_the_ray_loader_flags():
    args = _parser().parse_args(["--bytescale-dataloader", "ray", "--bytescale-ray-address",
                                 "auto", "--bytescale-ray-readers", "4",
                                 "--bytescale-ray-lookahead", "3"])
    options = ByteScaleConfig.from_args(args).ray_loader_options()
    assert (options.address, options.num_readers, options.lookahead) == ("auto", 4, 3)
    assert ByteScaleConfig.from_args(_parser().parse_args([])).dataloader == "local"
    with pytest.raises(ValueError, match="--bytescale-ray-readers \\(0\\) must be >= 1"):
        ByteScaleConfig(ray_readers=0)
    with pytest.raises(ValueError, match="rank0_broadcast does not apply to --bytescale-dataloader ray"):
        ByteScaleConfig(dataloader="ray", plan_mode="rank0_broadcast")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--bytescale-dataloader", "remote"])


def test_given_flags_lists_each_flag_on_the_command_line_once_in_order():
    """What the refusal without --bytescale-hdp names: every --bytescale-* flag given, once
    (a repeated flag too), in command-line order, whatever its value; the values parse as
    argparse's own store would (the last one wins, bool flags store their constant)."""
    parser = add_bytescale_args(argparse.ArgumentParser())
    args = parser.parse_args(["--bytescale-capacity", "64", "--bytescale-offload", "--bytescale-capacity",
                              "128", "--no-bytescale-check-plan-hash", "--bytescale-scheduler", "balance"])
    assert given_flags(args) == ["--bytescale-capacity", "--bytescale-offload",
                                 "--no-bytescale-check-plan-hash", "--bytescale-scheduler"]
    assert (args.bytescale_capacity, args.bytescale_offload, args.bytescale_check_plan_hash,
            args.bytescale_scheduler) == (128, True, False, "balance")
    defaults = parser.parse_args([])
    assert given_flags(defaults) == [] and given_flags(argparse.Namespace()) == []
    assert defaults.bytescale_offload is False and defaults.bytescale_check_plan_hash is True
