#!/usr/bin/env python
"""Mutation check of the core invariant modules; writes two sections of docs/testing.md.

A test suite is only as good as the bugs it catches. This script plants bugs and runs the tests
that should catch them, in a copy of the tree (the worktree is never modified):

1. ``planted``: the bugs audits once found the suite blind to (alignment ignored, order
   check dropped, balance widening to twice the lower bound, resume skipping samples instead of
   batches, bf16 ring accumulators; then one instance of each bug class of offload rows at
   fractional ratios, reload order, storages shared by views, sequence-parallel padding at
   TP > 2, two-level bytes with PP, lookahead with reduction and optimizer time, the host
   budget at alignments > 4), each planted by a textual edit, with the test files that
   must fail. Fast (~2-4 minutes): run it after changing the tests of those modules.
2. ``mutmut``: mutmut 3 (``pip install -e .[mutation]``) generates every mutant of the named
   functions of the core modules (zigzag split, ``StepPlan.validate``, execution order and
   deadlock check, the balance scheduler (DP- and PP-Balance), the online-softmax merge, the
   token-level loss and model-config guard, the resume offset of the data path, activation
   offload by storage, the refusal of ByteScale flags without the switch) and runs, for
   each, the tests that execute that function (in-process tests only: mutmut cannot see calls
   made inside spawned ranks, so every target here has an in-process test). Survivors must be
   killed by a test or listed in :data:`EQUIVALENT` with the reason they cannot be told apart;
   the script exits 1 if one is neither. ~12 minutes with 2 workers on 2 idle cores (the whole check ~14).

Neither part is in ``bash scripts/test.sh``.

Usage::

    .venv/bin/python scripts/mutation_check.py                 # both parts, writes docs/testing.md
    .venv/bin/python scripts/mutation_check.py --part planted  # only the planted bugs
    .venv/bin/python scripts/mutation_check.py --part mutmut --targets zigzag,online_softmax
    .venv/bin/python scripts/mutation_check.py --no-write --keep   # print; keep the work folder
    # a target that runs past --timeout (seconds, per target) gets a PARTIAL row with exact
    # counts; with --keep its folder can be continued later, running only the undecided mutants:
    .venv/bin/python scripts/mutation_check.py --part mutmut --targets offload --keep --timeout 1800
    .venv/bin/python scripts/mutation_check.py --part mutmut --targets offload --resume /tmp/mutmut-offload-XXXX

Each target's entry in docs/mutation_check.json records the CPU seconds per mutant of its run
(``seconds_per_mutant``: mutmut and its workers, what the run costs on an idle machine), with
the wall seconds per mutant and worker beside it.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTING_MD = ROOT / "docs" / "testing.md"
RESULTS = ROOT / "docs" / "mutation_check.json"
PKG = "megatron_bytescale"


def progress(msg: str) -> None:
    print(f"[mutation_check] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- planted bugs
@dataclass(frozen=True)
class Planted:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]
    """(file, exact original text, replacement); the text must occur exactly once."""
    tests: tuple[str, ...]


PLANTED = [
    Planted(
        "alignment ignored", "zigzag_chunk returns ceil(L / 2N) without rounding up to align",
        (("megatron_bytescale/planner/zigzag.py",
          "    return -(-per_part // align) * align", "    return per_part"),),
        ("tests/planner/test_planner_zigzag.py", "tests/runtime/test_runtime_layout.py",
         "tests/planner/test_planner_cost_model.py"),
    ),
    Planted(
        "order check dropped", "StepPlan.validate no longer checks that orders increase on a rank",
        (("megatron_bytescale/planner/plan.py",
          "            if last_order is not None and mb.order <= last_order:",
          "            if False:"),),
        ("tests/planner/test_planner_validate.py", "tests/integration/test_guards.py"),
    ),
    Planted(
        "balance regression", "balance widens long sequences only to twice the lower bound",
        (("megatron_bytescale/planner/schedulers/widen.py",
          "        target = work / n / pp_size", "        target = 2 * work / n / pp_size"),),
        ("tests/planner/test_planner_balance_scale.py",),
    ),
    Planted(
        "resume offset (train)", "resuming skips consumed_train_samples global batches, not steps",
        (("megatron_bytescale/integration/megatron_lm_data.py",
          'schedule.steps_done(getattr(args, "consumed_train_samples", 0) or 0)',
          '(getattr(args, "consumed_train_samples", 0) or 0)'),),
        ("tests/integration/test_resume_offset.py",
         "tests/integration/test_megatron_lm_hooks.py::test_resume_from_consumed_samples_continues_the_uninterrupted_run"),
    ),
    Planted(
        "resume offset (valid)", "resuming evaluation skips consumed_valid_samples global batches",
        (("megatron_bytescale/integration/megatron_lm_data.py",
          '(getattr(args, "consumed_valid_samples", 0) or 0) // eval_batch_size',
          '(getattr(args, "consumed_valid_samples", 0) or 0)'),),
        ("tests/integration/test_resume_offset.py",),
    ),
    Planted(
        "accumulator dtype", "the ring accumulates out and dq in the input dtype (bf16), not fp32",
        (("megatron_bytescale/runtime/ring_step.py",
          "    out = torch.zeros(q.shape, dtype=acc, device=q.device)",
          "    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)"),
         ("megatron_bytescale/runtime/ring_attention.py",
          "    dq = torch.zeros(q.shape, dtype=acc, device=q.device)",
          "    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)")),
        ("tests/runtime/test_runtime_numerics.py",),
    ),
    # bug classes the suite once missed (TP 2 only, ratios 0 / 0.25 / 0.5 / 1, PP 1 two-level
    # rings, lookahead without reduction or optimizer time, alignments <= 4): one instance each
    Planted(
        "offloaded rows rounded", "offload keeps round(r * rows) token rows, not the ceiling",
        (("megatron_bytescale/runtime/offload.py",
          "offloaded = min(rows, math.ceil(self.ratio * rows - 1e-9))",
          "offloaded = min(rows, round(self.ratio * rows))"),),
        ("tests/runtime/test_runtime_offload_classes.py",),
    ),
    Planted(
        "offloaded rows floored", "offload keeps int(r * rows) token rows, not the ceiling",
        (("megatron_bytescale/runtime/offload.py",
          "offloaded = min(rows, math.ceil(self.ratio * rows - 1e-9))",
          "offloaded = min(rows, int(self.ratio * rows))"),),
        ("tests/runtime/test_runtime_offload_classes.py",),
    ),
    Planted(
        "reload of the wrong layer", "a layer's backward starts its own reload, not the next layer's",
        (("megatron_bytescale/runtime/offload.py",
          "self.reload_layer(layer - 1, prefetch=True)", "self.reload_layer(layer, prefetch=True)"),),
        ("tests/runtime/test_runtime_offload_classes.py",),
    ),
    Planted(
        "views offloaded twice", "offload forgets the storages it copied (each view copied again)",
        (("megatron_bytescale/runtime/offload.py",
          "        record = self._records.get(ptr)\n", "        record = None\n"),),
        ("tests/runtime/test_runtime_offload_storage.py",),
    ),
    Planted(
        "SP rows padded to even", "sequence-parallel rows padded by n % tp (a multiple of 2 only)",
        (("megatron_bytescale/integration/schedule.py",
          "    return -(-num_tokens // tp) * tp", "    return num_tokens + num_tokens % tp"),),
        ("tests/integration/test_sequence_parallel_rows.py",),
    ),
    Planted(
        "offload rows padded to 2", "the offloader's row count is padded to a multiple of 2, not of TP",
        (("megatron_bytescale/runtime/offload.py",
          "rows = -(-int(micro_batch.tokens.numel()) // sp) * sp",
          "rows = -(-int(micro_batch.tokens.numel()) // 2) * 2"),),
        ("tests/integration/test_sequence_parallel_rows.py",),
    ),
    Planted(
        "two-level bytes of one stage", "two-level ring bytes count one pipeline stage's layers",
        (("megatron_bytescale/planner/estimate.py",
          "groups[two], layers=all_layers)", "groups[two], layers=plan.layers_per_stage)"),),
        ("tests/planner/test_two_level_bytes_pp.py",),
    ),
    Planted(
        "host budget without align", "Eq. 3's host bytes use the zigzag share without alignment",
        (("megatron_bytescale/planner/offload.py",
          "    share = max_zigzag_share(length, ring_size, align)\n    return float(offload_ratio)",
          "    share = max_zigzag_share(length, ring_size)\n    return float(offload_ratio)"),),
        ("tests/planner/test_planner_host_budget_align.py",),
    ),
    Planted(
        "share align capped at 4", "the vectorised zigzag share pads parts to min(align, 4)",
        (("megatron_bytescale/planner/offload.py",
          "    chunk = -(-chunk // align) * align\n",
          "    chunk = -(-chunk // min(align, 4)) * min(align, 4)\n"),),
        ("tests/planner/test_planner_host_budget_align.py",),
    ),
    Planted(
        "lookahead behind the phase", "lookahead hides planning behind the micro-batches only",
        (("megatron_bytescale/sim/step.py",
          "data_wait_s(plan_s, phase + reduce_s + optimizer_s, lookahead=lookahead)",
          "data_wait_s(plan_s, phase, lookahead=lookahead)"),),
        ("tests/sim/test_sim_lookahead_overheads.py",),
    ),
    Planted(
        "lookahead hides everything", "with lookahead the data and plan never wait",
        (("megatron_bytescale/sim/overheads.py",
          "return max(0.0, wait - busy_step_s) if lookahead else wait",
          "return 0.0 if lookahead else wait"),),
        ("tests/sim/test_sim_lookahead_overheads.py",),
    ),
]


def copy_tree(dest: Path) -> None:
    """The tracked (and new, not ignored) files of the package, tests and pytest.ini."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", PKG, "tests", "pytest.ini"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    for rel in listed:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_planted(python: str, timeout_s: int) -> tuple[str, bool]:
    rows, all_caught = [], True
    for bug in PLANTED:
        with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
            work = Path(tmp)
            copy_tree(work)
            missing = []
            for rel, old, new in bug.edits:
                path = work / rel
                text = path.read_text(encoding="utf-8")
                if text.count(old) != 1:
                    missing.append(rel)
                    continue
                path.write_text(text.replace(old, new), encoding="utf-8")
            if missing:
                rows.append([bug.name, bug.what, "could not plant: the code moved (" + ", ".join(missing) + ")", "-"])
                all_caught = False
                continue
            progress(f"planted: {bug.name} ...")
            start = time.perf_counter()
            done = subprocess.run(
                [python, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *bug.tests],
                cwd=work, capture_output=True, text=True, timeout=timeout_s,
                # Megatron-LM subprocesses import the planted copy, not the installed package
                env=dict(os.environ, PYTHONWARNINGS="ignore", MEGATRON_LM_PYTHONPATH=str(work)),
            )
            failed = sorted({line.split()[1].split("[")[0] for line in done.stdout.splitlines()
                             if line.startswith("FAILED ")})
            caught = done.returncode == 1 and bool(failed)
            all_caught &= caught
            shown = "<br>".join(f"`{t}`" for t in failed[:6]) + (f"<br>... {len(failed) - 6} more" if len(failed) > 6 else "")
            rows.append([bug.name, bug.what, shown if caught else f"NOT CAUGHT (pytest exit {done.returncode})",
                         f"{time.perf_counter() - start:.0f} s"])
    body = (
        "### Planted bugs\n\n"
        "Each bug planted alone into a copy of the tree; the tests listed are those of the named "
        "files that failed (`scripts/mutation_check.py --part planted`). "
        + machine_line() + "\n\n"
        + markdown_table(["bug", "what was planted", "failing tests", "time"], rows) + "\n"
    )
    return body, all_caught


# ----------------------------------------------------------------------------- mutmut
@dataclass(frozen=True)
class Target:
    key: str
    label: str
    file: str
    functions: tuple[str, ...]
    """mutmut's names of the functions to mutate, as globs: ``x_<function>`` for a function,
    ``xǁ<Class>ǁ<method>`` for a method."""
    tests: tuple[str, ...]
    """The in-process tests mutmut may run; per mutant it runs those that execute the function
    (mutmut cannot see calls made inside spawned ranks)."""
    lines: str | None = None
    """Only mutants of original lines matching this regex (a function's other lines are plumbing)."""


PLANNER_TESTS = ("tests/planner/test_planner_zigzag.py", "tests/planner/test_planner_zigzag_splits.py",
                 "tests/planner/test_planner_validate.py")
OFFLOAD_TESTS = ("tests/runtime/test_runtime_offload.py", "tests/runtime/test_runtime_offload_storage.py",
                 "tests/runtime/test_runtime_offload_classes.py", "tests/runtime/test_runtime_offload_edges.py",
                 "tests/runtime/test_offload_storage_units.py",
                 "tests/integration/test_sequence_parallel_rows.py")
_PLACEMENT = "tests/planner/test_topology_placement.py::"
PLACEMENT_TESTS = tuple(_PLACEMENT + t for t in (
    "test_compact_choices_by_hand", "test_compact_on_an_explicit_node_map",
    "test_every_ring_sits_on_its_fewest_nodes", "test_fill_candidates_follow_the_nodes",
    "test_free_ranks_by_hand", "test_fewest_nodes_when_no_compact_choice_exists",
    "test_placement_follows_an_explicit_node_map"))
TARGETS = [
    Target("zigzag", "planner/zigzag.py", "megatron_bytescale/planner/zigzag.py", ("*",),
           PLANNER_TESTS + ("tests/runtime/test_runtime_layout.py",)),
    Target("validate", "planner/plan.py (validate)", "megatron_bytescale/planner/plan.py",
           ("x__validate", "x__check_piece_order", "x_resident_tokens"),
           PLANNER_TESTS + ("tests/planner/test_planner_order_estimate.py",)),
    Target("order", "planner/order.py (order, deadlock check)", "megatron_bytescale/planner/order.py",
           ("x_pipeline_ops", "x_rank_orders", "x__barrier_segments", "x_simulate", "x_check_deadlock_free"),
           ("tests/planner/test_planner_order_by_hand.py", "tests/planner/test_planner_order_estimate.py",
            "tests/integration/test_guards.py", "tests/planner/test_wavefront.py",
            "tests/planner/test_planner_fast_paths.py::test_pipeline_simulation_matches_the_general_graph")),
    Target("balance", "planner/schedulers/balance.py (candidates, DP-Balance choice)",
           "megatron_bytescale/planner/schedulers/balance.py",
           ("x_plan_balance", "x__plan_balance", "x__units_floor", "x__best_dp_assignment", "x__best_pp_plan"),
           ("tests/planner/test_planner_balance_units.py", "tests/planner/test_planner_selective_offload.py",
            "tests/planner/test_planner_balance_scale.py::test_balance_is_within_ten_percent_of_the_lower_bounds",
            "tests/planner/test_planner_schedulers.py", "tests/planner/test_planner_pp_balance.py",
            "tests/planner/test_two_level_cost.py", "tests/planner/test_balance_candidate_choice.py",
            "tests/planner/test_ep_slots.py", "tests/planner/test_candidate_time.py")),
    Target("widen", "planner/schedulers/widen.py (widening)",
           "megatron_bytescale/planner/schedulers/widen.py",
           ("x_widen_for_balance", "x__smallest_ring_under", "x__ring_grid"),
           ("tests/planner/test_planner_balance_units.py",
            "tests/planner/test_planner_balance_scale.py::test_balance_is_within_ten_percent_of_the_lower_bounds",
            "tests/planner/test_planner_schedulers.py")),
    # DP-Balance and its ring placement (_place_ring: the topology rule) since balance.py was split
    Target("dp_balance", "planner/schedulers/dp_balance.py (DP-Balance, topology rule)",
           "megatron_bytescale/planner/schedulers/dp_balance.py",
           ("x_makespan", "x_dp_balance", "x__place_ring", "xǁ_Holesǁ*"),
           ("tests/planner/test_planner_balance_units.py",
            "tests/planner/test_planner_balance_scale.py::test_balance_is_within_ten_percent_of_the_lower_bounds",
            "tests/planner/test_planner_schedulers.py", "tests/planner/test_topology_placement.py",
            "tests/planner/test_two_level_cost.py")),
    Target("pp_balance", "planner/schedulers/pp_balance.py (PP-Balance)",
           "megatron_bytescale/planner/schedulers/pp_balance.py",
           ("x_pp_balance", "x__place_rings_aligned", "x__place_runs", "x_short_first"),
           ("tests/planner/test_planner_pp_balance.py", "tests/planner/test_pp_next_levels_first.py",
            "tests/planner/test_planner_balance_units.py",
            "tests/planner/test_planner_balance_scale.py::test_pipeline_balance_is_within_ten_percent_of_the_lower_bounds",
            "tests/planner/test_planner_schedulers.py", "tests/planner/test_pp_short_first.py",
            "tests/planner/test_pp_isolate.py")),
    Target("pp_rings", "planner/schedulers/pp_balance.py (a ring's count group: nodes counted once, "
           "choices kept per unchanged group, members moved per group)",
           "megatron_bytescale/planner/schedulers/pp_balance.py", ("x__place_rings_aligned",),
           ("tests/planner/test_planner_pp_balance.py", "tests/planner/test_pp_next_levels_first.py",
            "tests/planner/test_planner_balance_units.py", "tests/planner/test_planner_schedulers.py",
            "tests/planner/test_pp_isolate.py", "tests/planner/test_topology_placement.py"),
           lines=r"fewest = topo\.min_nodes|extra = len\(|front = |if not front|score = \(extra|known|searched|"
                 r"changed\[c\]|del ranked|moved|up = |len\(up\)|up \+= |up\.sort|insort\(up"),
    Target("wavefront", "planner/wavefront.py (the 1F1B estimate in wavefronts)",
           "megatron_bytescale/planner/wavefront.py", ("*",),
           ("tests/planner/test_wavefront.py", "tests/planner/test_candidate_time.py",
            "tests/planner/test_planner_order_estimate.py", "tests/planner/test_pipeline_floor.py")),
    Target("pp_orders", "planner/schedulers/pp_balance.py (window load, reorderings)",
           "megatron_bytescale/planner/schedulers/pp_balance.py",
           ("xǁPipelineLoadǁ*", "x_next_levels_first", "x_local_indices", "x_singles_first", "x_unit_times"),
           ("tests/planner/test_pp_singles_first.py", "tests/planner/test_pp_next_levels_first.py",
            "tests/planner/test_planner_pp_balance.py", "tests/planner/test_pp_short_first.py")),
    Target("pp_floors", "planner/schedulers/pp_floors.py (a candidate's floors: order-free, run alone)",
           "megatron_bytescale/planner/schedulers/pp_floors.py", ("*",),
           ("tests/planner/test_planner_pp_balance.py", "tests/planner/test_wavefront.py",
            "tests/planner/test_balance_candidate_choice.py", "tests/planner/test_pp_isolate.py")),
    Target("pp_isolate", "planner/schedulers/pp_isolate.py (rings of their own, the layer-cap walk)",
           "megatron_bytescale/planner/schedulers/pp_isolate.py", ("*",),
           ("tests/planner/test_pp_isolate.py",)),
    Target("pp_vpp", "planner/schedulers/pp_vpp.py (the pick for interleaved stages)",
           "megatron_bytescale/planner/schedulers/pp_vpp.py", ("*",),
           ("tests/planner/test_balance_vpp.py",)),
    Target("wavefront_interleaved", "planner/wavefront_interleaved.py (the interleaved schedule in wavefronts)",
           "megatron_bytescale/planner/wavefront_interleaved.py", ("*",),
           ("tests/planner/test_wavefront_interleaved.py", "tests/planner/test_balance_vpp.py",
            "tests/planner/test_pipeline_floor.py")),
    Target("balance_vpp", "planner/schedulers/balance.py (interleaved stages: 1F1B ranking with slack, finalists)",
           "megatron_bytescale/planner/schedulers/balance.py", ("x__best_pp_plan",),
           ("tests/planner/test_balance_vpp.py", "tests/planner/test_balance_candidate_choice.py",
            "tests/planner/test_planner_pp_balance.py"),
           lines=r"vpp|slack|finalists|final = |fastest_interleaved|\* stop"),
    Target("pp_layer", "planner/schedulers/pp_balance.py (the layer before isolated rings)",
           "megatron_bytescale/planner/schedulers/pp_balance.py", ("x__place_isolated",),
           ("tests/planner/test_pp_isolate.py", "tests/planner/test_planner_pp_balance.py")),
    Target("floors", "planner/pipeline_floor.py (the proved PP lower bounds)",
           "megatron_bytescale/planner/pipeline_floor.py", ("x_idle_floor", "x_assignment_floor"),
           tuple("tests/planner/test_planner_balance_scale.py::" + t for t in (
               "test_the_pipeline_floor_is_a_bound_every_order_keeps_and_meets_where_it_can",
               "test_the_pipeline_floor_by_hand_on_lists_longer_than_its_window",
               "test_the_pipeline_floor_refuses_bad_input",
               "test_no_plan_beats_the_assignment_floor_and_its_two_levels_see_past_pigeonhole",
               "test_the_assignment_floor_by_hand", "test_the_assignment_floor_refuses_bad_input"))
           + ("tests/planner/test_pp_next_levels_first.py",)),
    Target("candidate_time", "planner/schedulers/candidate_time.py (PP candidates timed without a plan)",
           "megatron_bytescale/planner/schedulers/candidate_time.py", ("*",),
           ("tests/planner/test_candidate_time.py", "tests/planner/test_balance_candidate_choice.py",
            "tests/planner/test_balance_vpp.py")),
    Target("selective", "planner/schedulers/selective.py (selective offload)",
           "megatron_bytescale/planner/schedulers/selective.py", ("x_unit_options",),
           ("tests/planner/test_planner_selective_offload.py", "tests/planner/test_planner_schedulers.py")),
    Target("ring_sizes", "planner/offload.py (offload-free ring sizes, vectorised)",
           "megatron_bytescale/planner/offload.py", ("x_ring_sizes_without_offload",),
           ("tests/planner/test_planner_fast_paths.py", "tests/planner/test_planner_offload_sharding.py")),
    Target("packing", "planner/sharding.py (best-fit packing)",
           "megatron_bytescale/planner/sharding.py", ("x_best_fit_packs",),
           ("tests/planner/test_planner_fast_paths.py", "tests/planner/test_planner_offload_sharding.py")),
    Target("long_units", "planner/sharding.py (the long units of a batch: sizes, ratios, minimums)",
           "megatron_bytescale/planner/sharding.py", ("x_shard_batch",),
           ("tests/planner/test_planner_fast_paths.py", "tests/planner/test_planner_offload_sharding.py",
            "tests/planner/test_planner_selective_offload.py"),
           lines=r"long_lengths|ring_sizes_without_offload|layers=ctx\.layers, align=ctx\.align\)|decisions = |"
                 r"in_flight=ctx\.in_flight, without_offload=d0|zip\(long_lengths|make\(|d = dec\.ring_size|"
                 r"best_fit_packs|len\(short_ids\)|short_lengths = ids_a"),
    Target("online_softmax", "runtime/online_softmax.py", "megatron_bytescale/runtime/online_softmax.py",
           ("*",), ("tests/runtime/test_runtime_online_softmax.py",)),
    Target("loss", "integration/schedule.py (token-level loss, config guard)",
           "megatron_bytescale/integration/schedule.py", ("x_token_level_loss", "x_check_model_config"),
           ("tests/integration/test_token_loss.py", "tests/integration/test_guards.py")),
    Target("resume_schedule", "integration/batch_schedule.py (resume offset)",
           "megatron_bytescale/integration/batch_schedule.py",
           ("xǁGlobalBatchScheduleǁ_extend", "xǁGlobalBatchScheduleǁsamples",
            "xǁGlobalBatchScheduleǁconsumed_before", "xǁGlobalBatchScheduleǁsteps_done"),
           ("tests/integration/test_resume_offset.py", "tests/integration/test_megatron_lm_data_semantics.py")),
    Target("resume_data", "integration/megatron_lm_data.py (resume offset)",
           "megatron_bytescale/integration/megatron_lm_data.py",
           ("x_build_hdp_data_iterators", "x_budget_batches"),
           ("tests/integration/test_resume_offset.py", "tests/integration/test_batch_seek.py",
            "tests/integration/test_megatron_lm_hooks.py::test_budget_batches_resume_and_shuffle"),
           lines=r"skips = .*|consumed_\w+.*|skip_batches=skips\[split_index\]|skip_batches: int = 0"
                 r"|if step >= skip_batches|step = 0|step \+= 1"),
    Target("offload", "runtime/offload.py (which rows, which storages, reload order)",
           "megatron_bytescale/runtime/offload.py",
           ("xǁMicroBatchOffloadǁ_saved", "xǁMicroBatchOffloadǁ_host_bytes",
            "xǁMicroBatchOffloadǁ_must_stay_resident", "xǁMicroBatchOffloadǁ_eligible",
            "xǁMicroBatchOffloadǁ_unpack", "xǁMicroBatchOffloadǁreload_layer",
            "x_offload_micro_batch"),
           OFFLOAD_TESTS),
    Target("offload_storage", "runtime/offload_storage.py (one copy per storage, views rebuilt)",
           "megatron_bytescale/runtime/offload_storage.py", ("*",), OFFLOAD_TESTS),
    Target("flags_parser", "integration/config.py (which --bytescale-* flags were given)",
           "megatron_bytescale/integration/config.py", ("xǁ_RecordedStoreǁ__call__", "x_given_flags"),
           ("tests/integration/test_megatron_lm_hooks.py::test_bytescale_flags_without_the_switch_are_refused_naming_them",
            "tests/integration/test_megatron_lm_hooks.py::test_chained_provider_parses_ours_after_another",
            "tests/integration/test_config.py")),
    # the modules the verification fixes changed, each with the smallest fast in-process tests
    # that execute it (no spawned ranks, no Megatron-LM subprocess: about a second per mutant)
    Target("static", "planner/schedulers/static.py (first fit)",
           "megatron_bytescale/planner/schedulers/static.py",
           ("x_first_fit_bins", "xǁ_FreeSpaceǁ*"), ("tests/planner/test_static_first_fit.py",)),
    Target("placement", "planner/schedulers/placement.py (topology rule)",
           "megatron_bytescale/planner/schedulers/placement.py", ("*",),
           PLACEMENT_TESTS + ("tests/planner/test_planner_balance_units.py", "tests/planner/test_ring_placer.py")),
    Target("inputs", "planner/inputs.py (bounded reads, strict numbers)",
           "megatron_bytescale/planner/inputs.py", ("*",),
           ("tests/planner/test_input_readers.py", "tests/planner/test_bad_inputs.py")),
    Target("results_io", "tools/results_io.py (results survive a failed write)",
           "megatron_bytescale/tools/results_io.py", ("*",),
           ("tests/planner/test_results_survive_a_failed_write.py",)),
    Target("plan_json", "planner/plan.py (StepPlan field types)",
           "megatron_bytescale/planner/plan.py",
           ("xǁStepPlanǁfrom_dict", "x__as_int", "x__as_number", "x__as_seconds", "x__checked_meta",
            "x__as_list", "x__micro_batch_from_dict"),
           ("tests/planner/test_bad_inputs.py", "tests/planner/test_planner_validate.py",
            "tests/planner/test_plan_chunks.py", "tests/planner/test_planner_expert_parallel.py",
            "tests/planner/test_plan_json_fields.py")),
    Target("lengths", "data/lengths.py (strict lengths, bounded reads)",
           "megatron_bytescale/data/lengths.py", ("*",),
           ("tests/planner/test_bad_inputs.py", "tests/planner/test_input_readers.py",
            "tests/planner/test_planner_data.py", "tests/planner/test_lengths_reader_limits.py")),
    Target("flags", "integration/megatron_lm.py (flags without --bytescale-hdp refused)",
           "megatron_bytescale/integration/megatron_lm.py", ("x_flags_without_hdp", "x_check_args"),
           ("tests/integration/test_megatron_lm_hooks.py::test_bytescale_flags_without_the_switch_are_refused_naming_them",
            "tests/integration/test_megatron_lm_hooks.py::test_without_the_flag_the_hooks_are_megatron",
            "tests/integration/test_megatron_lm_hooks.py::test_refusals_name_the_flag",
            "tests/integration/test_megatron_lm_hooks.py::test_only_rank_0_reports_a_refusal_and_every_rank_exits",
            "tests/integration/test_megatron_lm_hooks.py::test_arguments_without_any_bytescale_flag_are_left_to_megatron")),
]

# Surviving mutants that no test can kill, with the reason. Keyed by (mutant-name glob, a regex
# the mutation "original  ->  mutated" must match), so renumbering after unrelated edits keeps them.
_SPEED = ("speed only: the stop at the best step so far, the cache of stage times and the "
          "skip of families whose order-free floor is already slower never change which "
          "candidate wins or its floats (tests/planner/test_balance_candidate_choice.py::"
          "test_skipping_by_the_floors_never_changes_the_plan, test_candidate_time.py); without "
          "them planning only takes longer")
TOLERANCE = ("a float tolerance (1e-9 or 1e-12 relative): the outcome differs only when two times "
             "agree to that many digits")
EQUIVALENT: list[tuple[str, str, str]] = [
    # planner/schedulers/pp_vpp.py: the pick for interleaved stages
    ("*pp_vpp.x_fastest_interleaved__*", r"key=lambda f: f\[0\]\)  ->  .*(key=None\)|, \))$",
     "the keys (1F1B step, candidate index) are unique, so the tuples sort by them anyway and "
     "never compare what follows"),
    ("*pp_vpp.x_fastest_interleaved__*", r"finish_times\(request, placements, cost_model, seconds, stop_above=stop, vpp=vpp\).*  ->  .*cost_model, (None, )?stop_above=stop, vpp=vpp\)",
     "speed only: the cache of stage times holds the floats a fresh costing gives "
     "(candidate_time.finish_times, tested in test_candidate_time.py)"),
    ("*pp_vpp.x_fastest_interleaved__*", r"emit_plan\(timing, placements, scheduler=scheduler, meta=meta\).*  ->  .*meta=None\)",
     "only the estimate of the timing plan is kept, and a candidate's meta (assignment, offload "
     "choice, counts) does not enter it; the winner is emitted again with its meta"),
    ("*pp_vpp.x_fastest_interleaved__*", r"if best is None or \(step, rank\) < best\[:2\]:  ->  .*(<= best\[:2\]|< best\[:3\]):",
     "ranks are unique, so two (step, rank) pairs never tie and the comparison with the third "
     "item never reaches it"),
    # planner/wavefront_interleaved.py
    ("*wavefront_interleaved.x_simulate_interleaved*", r'kind="stable"\).*  ->  .*kind="STABLE"\)',
     "numpy reads the sort kind case-insensitively"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"^counts = np\.bincount\(pipeline, minlength=n\)  ->  counts = np\.bincount\(pipeline, \)$",
     "without minlength the counts stop at the last pipeline with a slot; the ones after it have "
     "none, so they run no op and finish at 0 either way (stage_end has all n rows)"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"^t = np\.asarray\(t, dtype=np\.float64\) / vpp  ->  t = np\.asarray\(t, (dtype=None)?\) / vpp$",
     "both callers pass float64 stage times; numpy keeps them float64 without a dtype"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"(np\.fromiter|np\.full)\(.*(dtype=np\.int64|count=).*  ->  .*(dtype=None|, \))",
     "count only sizes fromiter's buffer; the ids, counts and positions are Python ints, which "
     "numpy holds as int64 without a dtype"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"^hi = np\.full\(len\((units|t)\), -1, dtype=np\.int64\)  ->  hi = np\.full\(len\((units|t)\), -2, dtype=np\.int64\)$",
     "every unit is in some list, so its largest position (>= 0) replaces any negative start"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"^slot = np\.full\(\(n, m\), -1, dtype=np\.int64\)  ->  slot = np\.full\(\(n, m\), [-+][12], dtype=np\.int64\)$",
     "the pad is never read: a slot is read only for a pipeline whose count passes its index"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"^if stop_above is not None and key % STOP_EVERY == 0 and key:  ->  if stop_above is not None and key % STOP_EVERY (!= 0|== 1) and key:$",
     "speed only: the bound (a stage's finish so far plus the work it has left) holds after any "
     "key, so checking it at other keys changes only how soon a run that cannot win stops"),
    ("*wavefront_interleaved.x_simulate_interleaved*", r"^per = 2 \* vpp \* pp  ->  per = 3 \* vpp \* pp$",
     "a micro-batch's block of node slots only has to hold its 2 vpp pp ops: a wider block "
     "leaves slots unused and every node apart"),
    # planner/schedulers/balance.py: interleaved stages
    ("*balance.x__best_pp_plan__*", r"^slack = INTERLEAVED_SLACK if vpp > 1 else 1e-9.*  ->  slack = INTERLEAVED_SLACK if \(vpp > 1\) or True else 1e-9",
     "speed only with one virtual stage: a wider slack lets more candidates past their floors, "
     "each slower than the best (a floor bounds its step), so the same one wins"),
    ("*balance.x__best_pp_plan__*", r"^stop = 1\.0 \+ INTERLEAVED_SLACK if vpp > 1 else 1\.0.*  ->  stop = 1\.0 \+ INTERLEAVED_SLACK if \(vpp > 1\) or True else 1\.0",
     "speed only with one virtual stage: a timing then gives up at a higher bar, and a candidate "
     "it stops is slower than the best either way, so the same one wins"),
    ("*balance.x__best_pp_plan__*", r"None if best is None else best\[0\] \* stop\) if quick else None  ->  (finish = None|None\) if quick else None|\) if quick else None)$",
     "speed only: without a stop a candidate is timed in full, and without the quick timing it is "
     "built and estimated, the same floats (tests/planner/test_candidate_time.py); a stop only "
     "turns one that cannot win, nor be a finalist with virtual stages, into inf"),
    # planner/plan.py
    ("*plan.x__check_piece_order__*", r"last = -1  ->  last = -2",
     "positions in seqs are >= 0: any negative start lets the first piece pass"),
    ("*plan.x__validate__*", r"plan\.capacity \+ 1e-9", TOLERANCE),
    ("*plan.x__validate__*", r"what = \"overlap\" if start < pos else",
     "inside `if start != pos`, start == pos cannot happen"),
    ("*plan.x_resident_tokens__*", r"if l <= 2 or .*  ->  if l < 2 or",
     "at l = 2 Eq. 3 keeps n * (2 + (1 - r) * 0) / 2 = n, what the early return gives"),
    ("*plan.x_resident_tokens__*", r"offload_ratio <= 0.0:  ->  .*offload_ratio < 0.0:",
     "at r = 0 Eq. 3 keeps n * (2 + (l - 2)) / l = n, what the early return gives"),
    # planner/offload.py and planner/sharding.py: offload-free ring sizes and packs in numpy
    ("*offload.x_ring_sizes_without_offload__*", r"asarray\(lengths, dtype=np\.int64\)  ->  .*asarray\(lengths, (dtype=None)?\)",
     "a list of Python ints becomes an int64 array with or without the dtype"),
    ("*offload.x_ring_sizes_without_offload__*", r"last = np\.maximum|d >= last|short & \(d",
     "speed only: this test only decides when to run the scalar search, which raises for a length "
     "no ring holds and returns for the others; the vector search then goes on as before"),
    ("*offload.x_ring_sizes_without_offload__*", r"> capacity \+ _EPS.*  ->  .*>= capacity \+ _EPS",
     "shares and capacities are integers: > C + 1e-9 and >= C + 1e-9 agree"),
    ("*sharding.x_best_fit_packs__*", r"asarray\((ids|lengths), dtype=np\.int64\)  ->  .*asarray\((ids|lengths), (dtype=None)?\)",
     "a list of Python ints becomes an int64 array with or without the dtype"),
    ("*sharding.x_best_fit_packs__*", r"shift = max\(1, len\(ids\)\)\.bit_length\(\)  ->  .*max\(2,",
     "one more low bit than the bin indices need: keys compare in the same order"),
    ("*sharding.x_shard_batch__*", r"without_offload=d0\)  ->  .*(without_offload=None|in_flight=ctx\.in_flight, ?)\)",
     "without the offload-free size handed in, solve_offload computes the same one"),
    # planner/order.py
    ("*order.x__barrier_segments__*", r'side="left"', "numpy's searchsorted defaults to side='left'"),
    ("*order.x_simulate__*", r'get\("barrier_after_orders", \[\]\) or \[\]',
     "`.get(key, [])`, `.get(key, None)` and `.get(key)` all become [] after `or []`"),
    ("*order.x_simulate__*", r"defaultdict\(int\)  ->  .*defaultdict\(None\)",
     "every node's in-degree is stored (setdefault) before an edge adds to it"),
    ("*order.x_simulate__*", r"indeg\.setdefault\(.*  ->  .*indeg\.setdefault\(",
     "indeg is a defaultdict(int): a node without an entry reads 0, what setdefault stores; the "
     "stray key (None, 0 or a misspelt barrier) is never a node of the graph"),
    ("*order.x_simulate__*", r'elif phase == \"B\":',
     "at the last stage 1F1B runs B(i) right after F(i) in the stage's own op list, which "
     "already orders them"),
    ("*order.x_simulate__*", r"if end > ready_at\[v\]:  ->  if end >= ready_at\[v\]:",
     "assigning an equal value changes nothing"),
    ("*order.x_simulate__*", r"_deadlock_message\(plan, .*  ->  .*_deadlock_message\(None,",
     "_deadlock_message does not read its plan argument"),
    # planner/wavefront.py: the same floats whatever these choose (test_wavefront.py compares every
    # finish with the graph walk on 2,000 random plans, with the Python tail never and always taken)
    ("*wavefront.x_*", r"np\.fromiter\(.*  ->  .*np\.fromiter\(.*(dtype=None|, \))",
     "count only sizes fromiter's buffer; without a dtype it reads float64, which holds these "
     "integers exactly (a dict finds 3.0 under 3, numpy indexes with the int results of unique)"),
    ("*wavefront.x_*", r"np\.asarray\((pipeline|index|t|times), dtype=(np\.int64|float)\).*  ->  .*np\.asarray\(\1, (dtype=None)?\)",
     "every caller passes int64 pipelines and indices and float times: asarray keeps them"),
    ("*wavefront.x_*", r"np\.full\(\(n, depth\), (m|pad), dtype=np\.int64\).*  ->  .*np\.full\(\(n, depth\), \1, (dtype=None)?\)",
     "np.full takes int64 from its integer fill value"),
    ("*wavefront.x_simulate_wavefront_flat__*", r"first = np\.zeros\(m, dtype=np\.int64\)  ->  first = np\.zeros\(m, (dtype=None)?\)",
     "first only holds list positions to compare with local: float64 holds them exactly"),
    ("*wavefront.x_*", r'kind="stable"\).*  ->  .*kind="STABLE"\)',
     "numpy reads sort kinds case-insensitively"),
    ("*wavefront.x__run__*", r'by_count = np\.argsort\(-counts, kind="stable"\)  ->  by_count = np\.argsort\(-counts, (kind=None)?\)',
     "any order of the pipelines gives the same times: a ring's start is a maximum over its members "
     "wherever they sit, and the output is put back by by_count"),
    ("*wavefront.x__run__*", r'side="left"\)  ->  .*-np\.arange\(depth\), \)', "searchsorted's default side is 'left'"),
    ("*wavefront.x_*", r"depth = int\(counts\.max\(\)\) if n else 0  ->  depth = int\(counts\.max\(\)\) if n else 1",
     "with no pipelines every table is empty whatever depth says: the result is an empty array"),
    ("*wavefront.x_*", r"np\.append\(np\.asarray\((t|times), dtype=float\)(\[by_pipeline\])?, 0\.0\).*  ->  .*np\.asarray\(\1, dtype=float\)(\[by_pipeline\])?, 1\.0\)",
     "the pad's weight is never added: a pad slot never runs (live is false there)"),
    ("*wavefront.x_simulate_wavefront_flat__*", r"np\.append\(holders > 1, False\).*  ->  .*np\.append\(holders (>= 1, False|> 1, True)\)",
     "a micro-batch taken as a ring of one member starts at the maximum over itself, the same start; "
     "the pad's flag is masked by live"),
    ("*wavefront.x_simulate_wavefront_flat__*", r"holders = np\.bincount\(index, minlength=m\)  ->  holders = np\.bincount\(index, \)",
     "every micro-batch has a slot (each caller lists it on at least one pipeline), so the count "
     "already has m entries"),
    ("*wavefront.x__run__*", r"reach = np\.searchsorted\(-counts\[by_count\], -np\.arange\(depth\), side=\"left\"\)  ->  .*\+np\.arange",
     "reach only bounds the pipelines a key touches: a larger one adds pipelines past their end, "
     "whose pad slots never run"),
    ("*wavefront.x__run__*", r"(ring_grid\[by_count\]\.T\) & live_grid|ring_t\[ik, :m\] & live)  ->  .*\|",
     "a single-rank slot taken as a ring starts at the maximum over itself, the same start; a pad "
     "never runs"),
    ("*wavefront.x__run__*", r"forward = \(keys - stages\) % 2 == 0  ->  forward = \(keys \+ stages\) % 2 == 0",
     "k + s and k - s have the same parity"),
    ("*wavefront.x__run__*", r"\(keys - 2 \* pp \+ 1 \+ stages\) // 2\)  ->  .*\(keys - 2 \* pp \+ 2 \+ stages\) // 2\)",
     "where a B runs, k - 2pp + 1 + s is even: one more floors to the same index"),
    ("*wavefront.x__run__*", r"later_width|later_lowest|ring_free|python_from|tail_key",
     "these only choose the key from which the rest runs in Python floats (the same maxima and "
     "sums as the loop, exact once no ring is left, which later_lowest >= ring_free keeps true); a "
     "later start, no Python tail, or more pipelines handed to it only cost time"),
    ("*wavefront.x__run__*", r"buf = np\.zeros\(\(pad \+ 1\) \* pp\).*  ->  buf = np\.zeros\(\(pad \+ 2\) \* pp\)",
     "a larger scratch buffer"),
    ("*wavefront.x__run__*", r"slot = g\[ik, :m\]\[rings\] \* pp \+ stage_col.*  ->  .*\* pp - stage_col",
     "o * pp - s is as one-to-one on (order, stage < pp) as o * pp + s; a negative slot wraps to the "
     "pad order's entries, which no ring uses"),
    ("*wavefront.x__tail__*", r"f = \(a if a >= b else b\).*  ->  f = \(a if a > b else b\)",
     "the larger of two equal values"),
    # planner/schedulers/candidate_time.py
    ("*candidate_time.x_finish_times__*", r"(np\.fromiter\(.*|np\.array\(times, )(dtype=|count=).*  ->  .*(dtype=None|, \))",
     "count only sizes fromiter's buffer; ring members, counts and times read without a dtype are "
     "int64 and float64 anyway"),
    ("*candidate_time.x_finish_times__*", r"costs = costs_of\(seen, \{\},.*  ->  costs = costs_of\(seen, None,",
     "costs_of only hands the holders on to its result, of which finish_times reads the seconds"),
    ("*order.x_simulate__*", r"if pp > 1 and not barriers( and not record)?:  ->  if pp > 2 and not barriers",
     "at PP 2 the next walk runs instead, with the same floats: the wavefront, the pipeline graph "
     "and the general graph are compared op for op (test_wavefront.py, "
     "test_pipeline_simulation_matches_the_general_graph)"),
    ("*order.x_simulate__*", r"(finish = simulate_wavefront|fast = _simulate_pipelines)\(.*  ->  (finish|fast) = None$",
     "the next walk runs instead, with the same floats (see the entry on `pp > 2`)"),
    ("*dp_balance.x_makespan__*", r"return out\[1\] if \(out is not None\) or True else",
     "makespan_below with no limit (inf) never returns None: no rank's finish reaches inf"),
    # planner/schedulers/placement.py (RingPlacer)
    ("*placement.xǁRingPlacerǁ__init____*", r"self\._monotone = bool\(np\.all\(np\.diff\(nodes\) >= 0\)\)  ->  ",
     "_monotone only lets the walks over a sorted rank list stop early (equal loads run by rank, "
     "so by node when nodes grow with the rank); every mutant makes it False (np.all(None) is "
     "False), and the walks then go on to the same choice"),
    ("*placement.xǁRingPlacerǁ_masked__*", r"np\.sort\(m, axis=1\).*  ->  .*np\.sort\(m, \)",
     "np.sort sorts along the last axis by default, axis 1 of this 2-D array"),
    *[(f"*placement.xǁRingPlacerǁ{method}__*", r"self\._view\(eligible\) if \(view is None\) or True else view",
       "the sorted view is a function of the loads and the eligible mask: built again, it is the "
       "view the caller passed") for method in ("_compact_sorted", "on_nodes")],
    ("*placement.xǁRingPlacerǁon_nodes__*", r"held = np\.zeros\(len\(cand\), dtype=np\.int64\)  ->  held = np\.zeros\(len\(cand\), (dtype=None)?\)",
     "held counts ranks: float64 holds the counts exactly and compares with d the same way"),
    ("*placement.xǁRingPlacerǁfewest_nodes__*", r"(view = None if d <= self\.width and eligible is None|self\.compact\(d, eligible\) if view is None else|self\.on_nodes\(d, .*eligible, view=view\))",
     "the sorted view is a function of the loads and the eligible mask, and eligible is only read "
     "to build it: passing the view or building it again, with or without the mask once the view "
     "is given, gives the same choice, and compact's in-node path is tested equal to the sorted "
     "view's (test_compact_and_on_nodes_match_the_reference_on_tied_loads)"),
    ("*placement.xǁRingPlacerǁfewest_nodes_ranked__*", r"if d > self\.width and choice\[0\] > earliest:  ->  if d >= self\.width",
     "at d = width the search on min_nodes(d) = 1 node finds no start earlier than the compact "
     "choice, which is already the best single node"),
    ("*placement.xǁRingPlacerǁ_first_node_ranked__*", r"k < best\[1\]\):  ->  .*k <= best\[1\]\):",
     "a row reaches d listed ranks once, so k never equals the best row"),
    ("*placement.xǁRingPlacerǁ_on_nodes_ranked__*", r"at_least = \[0\] \* \(self\.width \+ 1\)  ->  at_least = \[0\] \* \(self\.width \+ 2\)",
     "a longer table of counts: a node holds at most width ranks"),
    ("*placement.xǁRingPlacerǁ_on_nodes_ranked__*", r"if len\(chosen\) >= d:  ->  if len\(chosen\) > d:",
     "once d ranks are chosen every later node adds taken[k][:0], nothing"),
    ("*balance.x_plan_balance__*", r"estimate=False\)\).*  ->  .*estimate=None\)\)",
     "None is as false as False"),
    ("*balance.x__best_pp_plan__*", r"seconds: dict = \{\}.*  ->  seconds: dict = None",
     "the stage-time cache only saves costing a placement again: finish_times makes its own when "
     "given none, with the same floats (test_stage_times_kept_for_the_placements_of_another_candidate)"),
    ("*balance.x__best_pp_plan__*", r"candidate_finish_times\(request, placements, ctx\.cost_model, seconds\) if quick else None  ->  .*candidate_finish_times\(request, placements, ctx\.cost_model, (None)?\) if quick",
     "the stage-time cache only saves costing a placement again: finish_times makes its own when "
     "given none, with the same floats (test_stage_times_kept_for_the_placements_of_another_candidate)"),
    ("*pp_balance.x__place_rings_aligned__*", r"(\(x if x > 0\.0 else 0\.0\)|if x > 0\.0:).*  ->  .*(x if x >= 0\.0|if x >= 0\.0:)",
     "at x = 0 (a micro-batch exactly as long as the pipeline's longest) both branches add 0 and "
     "keep the longest at the same value"),
    # runtime/online_softmax.py
    ("*online_softmax.x_merge_partial_attention__*", r"block_lse\.to\(lse\.dtype\)  ->  .*\.to\(None\)",
     "tensor.to(None) is a no-op and type promotion computes in the accumulator's dtype anyway "
     "(block results are never more precise than the accumulator)"),
    # planner/schedulers/widen.py and dp_balance.py
    ("*widen.x_widen_for_balance__*", r"\(1 [+-] 1e-9\)", TOLERANCE),
    ("*dp_balance.xǁ_Holesǁadd__*", r"1e-12", TOLERANCE),
    ("*widen.x_widen_for_balance__*", r"changed = |if not changed",
     "a second pass never changes a unit (targets only grow as units widen, and a widened unit "
     "already meets its target or its 2 % aim), so how many passes run cannot change the plan"),
    ("*balance.x_dp_balance__*", r"if n else|if \(n\)", "n >= 1 always (make_plan refuses hdp_size < 1)"),
    ("*dp_balance.x_makespan__*", r"if n else", "n >= 1 always (make_plan refuses hdp_size < 1)"),
    ("*static.xǁ_FreeSpaceǁfirst_fit__*", r"return -1  ->  return -2",
     "the only caller tests `leaf < 0`: any negative marker means no bin has room"),
    ("*megatron_lm.x_check_args__*", r'"bytescale_hdp", False\):  ->  .*"bytescale_hdp", None\):',
     "None is as false as False"),
    ("*dp_balance.x__place_ring__*", r"fewest_nodes\(d, earliest=start\)  ->  .*fewest_nodes\(d, \)",
     "earliest only lets a compact ring that starts at the load-only start skip the search on "
     "more nodes; no ring starts before that start, so the search cannot return an earlier one"),
    ("*balance.x__plan_balance__*", r"if widened else \(\)\)  ->  .*if \(widened\) or True else",
     "speed only: with nothing widened the two lists hold the same units, so the second floor "
     "equals the first (the set's floor is unchanged), and _best_pp_plan reads the pair only for a "
     "widened set"),
    ("*dp_balance.x__place_ring__*", r"if d <= placer\.width:  ->  if d < placer\.width:",
     "a ring exactly as wide as the largest node then goes the general way, where fewest_nodes "
     "returns the same compact choice (one node, or the node where its d-th load is least)"),
    ("*widen.x__ring_grid__*", r"dtype=np.int64", "np.array of Python ints is int64 already"),
    ("*widen.x__ring_grid__*", r"x = max\(x \* 1\.1, x \+ 1\)|while x < hi",
     "grid resolution: the bisection after the grid search finds the same smallest ring, and a "
     "grid that stops one step later or earlier still contains both ends"),
    ("*widen.x_widen_for_balance__*", r"^single = \[k for k in todo if len\(units\[k\]\.lengths\) == 1\]  ->  single = \[k for k in todo if len\(units\[k\]\.lengths\) (!= 1|== 2)\]$",
     "a unit holding a sequence of at least C holds only that sequence (sharding packs only shorter "
     "ones), so every unit a pass looks at holds one; timed alone or with the others it gets the "
     "same floats (test_many_one_sequence_units_timed_at_once_as_each_alone)"),
    ("*widen.x_widen_for_balance__*", r"^times = timed\[k\] if k in timed else ctx\.time_on_rings\(u\.lengths, grids\[k\]\)  ->  times = timed\[k\] if k in timed else ",
     "only a unit of several sequences takes this branch, and no pass looks at one (see the entry "
     "on single)"),
    ("*widen.x_widen_for_balance__*", r"^times = timed\[k\] if k in timed else ctx\.time_on_rings\(u\.lengths, grids\[k\]\)  ->  times = timed\[k\] if (\(k in timed\) and False|\(k in timed\) or True|k not in timed) else ",
     "every unit a pass looks at holds one sequence and is in timed, and its times from the batched "
     "call equal those of its own call: either branch gives the same floats"),
    ("*widen.x__smallest_ring_under__*", r"times\[: best \+ 1\]",
     "times[best] always meets the aim (aim >= 1.02 x times[best]), so the first index that "
     "meets it is at most best whatever the slice end or the comparison"),
    ("*widen.x__smallest_ring_under__*", r"lo, hi = int\(grid\[k - 1\]\)",
     "lo is only a lower end for the bisection: any ring size below the answer finds the same one"),
    ("*widen.x__smallest_ring_under__*", r"\[0\] <= aim:  ->  .*\[0\] < aim:",
     "a ring time equal to the aim to the last bit"),
    ("*widen.x__smallest_ring_under__*", r"return ctx\.resize\(u, hi\) if hi != u\.ring_size else u",
     "resize returns the unit unchanged for its own ring size"),
    ("*balance.x__best_dp_assignment__*", r"default=0\.0\)  ->  .*default=1\.0\)",
     "with no units the LPT makespan is 0, which either default lets return early"),
    ("*balance.x__best_dp_assignment__*", r"if candidates\[0\]\[2\] <= floor:  ->  if candidates\[0\]\[2\] < floor:",
     "the other candidates run Eq. 3's units, whose longest takes `floor`: they cannot beat an "
     "LPT makespan equal to it, and min keeps the first of equal candidates (only planning "
     "time changes)"),
    ("*widen.x_widen_for_balance__*", r"if n <= 1 or not units:  ->  if n (<= 1 and|< 1 or) not units:",
     "with one rank no unit is slower than the lower bound (the sum of all units), so the loop "
     "changes nothing"),
    # integration/schedule.py
    ("*schedule.x_check_model_config__*", r'"pipeline_model_parallel_size", 1\) or 1\)  ->  .*"pipeline_model_parallel_size", None\) or 1\)',
     "a missing field reads None instead of 1, and `or 1` makes both 1"),
    # integration/megatron_lm_data.py
    ("*megatron_lm_data.x_build_hdp_data_iterators__*", r'"consumed_(train|valid)_samples", 0\) or 0\).*  ->  .*"consumed_\1_samples", None\) or 0\)',
     "a missing counter reads None instead of 0, and `or 0` makes both 0"),
    ("*megatron_lm_data.x_build_hdp_data_iterators__*", r"or 0\) // int\(args\.global_batch_size\), 0\)  ->  .*or 0\) / int\(",
     "Megatron adds one --global-batch-size per evaluation iteration (training.py: "
     "`consumed_valid_samples += eval_batch_size`, `eval_batch_size = args.global_batch_size`), so "
     "the count divides exactly and `/` gives the same whole number of batches as `//`"),
    # integration/batch_schedule.py
    ("*batch_schedule.xǁGlobalBatchScheduleǁ_extend__*", r"while len\(self\._sizes\) < steps:  ->  .*<= steps:",
     "computes one step more than asked: every size depends only on the samples consumed before it"),
    ("*batch_schedule.xǁGlobalBatchScheduleǁsamples__*", r"self\._extend\(step \+ 1\)  ->  self\._extend\(step \+ 2\)",
     "computes one step more than asked: every size depends only on the samples consumed before it"),
    ("*batch_schedule.xǁGlobalBatchScheduleǁ_extend__*", r"consistency_check=False\)  ->  .*consistency_check=None\)",
     "None is as false as False"),
    ("*balance.x_plan_balance__*", r"estimate_plan\(plan, cm, request\.topology\)\)  ->  .*estimate_plan\(plan, cm, (None)?\)\)",
     "each plan records its topology in meta['topology'], which estimate_plan reads when it is "
     "given none"),
    ("*balance.x__place_rings_aligned__*", r"if best is None or score < best\[0\]:  ->  .*score <= best\[0\]:",
     "a score is (load, count group) and every group is scored once: two scores are never equal"),
    ("*balance.x__place_rings_aligned__*", r"np\.zeros\(n, dtype=bool\)  ->  .*np\.zeros\(n, (dtype=None)?\)",
     "the mask is only read by np.where and np.append(..., False), which treat a float 0/1 array "
     "as the boolean one"),
    # planner/inputs.py
    ("*inputs.x__bracket_depth__*", r'bare\.encode\("utf-8", errors="replace"\).*  ->  .*bare\.encode\((errors="replace"|"UTF-8", errors="replace")\)',
     "str.encode defaults to UTF-8, and 'UTF-8' names the same codec"),
    ("*inputs.x__bracket_depth__*", r"\.astype\(np\.int64\) \+ \(codes == ord\(\"\{\"\)\)  ->  .*\.astype\(None\)",
     "float64 counts are exact far beyond any file's length (2**53), so the depth is the same"),
    ("*inputs.x_json_depth__*", r"""if '"' in text else text  ->  .*(if \('"' in text\) or True|'XX""XX')""",
     "replacing strings in a text without quotes changes nothing; any placeholder without a "
     "bracket or a digit measures the same depth and finds the same numbers (JSON puts ':', ',', "
     "']' or '}' after a string, never a digit)"),
    ("*inputs.x_loads_json__*", r"""if '"' in text else text  ->  .*(if \('"' in text\) or True|'XX""XX')""",
     "replacing strings in a text without quotes changes nothing; any placeholder without a "
     "bracket or a digit measures the same depth and finds the same numbers (JSON puts ':', ',', "
     "']' or '}' after a string, never a digit)"),
    ("*inputs.x_loads_json__*", r'count\("\{"\) > MAX_JSON_DEPTH:.*  ->  .*count\("\{"\) >= MAX_JSON_DEPTH:',
     "a pre-check: with exactly MAX_JSON_DEPTH brackets the depth is at most that, so measuring "
     "it refuses nothing more"),
    ("*inputs.x_read_text_file__*", r"handle\.read\(max_bytes \+ 1\)  ->  .*handle\.read\(max_bytes \+ 2\)",
     "one byte more read: a file over the limit is refused all the same"),
    ("*inputs.x_read_text_file__*", r'raw\.decode\("utf-8"\)  ->  .*raw\.decode\("UTF-8"\)', "the same codec"),
    # tools/results_io.py
    ("*results_io.x_write_atomically__*",
     r'encoding="utf-8"\) as stream:  ->  with os\.fdopen\(handle, "w", (encoding=("UTF-8"|None))? ?\)',
     "'UTF-8' names the same codec; without an encoding Python uses the locale's, which is UTF-8 "
     "in every locale Python starts in by default (a C/POSIX locale is coerced to UTF-8, PEP 538 "
     "and 540), and the JSON written is ASCII (json.dumps escapes the rest)"),
    ("*results_io.x_save_or_print__*", r"file=sys\.stderr, flush=True\)  ->  .*file=sys\.stderr, (flush=(None|False))? ?\)",
     "sys.stderr is line-buffered (always, since Python 3.9) and the message ends its line, so "
     "it is written at once with or without flush"),
    # planner/schedulers/static.py (first fit's segment tree)
    ("*static.xǁ_FreeSpaceǁ*", r"\[-1\] \* \((2|4) \* size\)  ->  .*\[(\+1|-2)\] \*",
     "-1 marks a bin not yet opened in both lists: a leaf is entered only if its free tokens and "
     "its free slots both suffice, and the other list still holds -1 there (any negative mark "
     "also never suffices: every document needs >= 1 token and slot)"),
    ("*static.xǁ_FreeSpaceǁ*", r"\[-1\] \* \((2|4) \* size\)  ->  .*\[-1\] \* \((3|5) \* size\)",
     "a longer list: the entries past the tree are never read"),
    ("*static.xǁ_FreeSpaceǁ_grow__*", r"range\(2 \* size - 1, 0, -1\):  ->  .*range\(2 \* size - (2, 0|1, 1), -1\)",
     "the node skipped (2 size - 1, over new leaves only, or the root) is recomputed by the set() "
     "that follows every grow: the new bin's leaf changes from -1, so every node on its path to "
     "the root changes and is rewritten"),
    ("*static.xǁ_FreeSpaceǁ_update__*", r"if (\w+)\[left\] > \1\[right\] else .*  ->  .*\[left\] >= ",
     "on a tie both children hold the same maximum"),
    ("*static.xǁ_FreeSpaceǁ_update__*", r"if tokens\[i\] == t and slots\[i\] == s:  ->  if tokens\[i\] != t and|break  ->  return",
     "an update stopped early leaves maxima too high (take() only lowers a leaf; set() changes "
     "slots from -1 as well, so it never stops early), and first_fit is exact with maxima too "
     "high: where no child fits it moves on to the right; only the work changes. `return` ends "
     "the method as `break` does"),
    ("*static.xǁ_FreeSpaceǁfirst_fit__*", r"i = 1  ->  i = 2",
     "starting at the root's left child visits the same leaves: where it finds no fit the search "
     "moves to its sibling (the right child) and ends at the root"),
    ("*static.x_first_fit_bins__*", r"if n < context and need_slots < capacity:",
     "a bin full when it opens given a leaf anyway is never entered (it has no token or no slot "
     "left): the same bins, only more work"),
    # planner/schedulers/placement.py (RingPlacer)
    ("*placement.xǁRingPlacerǁ__init____*", r"self\.n = hdp_size  ->  self\.n = None",
     "nothing reads RingPlacer.n (the package, its scripts and tests read loads, width and the "
     "choices only)"),
    ("*placement.xǁRingPlacerǁ__init____*", r"if len\(counts\) else 1  ->  .*(or True else 1|else 2)$",
     "the else branch is taken only for no nodes at all, i.e. hdp_size 0, which make_plan "
     "refuses (hdp_size >= 1): counts always has an entry"),
    ("*placement.xǁRingPlacerǁ__init____*", r"dtype=np\.int64\)  ->  idx = np\.full\(.*(dtype=None\)|hdp_size, \))",
     "np.full with a Python int fill value (hdp_size) makes an int64 array already"),
    ("*placement.xǁRingPlacerǁ__init____*", r"reshape\(-1\)\.tolist\(\)  ->  .*reshape\((None|-2)\)",
     "np.unique's inverse of the 1-D node array is 1-D already, and numpy (2.x) reads reshape(None) "
     "and reshape(-2) as the same one-dimensional shape: the same list"),
    ("*placement.xǁRingPlacerǁ__init____*", r"np\.zeros\(hdp_size \+ 1\)  ->  .*np\.zeros\(hdp_size \+ 2\)",
     "the extra slot is never read: loads is the first hdp_size slots and the padding of short "
     "nodes points at slot hdp_size (the +inf sentinel)"),
    ("*placement.xǁRingPlacerǁ*", r'np\.argsort\(m, axis=1, kind="stable"\).*  ->  .*np\.argsort\(m, kind="stable"\)',
     "argsort's default axis is -1, which is axis 1 of the 2-D node-by-rank matrix"),
    ("*placement.xǁRingPlacerǁ*", r'kind="stable"\).*  ->  .*kind="STABLE"\)',
     "numpy reads the sort kind case-insensitively: 'STABLE' is the stable sort"),
    ("*placement.xǁRingPlacerǁ_masked__*", r"take_along_axis\(m, order, axis=1\).*  ->  .*take_along_axis\(m, order, \)",
     "take_along_axis's default axis is -1 (numpy 2.x), which is axis 1 of the 2-D matrix"),
    ("*placement.xǁRingPlacerǁ_masked__*", r"np\.append\(eligible, False\)\[self\._idx\]  ->  .*np\.append\(eligible, (None|True)\)",
     "the appended entry is read only at the padding of short nodes, whose load slot is the +inf "
     "sentinel: marked eligible (True) it still reads +inf, and None (an object array) is false to "
     "np.where, as False is"),
    ("*placement.xǁRingPlacerǁ_sorted_view__*", r"count=len\(self\._dirty\)\)  ->  .*dtype=np\.int64, \)",
     "count only lets np.fromiter allocate once; without it the same rows are read"),
    ("*placement.xǁRingPlacerǁcompact__*", r"if d <= g:  ->  if d < g:",
     "at d == g the whole-node branch (whole = 1, rest = 0) picks the same node: the full-width "
     "node whose last rank frees first, ties to the lower node (a stable argsort's first is "
     "argmin's), since short nodes and nodes with an ineligible rank read +inf in both; it takes "
     "all g ranks of it, which _result orders node by node as before"),
    ("*placement.xǁRingPlacerǁfewest_nodes__*", r"choice\[0\] > earliest:  ->  .*choice\[0\] >= earliest:",
     "`earliest` is a start no choice can beat (both callers pass the d-th smallest eligible "
     "load), so when the compact choice meets it the search cannot find a strictly earlier one "
     "and the compact choice is kept: only the work changes"),
    ("*placement.xǁRingPlacerǁfewest_nodes__*", r"if d > self\.width and choice\[0\] > earliest:  ->  if d (>= self\.width and|> self\.width or) choice",
     "for d <= width the compact choice is already the earliest start on one node (the least "
     "d-th smallest load over the nodes), so on_nodes(d, 1) is never strictly earlier; for "
     "d > width with the compact start at `earliest` (a lower bound) nothing is strictly earlier "
     "either: the compact choice is kept, only the work changes"),
    ("*placement.xǁRingPlacerǁfewest_nodes__*", r"if not len\(reach\) or reach\[-1\] < d:  ->  if not len\(reach\) and",
     "reach always has an entry (hdp_size >= 1), and with fewer than d eligible ranks on_nodes "
     "returns None as well (no candidate start has d eligible ranks free)"),
    ("*placement.xǁRingPlacerǁon_nodes__*", r"top = counts if k_nodes >= len\(counts\) else .*  ->  top = counts if (\(k_nodes >= len\(counts\)\) and False|k_nodes > len\(counts\)) else",
     "k_nodes <= len(counts) always (a min with len(srt)); at equality np.partition(counts, 0)"
     "[-len:] is every count, whose sum is the same"),
    ("*placement.xǁRingPlacerǁon_nodes__*", r"if total >= d:  ->  if total > d:",
     "once total == d every later node takes min(count, 0) = 0 ranks: only empty slices are "
     "appended, the ring is the same"),
    ("*balance.xǁ_Holesǁtake__*", r"\(duration, -math\.inf, -1\)",
     "the rank element never decides (-inf already sorts before every start); +inf only "
     "differs for a hole exactly as long as the unit, to the last bit"),
    # runtime/offload.py
    ("*offload.xǁMicroBatchOffloadǁ_saved__*",
     r"if layer is not None and layer > record\.layer:.*  ->  if layer is not None (or layer > record\.layer|and layer >= record\.layer)",
     "layers run in increasing order within a forward and layer None never reaches this branch "
     "(it must stay resident), so a later view's layer is never below the record's: the change "
     "only re-appends the record to the list of the layer it is in, and reload_layer reloads a "
     "record once (needs_reload)"),
    ("*offload.xǁMicroBatchOffloadǁ_must_stay_resident__*", r"if self\.ratio <= 0\.0 .*  ->  if self\.ratio < 0\.0 ",
     "at r = 0 nothing goes either way: ceil(0 * rows - 1e-9) = 0 rows and the running fraction "
     "of whole tensors is never below 0, so no record is made (a negative r is refused)"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*", r"if self\._offloaded_whole < .*  ->  if self\._offloaded_whole <= ", TOLERANCE),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*", r"if new == 0:  ->  if new == 1:",
     "after every decision the whole-tensor bytes moved are at least r of those seen (a tensor "
     "goes only while they are below, adding n >= r n; it stays only when they are not), so a "
     "view adding no bytes (new == 0) is never moved: the early return only skips the comparison"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*", r"return hi - lo  ->  return hi \+ lo",
     "cover() holds at most the view's span on the host (min(hi, lo + host_bytes)): asking for "
     "more than hi - lo moves the same bytes"),
    ("*offload.xǁMicroBatchOffloadǁ_unpack__*", r"self\._backward_layers\.add\(layer\)  ->  self\._backward_layers\.add\(None\)",
     "reload_layer pops the layer's list, so calling it again for the same layer finds nothing "
     "(saves only happen in forward): only the first call per layer starts reloads"),
    # planner/schedulers/balance.py: the choice among candidates (skips by a floor, ties)
    ("*.balance.x_*", r"floor > best\[0\] \* \(1 \+ 1e-9\):  ->  .*floor (>= best\[0\] \* \(1 \+ 1e-9\)|> best\[0\] \* \((2 \+ 1e-9|1 \+ 1\.000000001)\)):",
     "skips less (or also at equality, where the candidate cannot win: its step is at least its floor "
     "and ties go to the earlier one): the same winner with more estimates; "
     "test_balance_candidate_choice.py plans every case with and without skipping"),
    ("*.balance.x_*", r"floor > best\[0\] \* \(1 \+ 1e-9\):  ->  .*floor > best\[0\] (/ \(1 \+ 1e-9\)|\* \(1 - 1e-9\)):",
     TOLERANCE),
    ("*.balance.x__best_pp_plan__*", r"^continue  ->  break$",
     "both loops run in floor order (options sorted by their floor, candidates by theirs): once a "
     "floor is above the best step every later one is too"),
    ("*.balance.x__plan_balance__*", r"^continue  ->  break$",
     "the unit sets run in floor order: once a floor is above the best step every later one is too"),
    ("*.balance.x__best_pp_plan__*", r"sorted\(ranked, key=lambda c: \(c\[0\], c\[1\]\)\):  ->  .*sorted\(ranked, (key=None|key=lambda c: \(c\[1\], c\[1\]\)|key=lambda c: \(c\[0\], c\[2\]\)|)\)",
     "the order only decides what is skipped, and a skip only drops a candidate that cannot win: "
     "the winner is the least (step, index) in any order (key=None sorts by floor, then the unique index)"),
    ("*.balance.x__plan_balance__*", r"options\.sort\(key=lambda o: \(o\[0\], o\[1\]\)\)  ->  options\.sort\((key=None|key=lambda o: \(o\[1\], o\[1\]\)|key=lambda o: \(o\[0\], o\[2\]\))\)",
     "the order only decides what is skipped, and a skip only drops a unit set that cannot win: "
     "the winner is the least (step, index) in any order (key=None sorts by floor, then the unique index)"),
    ("*.balance.x_*", r"(key|\(step, index\)) < best\[:2\]:  ->  .*(key|\(step, index\)) (<= best\[:2\]|< best\[:3\]):",
     "keys are unique (each holds the candidate's or set's own index), so < and <= agree, and a key "
     "never equals best[:2] (the longer best[:3] compares as best[:2] then)"),
    ("*.balance.x__best_pp_plan__*", r"^count = 0  ->  count = 1$|^count \+= 1  ->  count \+= 2$",
     "count only numbers the candidates in list order: any increasing numbering ranks them the same"),
    ("*.balance.x__best_pp_plan__*", r"^count \+= 1  ->  count = 1$",
     "the numbering decides only between candidates whose estimates tie to the last bit and whose "
     "1F1B floors differ (identical placements have identical floors)"),
    ("*.balance.x__best_pp_plan__*", r"emit_plan\(replace\(request, pieces=False\), placements, scheduler=NAME\)  ->  ",
     "finish_times reads only the estimate's per-rank times, which neither the scheduler's name nor "
     "the pieces change"),
    ("*.balance.x__units_floor__*", r"default=0\.0\)\)  ->  .*default=1\.0\)\)",
     "units is never empty (make_plan refuses an empty batch)"),
    ("*.balance.x__units_floor__*", r"if cm\.two_level_ring or request\.topology is not None or cm\.p2p_bandwidth_inter > cm\.p2p_bandwidth_intra:  ->  ",
     "the guard is stricter than the bound needs: a unit's own time is costed on its fewest nodes, "
     "so with a node map or two-level rings it is not above its placed time either, and when the "
     "network is exactly as fast the floor is still a bound; test_balance_candidate_choice.py "
     "plans those cases with and without skipping"),
    ("*.balance.x_*", r"if request\.ep_size > 1 and request\.even_expert_slots and request\.pp_size (==|>) 1:  ->  if request\.ep_size >= 1 ",
     "even_expert_slots returns a plan without expert groups (ep_size 1) unchanged"),
    # planner/schedulers/pp_balance.py
    ("*pp_balance.x__place_rings_aligned__*", r"fewest_nodes_ranked\(d, ranked, earliest=start\)  ->  .*fewest_nodes_ranked\(d, ranked, \)",
     "earliest (the load-only start, which no choice on fewer nodes can beat) only lets the search "
     "stop early: the same choice, found later"),
    ("*pp_balance.x__place_rings_aligned__*", r"topo\.ring_nodes\(members\) - topo\.min_nodes\(d\), start, c\)  ->  .*topo\.ring_nodes\(members\) \+ topo\.min_nodes\(d\)",
     "min_nodes(d) is the same for every count group compared (d is this ring's size): adding it "
     "instead of subtracting it keeps the order of the scores"),
    ("*pp_balance.x__place_rings_aligned__*", r"if best is not None and \(0, start, c\) >= best\[0\]:  ->  .*\(0, start, c\) > best\[0\]:",
     "best[0] carries another count group's count c, so (0, start, c) never equals it: > and >= "
     "stop at the same group"),
    ("*pp_balance.x__place_runs__*", r"load\[r\] \+= t \+ fd \* \(x if x > 0\.0 else 0\.0\)  ->  .*\(x if x >= 0\.0 else 0\.0\)",
     "at x == 0 both add fd * 0.0: the same float"),
    ("*pp_balance.x__place_runs__*", r"^if x > 0\.0:  ->  if x >= 0\.0:$",
     "at x == 0 the unit's time equals the pipeline's longest: the same value is stored"),
    ("*pp_balance.x__place_runs__*", r"^if not load\[r\] \+ \(t \+ fd \* \(x if x > 0\.0 else 0\.0\)\) <= max_t:  ->  .*(t - fd \*|x if \(x > 0\.0\) and False|x if x >= 0\.0|x if x > 1\.0)",
     "every caller passes the single-rank units longest first (unit_sort_key), so a unit checked "
     "inside a run is never longer than the pipeline's longest (the run's first unit, or earlier): "
     "x <= 0 and the fill-and-drain term is 0 under each of these conditions"),
    ("*pp_balance.x_short_first__*", r"k > last_ring\.get\(p\.ring\[0\], -1\):  ->  .*k (> last_ring\.get\(p\.ring\[0\], -2\)|>= last_ring\.get\(p\.ring\[0\], -1\)):",
     "k >= 0, so any negative default admits every micro-batch of a rank without a ring; and the "
     "placement at a rank's last ring index is that ring, which len(p.ring) == 1 already excludes"),
    # planner/schedulers/placement.py
    ("*placement.xǁFreeRanksǁ__init____*", r"range\(self\._g \+ 1\)\]  ->  .*range\(self\._g \+ 2\)\]",
     "an extra bucket, for g + 1 free ranks, which no node has: it stays empty and take() never reads it"),
    ("*placement.xǁFreeRanksǁtake__*", r"divmod\(d, g\) if d > g else \(0, d\)  ->  .*divmod\(d, g\) if (d >= g|\(d > g\) or True) else",
     "divmod(d, g) is (0, d) for d < g; at d == g it is (1, 0): the first free node of bucket g, "
     "which is also the best fit for a remainder of g (or None either way: the fallback)"),
    ("*placement.xǁRingPlacerǁ__init____*", r"self\._regular = topology\.node_of is None .*  ->  ",
     "the general path reads the same matrix: _ext[_idx] lays the loads out node by node, which on "
     "the regular map is loads.reshape(-1, g); compact_in_node's answer is the same on either path"),
    ("*placement.xǁRingPlacerǁ_compact_in_node__*", r"if self\._regular else self\._ext\[self\._idx\]  ->  m = self\.loads\.reshape\((-2, g\) if self\._regular|-1, g\) if \(self\._regular\) and False)",
     "the general path reads the same matrix (see _regular), and numpy 2 infers a size given as any negative number"),
    ("*placement.xǁRingPlacerǁ_compact_in_node__*", r"col = m\.min\(axis=1\) if d == 1 else np\.partition\(m, d - 1, axis=1\)\[:, d - 1\]  ->  .*(\(d == 1\) and False|np\.partition\(m, d - 1, \))",
     "a partition at 0 puts each row's minimum in column 0; a partition without axis works on the last axis, which is axis 1 here"),
    ("*placement.xǁRingPlacerǁ*", r"if d <= (self\.width|g)( and eligible is None)?:  ->  if d < ",
     "a ring of exactly a node's size: the sorted view's whole-node choice is the node whose largest "
     "load is least, which is also the node whose g-th smallest load is least (inf for short or "
     "masked nodes either way), the same ring after node_contiguous; _compact_in_node matches the "
     "sorted view (its docstring and test_compact_in_a_node_matches_the_sorted_reference_on_wide_nodes)"),
    ("*placement.xǁRingPlacerǁ_compact_in_node__*", r"np\.partition\(m, d - 1, axis=1\)\[:, d - 1\]  ->  .*np\.partition\(m, d - 2, axis=1\)\[:, d - 1\]",
     "equivalent on numpy 2 as installed: its partition sorts rows of a node's size outright (every "
     "permutation of 6 and random rows of 64 checked), so column d - 1 holds the d-th smallest "
     "either way; the code relies only on the documented kth"),
    # data/lengths.py
    ("*lengths.x__parse_json__*", r"kind = \{dict: \"an object\", str: \"a string\"\}\.get\(type\(data\), type\(data\)\.__name__\)  ->  ",
     "only a JSON object or list can start with { or [, and a list does not get here: every kind "
     "named is \"an object\", whatever the string or default for other types says"),
    ("*lengths.x_*", r"np\.asarray\((data|values), dtype=np\.int64\)  ->  return np\.asarray\((data|values), (dtype=None)?\)",
     "Python integers of at most 2**40 become numpy 2's default integer, int64, anyway"),
    ("*lengths.x__parse_text__*", r"len\(line\) <= 30:.*  ->  .*len\(line\) < 30:",
     "a line of exactly 30 digits then takes parse_decimal (max 30 digits), which reads the same value"),
    ("*lengths.x__read_bounded__*", r"\.decode\(\"utf-8\"\)  ->  .*\.decode\(\"UTF-8\"\)", "codec names are case-insensitive"),
    ("*lengths.x__too_long__*", r"shown = str\(value\) if len\(str\(value\)\) <= 30 else .*  ->  ",
     "no length of more than 30 digits reaches it (both readers refuse more digits first): the "
     "shortened form is never used"),
    ("*lengths.x_write_lengths__*", r"encoding=\"utf-8\"\)  ->  ",
     "the text is ASCII digits and newlines, the same bytes in every encoding Python defaults to"),
    # planner/plan.py (field types)
    ("*plan.x__as_seconds__*", r"float\(\"inf\"\):  ->  .*float\(\"INF\"\):", "float() reads inf in any case"),
    ("*plan.xǁStepPlanǁfrom_dict__*", r"^version=version,  ->  $",
     "the version read must equal PLAN_VERSION (checked above), which is the field's default"),
    # runtime/offload_storage.py
    ("*offload_storage.xǁOffloadedStorageǁ*", r"self\.resident = (False|True)  ->  ",
     "the flag was removed after this run: it was only read together with `full`, which reload() "
     "and make_resident() set, so needs_reload now reads `full` alone"),
    ("*offload_storage.x*", r"= torch\.empty\(0, dtype=[^)]*\)  ->  \w+ = torch\.empty\(1, ",
     "the empty tensor only carries dtype and device: set_ then gives it another storage, size "
     "and stride, so its own first size is never read"),
    ("*offload_storage.x_storage_bytes__*", r"\(storage\.nbytes\(\),\), \(1,\)\)  ->  .*\(storage\.nbytes\(\),\), (None|)\)",
     "set_ without a stride (or None) gives the contiguous stride, (1,) for one dimension"),
    ("*offload_storage.xǁOffloadedStorageǁ__init____*", r"self\.base = 0  ->  self\.base = (None|1)",
     "base is read only by view(), which runs after reload() or make_resident() has set it"),
    ("*offload_storage.x__gaps__*", r"if p\.end <= at or p\.start >= hi:  ->  if (p\.end < at or p\.start >= hi|p\.end <= at or p\.start > hi):",
     "a piece that ends exactly at `at` (or starts exactly at hi) adds no gap and leaves `at` "
     "where the comparison left it: the same gaps either way"),
    ("*offload_storage.xǁSavedActivationǁ__init____*", r"tracked: bool = False\) -> None:  ->  .*tracked: bool = True\)",
     "every caller that leaves tracked out passes an offloaded storage, for which tracked is "
     "ignored (tracked and storage is None); resident saves pass it explicitly"),
    # planner/schedulers/pp_balance.py: the window load and the reorderings
    ("*pp_balance.x_next_levels_first__*", r"\(lead if i == 0 else i\), k\)  ->  .*\(lead if \(i == 0\) or True else i\), k\)",
     "positions after `lead` then share position 0's key and ties go by list index, where a "
     "pipeline's position 0 comes before its later ones: every pipeline runs the same list; only "
     "placements of different pipelines interleave differently in the global list"),
    ("*pp_balance.x_singles_first__*", r"k > last_ring\.get\(ring\[0\], end\):  ->  .*k >= last_ring\.get\(ring\[0\], end\):",
     "k equals a pipeline's last-ring index only at that ring, which is not a single (the "
     "condition also asks len(ring) == 1)"),
    ("*pp_balance.x_singles_first__*", r"x\[0\] <= cap \* \(1 \+ 1e-9\)\), pool\[-1\]\)  ->  .*x\[0\] < cap \* \(1 \+ 1e-9\)\)", TOLERANCE),
    ("*pp_balance.xǁPipelineLoadǁ*", r"if len\(top\) > 2 \* w and t <= top\[-1\]:.*  ->  if len\(top\) > (2 \* w and t < top\[-1\]|3 \* w and t <= top\[-1\]):",
     "the shortcut is a fast path: where it is not taken (t equal to the smallest time kept, or "
     "a top list not yet full) the full computation gives the same load"),
    # planner/schedulers/balance.py: the cuts of planning time (skips that never change the plan)
    ("*.balance.x__best_pp_plan__*", r"(seconds, stop_above\) if quick else None|ctx\.cost_model, seconds,)  ->  ",
     _SPEED),
    ("*.balance.x__best_pp_plan__*", r"order_free_floor\(c\[1\], (c\[3\]|unit_of\[id\(c\[3\]\)\]), ctx, request\.pp_size\) <= best\[0\] \* \(1 \+ 1e-9\)\]  ->  .*<= best\[0\] \* \((2 \+ 1e-9|1 \+ 1\.000000001)\)\]",
     _SPEED),
    ("*.balance.x__best_pp_plan__*", r"order_free_floor\(c\[1\], (c\[3\]|unit_of\[id\(c\[3\]\)\]), ctx, request\.pp_size\) <= best\[0\] \* \(1 \+ 1e-9\)\]  ->  .*\) < best\[0\] \* \(1 \+ 1e-9\)\]",
     "a family whose order-free floor equals the best step can at most tie it, and a tie goes to "
     "the earlier candidate, the best"),
    ("*.balance.x__best_pp_plan__*", r"order_free_floor\(c\[1\], (c\[3\]|unit_of\[id\(c\[3\]\)\]), ctx, request\.pp_size\) <= best\[0\] \* \(1 \+ 1e-9\)\]  ->  .*<= best\[0\] (/ \(1 \+ 1e-9\)|\* \(1 - 1e-9\))\]",
     TOLERANCE),
    ("*.balance.x__best_pp_plan__*", r"if request\.pp_size > 1:  ->  if request\.pp_size >= 1:",
     "at PP 1 the window load's window is 0, which is the plain runs' load: a second copy of "
     "an earlier candidate, which can only tie it and loses the tie"),
    ("*.balance.x__units_floor__*", r"return floor\(units\) if base is units else .*  ->  return floor\(units\) if \(base is units\) and False",
     "with base the very list of units, min(floor(units), floor(base)) is floor(units): the "
     "branch only saves computing it twice"),
    # planner/wavefront.py: the early stop against the best so far
    ("*wavefront.x__run__*", r"(f_next = np\.clip\(\(key - 1 - stages\) // 2 \+ 1, 0, depth\)|b_next = np\.clip\(\(key - 2 \* pp \+ stages\) // 2 \+ 1, 0, depth\)|bound = last \+ left\[f_next, 0\] \+ left\[b_next, 1\])  ->  ",
     "each of these mutants counts less of the work left (a later index, a clip to the all-zero "
     "last row, or the forwards' work subtracted), so the bound is weaker but still a lower "
     "bound: the stop fires later or not at all, which costs speed only; one that counted more "
     "work (a stronger, wrong bound) fails test_candidate_time.py, which checks every stop"),
    ("*wavefront.x__run__*", r"left = np\.zeros\(\(depth \+ 1, 2, n\)\)  ->  left = np\.zeros\(\(depth \+ 2,",
     "an extra all-zero row past the last index read (depth)"),
    ("*wavefront.x__run__*", r"if bound\.max\(\) > stop_above \* \(1 \+ 1e-9\):  ->  .*>= stop_above", TOLERANCE),
    # planner/schedulers/pp_balance.py: the runs below the isolated rings
    ("*pp_balance.x__place_runs__*", r"max_t = max\(load\) if pipelines is None else max\(load\[:pipelines\]\)  ->  ",
     "load[:None] is the whole list, and past `pipelines` (the isolated rings' pipelines) no load "
     "is ever added, so the max over all is the max over the first ones: the slice keeps the "
     "contract if that ever changes"),
    ("*pp_balance.x_pp_balance__*", r"pipelines=top if isolated else None\)  ->  .*\(isolated\) or True",
     "without isolated rings top is n, and runs over the first n pipelines are runs over all"),
    ("*pp_balance.x_pp_balance__*", r"layer_cap: float = 0\.0\) -> list\[Placement\]:  ->  .*layer_cap: float = 1\.0\)",
     "the default is read only with isolated rings, and every caller that gives them gives a cap"),
    # planner/schedulers/balance.py: this round's skips (speed only, or the order of ties)
    ("*.balance.x__best_pp_plan__*", r"if widened and use_base:  ->  if widened or use_base:",
     "with nothing widened the unwidened list is the widened one: its level steps are a copy of "
     "an earlier candidate that can only tie and loses the tie; otherwise a hopeless list is built "
     "anyway (speed only)"),
    ("*.balance.x__best_pp_plan__*", r"(timed\[id\(placements\)\] = step|if id\(placements\) not in timed:|order_free_floor\(c\[1\], (c\[3\]|unit_of\[id\(c\[3\]\)\])).*  ->  .*(id\(None\)|order_free_floor\(None,)",
     _SPEED),
    ("*.balance.x__best_pp_plan__*", r"limit = best\[0\] \* \(1 \+ 1e-9\)  ->  limit = best\[0\] \* \((2 \+ 1e-9|1 \+ 1\.000000001)\)",
     _SPEED),
    ("*.balance.x__best_pp_plan__*", r"limit = best\[0\] \* \(1 \+ 1e-9\)  ->  limit = best\[0\] (/ \(1 \+ 1e-9\)|\* \(1 - 1e-9\))",
     TOLERANCE),
    ("*.balance.x__best_pp_plan__*", r"\(f <= limit for f in list_floors\)  ->  .*\(f < limit for",
     "a list whose floor equals the best can at most tie it, and that best comes from an earlier "
     "unit set (the lists are judged before this set's first candidate), which wins the tie"),
    ("*.balance.x__best_pp_plan__*", r"best = \(\*key, plan, build\(name, placements, grown\)\)  ->  .*build\((None, placements, grown|name, None, grown|name, placements, None)\)",
     "what builds a candidate is read only for a winner timed without its plan; here the plan is "
     "built already and returned as it is"),
    ("*.balance.x__best_pp_plan__*", r"sorted\(zip\(floors, candidates\), key=lambda c: \(c\[0\], c\[1\]\[0\]\)\):  ->  .*(key=None\)|candidates\), \)|key=lambda c: \(c\[1\], c\[1\]\[0\]\)|key=lambda c: \(c\[0\], c\[1\]\[1\]\))",
     "the order candidates are timed in: every candidate is still skipped only where its floor is "
     "slower than the best so far and kept by (step, its place in the list), so the winner is the "
     "same; only planning time changes"),
    ("*.balance.x__best_pp_plan__*", r"\(position, [0-3]\).*  ->  .*\(position, [1-4]\)",
     "the order of ties between two orders of one assignment: only an exact float tie of their "
     "steps tells the slots apart (ties across assignments and sets: test_a_tie_goes_to_the_"
     "first_candidate)"),
    # planner/schedulers/pp_floors.py and local_indices: numpy spelled another way
    ("*pp_floors.x_*", r"np\.(fromiter|repeat|asarray|array|arange)\(.*(dtype=|count=).*  ->  .*(dtype=None|, \)|, \)\[| \* n)",
     "count only sizes fromiter's buffer; ranks, sizes and rows read without a dtype are int64, "
     "and times float64, anyway"),
    ("*pp_balance.x_local_indices__*", r"(np\.fromiter|np\.empty)\(.*(dtype=|count=).*  ->  .*(dtype=None|, \))",
     "count only sizes fromiter's buffer; without a dtype the ranks read int64, and the local "
     "indices, float64 in an empty array, are small integers held exactly (equal as list items)"),
    ("*pp_balance.x_local_indices__*", r'kind="stable"\).*  ->  .*kind="STABLE"\)',
     "numpy reads the sort kind case-insensitively"),
    ("*pp_floors.x_alone_floors__*", r"\.max\(axis=1, initial=0\.0\)\]  ->  .*\.max\(axis=1, (initial=None)?\)\]",
     "every candidate has hdp_size >= 1 pipelines, so the maximum never meets an empty row"),
    ("*pp_floors.x_alone_floors__*", r"(row = tables\.setdefault\(id\(units\), \{\}\)|rows\.append\(\[row\[id\(p\)\]|if id\(p\) not in row:).*  ->  .*(id\(None\)|setdefault\(None,)",
     "speed only: the table of placements seen is a cache (one per units list, by placement id); "
     "with its key lost every placement is costed again to the same float, and balance passes each "
     "placement object with one units list only"),
    ("*pp_floors.x_*", r"(times|seconds)\.append\(u\.time if len\(p\.ring\) == 1 == u\.ring_size else.*  ->  .*(\) and False else|len\(p\.ring\) != 1 == u\.ring_size|len\(p\.ring\) == 1 != u\.ring_size)",
     "these take placed_time where the shortcut took u.time, and placed_time returns u.time itself "
     "for a single-rank unit on one rank (the same float)"),
    ("*pp_floors.x_order_free_floor__*", r"top = np\.zeros\(\(n, 2 \* w \+ 1\)\)  ->  top = np\.zeros\(\(n, (3 \* w \+ 1|2 \* w \+ 2)\)\)",
     "extra columns stay zero (only 2 w + 1 times per pipeline are written) and add nothing to "
     "the smaller share's sum"),
    # planner/schedulers/pp_isolate.py: rings of their own
    ("*pp_isolate.x_isolated_runs__*", r"finish_times\(placements, stop_above\), dtype=float\)  ->  .*(dtype=None\)|stop_above\), \))",
     "finish_times returns float64 arrays: asarray keeps them either way"),
    # planner/pipeline_floor.py: the assignment floor
    ("*pipeline_floor.x_assignment_floor__*", r"longest: int = 64\) -> float:  ->  .*longest: int = 65\)",
     "a search width: every width gives a valid bound, and the tests pass theirs"),
    ("*pipeline_floor.x_assignment_floor__*", r"if free > 0 else np\.full\(len\(tau2\), np\.inf\)  ->  .*if (free >= 0|\(free > 0\) or True) else",
     "free is never negative there (n1 <= pipelines), and at 0 numpy's n2 / 0 is inf, what the "
     "other branch gives"),
    ("*pipeline_floor.x_assignment_floor__*", r"dtype=np\.int64\)  ->  .*\(x\[1\]\) for x in order\](, dtype=None|, )\)",
     "the ring sizes are Python ints: numpy makes them int64 either way"),
    ("*pipeline_floor.x_assignment_floor__*", r"for i in range\(-1, min\(longest, len\(t\) - 1\)\):  ->  for i in range\(-2,",
     "i = -2 repeats the case without a long level (n1 = 0, tau1 = inf) on a suffix of the stage "
     "times, a subset of what i = -1 tries"),
    ("*pipeline_floor.x_assignment_floor__*", r"^break  ->  continue$",
     "n1 grows with i: once above the pipelines it stays above, so every later iteration stops "
     "at the same test"),
    # the twelfth round's cuts of planning time
    ("*widen.x__smallest_ring_under__*", r"^if hi - lo > 1:  ->  if hi (\+ lo > 1|- lo >= 1):$",
     "the guard only skips a call with no size between lo and hi: there arange(lo + 1, hi) is "
     "empty and the loop does not run"),
    ("*widen.x__smallest_ring_under__*", r"^first = lo \+ 1  ->  first = lo - 1$",
     "a lower first only times two sizes more: the loop reads time(mid) at mid - first whatever "
     "first is"),
    ("*widen.x__smallest_ring_under__*", r"between\[mid - first\] <= aim:  ->  .*between\[mid - first\] < aim:",
     "a ring time equal to the aim to the last bit"),
    ("*pp_balance.x__place_rings_aligned__*", r"^(known = searched\.get\(c\)  ->  known = None|searched\[c\] = \(changed\[c\], d, start, members, extra, front\)  ->  searched\[c\] = None)$",
     "speed only: without the kept choice every group searches again and finds the same "
     "(test_planner_pp_balance.py::test_ring_placement_equals_the_search_of_every_count_group)"),
    ("*wavefront.x__count_bands__*", r'side="left"\)\).*  ->  .*-\(ranked\[i\] // 2\), \)\)',
     "side='left' is searchsorted's default"),
    ("*wavefront.x__count_bands__*", r"-\(ranked\[i\] // 2\).*  ->  .*-\(ranked\[i\] / 2\)",
     "counts are integers: a count is at most c / 2 exactly when it is at most c // 2"),
    ("*wavefront.x__count_bands__*", r'^order = np\.argsort\(-counts, kind="stable"\)  ->  order = np\.argsort\(-counts, (kind=None)?\)$',
     "equal counts fall in one band either way; the rows of a band run alone (no ring), and each "
     "pipeline's finish is written back by its index"),
    ("*wavefront.x_pipelines_alone_flat__*", r"^counts = np\.bincount\(pipeline, minlength=n\)  ->  counts = np\.bincount\(pipeline, \)$",
     "the pipelines after the last with micro-batches have none: they are in no band and their "
     "finish stays 0"),
    ("*wavefront.x_pipelines_alone_flat__*", r"^(band_of = np\.empty\(n|grid = np\.full\(\(len\(members\), int\(counts\[members\]\.max\(\)\)\), pad), dtype=np\.int64\)  ->  .*(dtype=None)?\)$",
     "band numbers and order indices are compared and used as indices exactly in float64 too, "
     "and np.full makes an int64 grid from the int pad"),
    ("*wavefront.x_pipelines_alone_flat__*", r"np\.append\(t\[mine\], 0\.0\).*  ->  .*np\.append\(t\[mine\], 1\.0\)",
     "the pad slot, past every list's end, is never live: no op reads its weight"),
    ("*pp_floors.x_*", r"(times|seconds)\.append\(u\.time if len\(ring\) == 1 == u\.ring_size else.*  ->  .*(\) and False else|len\(ring\) != 1 == u\.ring_size|len\(ring\) == 1 != u\.ring_size)",
     "these take placed_time where the shortcut took u.time, and placed_time returns u.time itself "
     "for a single-rank unit on one rank (the same float)"),
    ("*candidate_time.x_time_key__*", r"two_level_group\(ring\) if two_level else 1\)  ->  .*(if \(two_level\) or True else 1|if two_level else 2)\)",
     "with a flat cost model a ring's seconds do not depend on its node group: a key holding it, or "
     "another constant in its place, only keeps apart what could be shared"),
    ("*candidate_time.x_time_key__*", r"^return p\.seqs, p\.offload_ratio, 1, True, 1  ->  return p\.seqs, p\.offload_ratio, 1, (False, 1|True, 2)$",
     "a single's key has size 1 and no ring's has: its other fields never meet a ring's key"),
]

# Survivors of a run that a test added after it kills (each planted by hand: the test fails):
# (mutant-name glob, regex on "original  ->  mutated", the test). A rerun of the target drops
# them from the survivors; until then the table says which test kills them.
_EDGES = "tests/runtime/test_runtime_offload_edges.py::"
_UNITS = "tests/runtime/test_offload_storage_units.py"
_LENGTHS = "tests/planner/test_lengths_reader_limits.py"
_PLAN_JSON = "tests/planner/test_plan_json_fields.py"
_CHOICE = "tests/planner/test_balance_candidate_choice.py::"
KILLED_SINCE: list[tuple[str, str, str]] = [
    ("*candidate_time.x_finish_times__*", r"^(two_level = cost_model\.two_level_ring  ->  two_level = None|keys = \[time_key\(p, topo, two_level\) for p in placements\]  ->  keys = \[time_key\(p, topo, (None)?\) for p in placements\])$",
     "tests/planner/test_candidate_time.py::test_two_level_rings_of_one_size_across_nodes_in_other_node_groups_are_costed_apart"),
    ("*candidate_time.x_time_key__*", r"two_level_group\(ring\) if two_level else 1\)  ->  .*if \(two_level\) and False else 1\)",
     "tests/planner/test_candidate_time.py::test_two_level_rings_of_one_size_across_nodes_in_other_node_groups_are_costed_apart"),
    ("*candidate_time.x_time_key__*", r"^return p\.seqs, p\.offload_ratio, 1, True, 1  ->  return p\.seqs, p\.offload_ratio, 2, True, 1$",
     "tests/planner/test_candidate_time.py::test_a_unit_alone_and_the_same_unit_on_a_ring_inside_a_node_are_kept_apart"),
    ("*.balance.x__best_pp_plan__*", r"if request\.pp_size > 1:  ->  if request\.pp_size > 2:",
     "tests/planner/test_planner_pp_balance.py::test_pp_balance_keeps_the_fastest_candidate"),
    ("*.balance.x__best_pp_plan__*", r"window=request\.pp_size - 1, \*\*kw\), widened, units\)\)  ->  .*window=request\.pp_size (\+ 1|- 2),",
     "tests/planner/test_planner_pp_balance.py::test_pp_balance_keeps_the_fastest_candidate"),
    ("*.balance.x__best_pp_plan__*", r"singles_first\(placements, time_of, request\.pp_size - 1\)  ->  .*request\.pp_size \+ 1\)",
     _CHOICE + "test_the_1f1b_runs_are_pp_balance_with_the_fill_and_drain_of_the_stages"),
    ("*.balance.x__units_floor__*", r"(if pp > 1 and of:|assignment_floor\(\[\(u\.time, u\.ring_size\) for u in of\]|return floor\(units\) if base is units else).*  ->  ",
     _CHOICE + "test_the_unit_set_floor_by_hand"),
    ("*pp_balance.x__place_rings_aligned__*", r"\(0, start, c\) >= best\[0\]:  ->  .*\(0, start, c\) >= best\[1\]:",
     "tests/planner/test_planner_pp_balance.py::test_a_later_count_group_that_fits_one_node_beats_an_earlier_one_that_must_wait"),
    ("*pp_balance.x__place_rings_aligned__*", r"load\[r\] \+= t \+ fd \* \(x if x > 0\.0 else 0\.0\)  ->  .*\(x if \(x > 0\.0\) or True else 0\.0\)",
     "tests/planner/test_planner_pp_balance.py::test_the_fill_and_drain_load_adds_only_the_work_of_a_shorter_micro_batch"),
    ("*pp_balance.x__place_runs__*", r"^load\[r\] \+= t \+ fd \* \(x if x > 0\.0 else 0\.0\)  ->  .*\(x if \(x > 0\.0\) or True else 0\.0\)",
     "tests/planner/test_planner_pp_balance.py::test_the_fill_and_drain_load_adds_only_the_work_of_a_shorter_micro_batch"),
    ("*pp_balance.x__place_runs__*", r"^if not pipeline_load\.floor_after\(r, t\) <= max_t:  ->  .*\) < max_t:$",
     "tests/planner/test_planner_pp_balance.py::test_a_window_load_run_may_reach_the_max_but_not_pass_it"),
    ("*pp_balance.x__place_runs__*", r"^if not load\[r\] \+ \(t \+ fd \* \(x if x > 0\.0 else 0\.0\)\) <= max_t:  ->  .*\(x if \(x > 0\.0\) or True else 0\.0\)",
     "tests/planner/test_planner_pp_balance.py::test_a_fill_and_drain_run_stops_where_the_next_would_pass_the_max"),
    ("*pp_balance.x__place_runs__*", r"^continue  ->  break$",
     "tests/planner/test_planner_pp_balance.py::test_a_window_load_run_continues_while_the_pipeline_stays_under_the_max"),
    ("*plan.xǁStepPlanǁfrom_dict__*", r"^extra=\{k: v for k, v in est\.items\(\) if k not in known\}, / \)  ->  \)$",
     _PLAN_JSON),
    ("*data.lengths.x__parse_json__*", '^if x > MAX_SEQUENCE_LENGTH:  ->  if x >= MAX_SEQUENCE_LENGTH:$',
     _LENGTHS),
    ("*data.lengths.x__parse_text__*", '^line = raw\\.strip\\(" \\\\t"\\)  ->  line = raw\\.strip\\("XX \\\\tXX"\\)$',
     _LENGTHS),
    ("*data.lengths.x__parse_text__*", '^if line\\.isascii\\(\\) and line\\.isdigit\\(\\) and len\\(line\\) <= 30:  # the common case, fast  ->  if line\\.isascii\\(\\) and line\\.isdigit\\(\\) and len\\(line\\) <= 31:  # the common case, fast$',
     _LENGTHS),
    ("*data.lengths.x__parse_text__*", '^value = parse_decimal\\(line, f"\\{name\\}, line \\{lineno\\}", max_digits=30\\)  ->  value = parse_decimal\\(line, f"\\{name\\}, line \\{lineno\\}", \\)$',
     _LENGTHS),
    ("*data.lengths.x__parse_text__*", '^value = parse_decimal\\(line, f"\\{name\\}, line \\{lineno\\}", max_digits=30\\)  ->  value = parse_decimal\\(line, f"\\{name\\}, line \\{lineno\\}", max_digits=31\\)$',
     _LENGTHS),
    ("*data.lengths.x__parse_text__*", '^if value > MAX_SEQUENCE_LENGTH:  ->  if value >= MAX_SEQUENCE_LENGTH:$',
     _LENGTHS),
    ("*data.lengths.x__parse_text__*", '^line = raw\\.strip\\(" \\\\t"\\)  ->  line = raw\\.strip\\(None\\)$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^nul = chunk\\.find\\(b"\\\\0"\\)  ->  nul = chunk\\.rfind\\(b"\\\\0"\\)$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^nul = chunk\\.find\\(b"\\\\0"\\)  ->  nul = chunk\\.find\\(b"XX\\\\0XX"\\)$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^if nul >= 0:  ->  if nul > 0:$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^if nul >= 0:  ->  if nul >= 1:$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^size \\+= len\\(chunk\\)  ->  size = len\\(chunk\\)$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^size \\+= len\\(chunk\\)  ->  size -= len\\(chunk\\)$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^if size > MAX_FILE_BYTES:  ->  if size >= MAX_FILE_BYTES:$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^return b""\\.join\\(chunks\\)\\.decode\\("utf-8"\\)  ->  return b"XXXX"\\.join\\(chunks\\)\\.decode\\("utf-8"\\)$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^size = 0  ->  size = 1$',
     _LENGTHS),
    ("*data.lengths.x__read_bounded__*", '^while chunk := handle\\.read\\(_CHUNK_BYTES\\):  ->  while chunk := handle\\.read\\(None\\):$',
     _LENGTHS),
    ("*data.lengths.x__too_long__*", '^shown = str\\(value\\) if len\\(str\\(value\\)\\) <= 30 else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"  ->  shown = None$',
     _LENGTHS),
    ("*data.lengths.x__too_long__*", '^shown = str\\(value\\) if len\\(str\\(value\\)\\) <= 30 else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"  ->  shown = str\\(value\\) if \\(len\\(str\\(value\\)\\) <= 30\\) and False else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"$',
     _LENGTHS),
    ("*data.lengths.x__too_long__*", '^shown = str\\(value\\) if len\\(str\\(value\\)\\) <= 30 else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"  ->  shown = str\\(None\\) if len\\(str\\(value\\)\\) <= 30 else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"$',
     _LENGTHS),
    ("*data.lengths.x__too_long__*", '^shown = str\\(value\\) if len\\(str\\(value\\)\\) <= 30 else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"  ->  shown = str\\(value\\) if len\\(str\\(value\\)\\) < 30 else f"\\{str\\(value\\)\\[:12\\]\\}\\.\\.\\. \\(\\{len\\(str\\(value\\)\\)\\} digits\\)"$',
     _LENGTHS),
    ("*data.lengths.x_read_lengths__*", '^if text\\.lstrip\\(\\)\\[:1\\] in \\("\\[", "\\{"\\):  ->  if text\\.rstrip\\(\\)\\[:1\\] in \\("\\[", "\\{"\\):$',
     _LENGTHS),
    ("*data.lengths.x_read_lengths__*", '^p = check_regular_file\\(path, "lengths file"\\)  # a FIFO would block open\\(\\) forever  ->  p = check_regular_file\\(path, None\\)  # a FIFO would block open\\(\\) forever$',
     _LENGTHS),
    ("*data.lengths.x_read_lengths__*", '^p = check_regular_file\\(path, "lengths file"\\)  # a FIFO would block open\\(\\) forever  ->  p = check_regular_file\\(path, "XXlengths fileXX"\\)  # a FIFO would block open\\(\\) forever$',
     _LENGTHS),
    ("*data.lengths.x_read_lengths__*", '^p = check_regular_file\\(path, "lengths file"\\)  # a FIFO would block open\\(\\) forever  ->  p = check_regular_file\\(path, "LENGTHS FILE"\\)  # a FIFO would block open\\(\\) forever$',
     _LENGTHS),
    ("*planner.plan.x__as_seconds__*", '^if isinstance\\(value, bool\\) or not isinstance\\(value, numbers\\.Real\\) or not 0\\.0 <= float\\(value\\) < float\\("inf"\\):  ->  if isinstance\\(value, bool\\) and not isinstance\\(value, numbers\\.Real\\) or not 0\\.0 <= float\\(value\\) < float\\("inf"\\):$',
     _PLAN_JSON),
    ("*planner.plan.x__as_seconds__*", '^if isinstance\\(value, bool\\) or not isinstance\\(value, numbers\\.Real\\) or not 0\\.0 <= float\\(value\\) < float\\("inf"\\):  ->  if isinstance\\(value, bool\\) or not isinstance\\(value, numbers\\.Real\\) or not 0\\.0 <= float\\(value\\) <= float\\("inf"\\):$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^dropped = \\[_as_int\\(x, "meta\\.dropped"\\) for x in _as_list\\(out\\["dropped"\\], "meta\\.dropped"\\)\\]  ->  dropped = \\[_as_int\\(x, "XXmeta\\.droppedXX"\\) for x in _as_list\\(out\\["dropped"\\], "meta\\.dropped"\\)\\]$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^dropped = \\[_as_int\\(x, "meta\\.dropped"\\) for x in _as_list\\(out\\["dropped"\\], "meta\\.dropped"\\)\\]  ->  dropped = \\[_as_int\\(x, "META\\.DROPPED"\\) for x in _as_list\\(out\\["dropped"\\], "meta\\.dropped"\\)\\]$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^for name in \\("dropped_tokens", "truncated_tokens"\\):  ->  for name in \\("dropped_tokens", "XXtruncated_tokensXX"\\):$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^for name in \\("dropped_tokens", "truncated_tokens"\\):  ->  for name in \\("dropped_tokens", "TRUNCATED_TOKENS"\\):$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^if name in out and _as_int\\(out\\[name\\], f"meta\\.\\{name\\}"\\) < 0:  ->  if name in out and _as_int\\(out\\[name\\], None\\) < 0:$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^if name in out and _as_int\\(out\\[name\\], f"meta\\.\\{name\\}"\\) < 0:  ->  if name in out and _as_int\\(out\\[name\\], f"meta\\.\\{name\\}"\\) <= 0:$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^if name in out and _as_int\\(out\\[name\\], f"meta\\.\\{name\\}"\\) < 0:  ->  if name in out and _as_int\\(out\\[name\\], f"meta\\.\\{name\\}"\\) < 1:$',
     _PLAN_JSON),
    ("*planner.plan.x__checked_meta__*", '^dropped = \\[_as_int\\(x, "meta\\.dropped"\\) for x in _as_list\\(out\\["dropped"\\], "meta\\.dropped"\\)\\]  ->  dropped = \\[_as_int\\(x, None\\) for x in _as_list\\(out\\["dropped"\\], "meta\\.dropped"\\)\\]$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^Piece\\(seq=_as_int\\(p\\["seq"\\], f"\\{where\\}\\.pieces\\[\\{k\\}\\]\\.seq"\\),  ->  Piece\\(seq=_as_int\\(p\\["seq"\\], None\\),$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^start=_as_int\\(p\\["start"\\], f"\\{where\\}\\.pieces\\[\\{k\\}\\]\\.start"\\),  ->  start=_as_int\\(p\\["start"\\], None\\),$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^seqs = mb\\["seqs"\\] if "seqs" in mb else _seqs_of\\(pieces\\)  ->  seqs = mb\\["seqs"\\] if \\("seqs" in mb\\) or True else _seqs_of\\(pieces\\)$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^seqs = mb\\["seqs"\\] if "seqs" in mb else _seqs_of\\(pieces\\)  ->  seqs = mb\\["seqs"\\] if "seqs" in mb else _seqs_of\\(None\\)$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^pair = _as_list\\(mb\\["chunk"\\], f"\\{where\\}\\.chunk"\\)  ->  pair = _as_list\\(mb\\["chunk"\\], None\\)$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^chunk = \\(_as_int\\(pair\\[0\\], f"\\{where\\}\\.chunk"\\), _as_int\\(pair\\[1\\], f"\\{where\\}\\.chunk"\\)\\)  ->  chunk = \\(_as_int\\(pair\\[0\\], None\\), _as_int\\(pair\\[1\\], f"\\{where\\}\\.chunk"\\)\\)$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^chunk = \\(_as_int\\(pair\\[0\\], f"\\{where\\}\\.chunk"\\), _as_int\\(pair\\[1\\], f"\\{where\\}\\.chunk"\\)\\)  ->  chunk = \\(_as_int\\(pair\\[0\\], f"\\{where\\}\\.chunk"\\), _as_int\\(pair\\[1\\], None\\)\\)$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^offload_ratio=_as_number\\(mb\\.get\\("offload_ratio", 0\\.0\\), f"\\{where\\}\\.offload_ratio"\\),  ->  offload_ratio=_as_number\\(mb\\.get\\("offload_ratio", None\\), f"\\{where\\}\\.offload_ratio"\\),$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^offload_ratio=_as_number\\(mb\\.get\\("offload_ratio", 0\\.0\\), f"\\{where\\}\\.offload_ratio"\\),  ->  offload_ratio=_as_number\\(mb\\.get\\("offload_ratio", \\), f"\\{where\\}\\.offload_ratio"\\),$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^offload_ratio=_as_number\\(mb\\.get\\("offload_ratio", 0\\.0\\), f"\\{where\\}\\.offload_ratio"\\),  ->  offload_ratio=_as_number\\(mb\\.get\\("offload_ratio", 1\\.0\\), f"\\{where\\}\\.offload_ratio"\\),$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^seqs=tuple\\(_as_int\\(x, f"\\{where\\}\\.seqs"\\) for x in _as_list\\(seqs, f"\\{where\\}\\.seqs"\\)\\),  ->  seqs=tuple\\(_as_int\\(x, None\\) for x in _as_list\\(seqs, f"\\{where\\}\\.seqs"\\)\\),$',
     _PLAN_JSON),
    ("*planner.plan.x__micro_batch_from_dict__*", '^seqs=tuple\\(_as_int\\(x, f"\\{where\\}\\.seqs"\\) for x in _as_list\\(seqs, f"\\{where\\}\\.seqs"\\)\\),  ->  seqs=tuple\\(_as_int\\(x, f"\\{where\\}\\.seqs"\\) for x in _as_list\\(seqs, None\\)\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^p2p_bytes=_as_int\\(est\\["p2p_bytes"\\], "estimate\\.p2p_bytes"\\),  ->  p2p_bytes=_as_int\\(est\\["p2p_bytes"\\], "XXestimate\\.p2p_bytesXX"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^p2p_bytes=_as_int\\(est\\["p2p_bytes"\\], "estimate\\.p2p_bytes"\\),  ->  p2p_bytes=_as_int\\(est\\["p2p_bytes"\\], "ESTIMATE\\.P2P_BYTES"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^extra=\\{k: v for k, v in est\\.items\\(\\) if k not in known\\},  ->  extra=\\{k: v for k, v in est\\.items\\(\\) if k in known\\},$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^estimate=estimate,  ->  estimate=None,$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  $',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^estimate=estimate,  ->  $',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "pp_size"\\),  ->  pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "pp_size"\\),  ->  pp_size=_as_int\\(data\\.get\\("pp_size", None\\), "pp_size"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "pp_size"\\),  ->  pp_size=_as_int\\(data\\.get\\("pp_size", \\), "pp_size"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "pp_size"\\),  ->  pp_size=_as_int\\(data\\.get\\("pp_size", 2\\), "pp_size"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "pp_size"\\),  ->  pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "XXpp_sizeXX"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "pp_size"\\),  ->  pp_size=_as_int\\(data\\.get\\("pp_size", 1\\), "PP_SIZE"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "layers_per_stage"\\),  ->  layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "layers_per_stage"\\),  ->  layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", None\\), "layers_per_stage"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "layers_per_stage"\\),  ->  layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", \\), "layers_per_stage"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "layers_per_stage"\\),  ->  layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 2\\), "layers_per_stage"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "layers_per_stage"\\),  ->  layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "XXlayers_per_stageXX"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "layers_per_stage"\\),  ->  layers_per_stage=_as_int\\(data\\.get\\("layers_per_stage", 1\\), "LAYERS_PER_STAGE"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  virtual_pipeline_size=_as_int\\(data\\.get\\(None, 1\\), "virtual_pipeline_size"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  virtual_pipeline_size=_as_int\\(data\\.get\\("XXvirtual_pipeline_sizeXX", 1\\), "virtual_pipeline_size"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  virtual_pipeline_size=_as_int\\(data\\.get\\("VIRTUAL_PIPELINE_SIZE", 1\\), "virtual_pipeline_size"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "XXvirtual_pipeline_sizeXX"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "virtual_pipeline_size"\\),  ->  virtual_pipeline_size=_as_int\\(data\\.get\\("virtual_pipeline_size", 1\\), "VIRTUAL_PIPELINE_SIZE"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^ep_size=_as_int\\(data\\.get\\("ep_size", 1\\), "ep_size"\\),  ->  ep_size=_as_int\\(data\\.get\\("ep_size", 1\\), None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^ep_size=_as_int\\(data\\.get\\("ep_size", 1\\), "ep_size"\\),  ->  ep_size=_as_int\\(data\\.get\\("ep_size", 1\\), "XXep_sizeXX"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^ep_size=_as_int\\(data\\.get\\("ep_size", 1\\), "ep_size"\\),  ->  ep_size=_as_int\\(data\\.get\\("ep_size", 1\\), "EP_SIZE"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^align=_as_int\\(data\\.get\\("align", 1\\), "align"\\),  ->  align=_as_int\\(data\\.get\\("align", 1\\), None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^align=_as_int\\(data\\.get\\("align", 1\\), "align"\\),  ->  align=_as_int\\(data\\.get\\("align", None\\), "align"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^align=_as_int\\(data\\.get\\("align", 1\\), "align"\\),  ->  align=_as_int\\(data\\.get\\("align", \\), "align"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^align=_as_int\\(data\\.get\\("align", 1\\), "align"\\),  ->  align=_as_int\\(data\\.get\\("align", 2\\), "align"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^align=_as_int\\(data\\.get\\("align", 1\\), "align"\\),  ->  align=_as_int\\(data\\.get\\("align", 1\\), "XXalignXX"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^align=_as_int\\(data\\.get\\("align", 1\\), "align"\\),  ->  align=_as_int\\(data\\.get\\("align", 1\\), "ALIGN"\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^rank=_as_int\\(r\\["rank"\\], f"ranks\\[\\{i\\}\\]\\.rank"\\),  ->  rank=_as_int\\(r\\["rank"\\], None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^Sequence\\(id=_as_int\\(s\\["id"\\], f"sequences\\[\\{k\\}\\]\\.id"\\),  ->  Sequence\\(id=_as_int\\(s\\["id"\\], None\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^for k, s in enumerate\\(_as_list\\(data\\["sequences"\\], "sequences"\\)\\)  ->  for k, s in enumerate\\(_as_list\\(data\\["sequences"\\], None\\)\\)$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^for k, s in enumerate\\(_as_list\\(data\\["sequences"\\], "sequences"\\)\\)  ->  for k, s in enumerate\\(_as_list\\(data\\["sequences"\\], "XXsequencesXX"\\)\\)$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^for k, s in enumerate\\(_as_list\\(data\\["sequences"\\], "sequences"\\)\\)  ->  for k, s in enumerate\\(_as_list\\(data\\["sequences"\\], "SEQUENCES"\\)\\)$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^known = \\{"step_time_s", "rank_time_s", "p2p_bytes"\\}  ->  known = \\{"XXstep_time_sXX", "rank_time_s", "p2p_bytes"\\}$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^known = \\{"step_time_s", "rank_time_s", "p2p_bytes"\\}  ->  known = \\{"STEP_TIME_S", "rank_time_s", "p2p_bytes"\\}$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^known = \\{"step_time_s", "rank_time_s", "p2p_bytes"\\}  ->  known = \\{"step_time_s", "XXrank_time_sXX", "p2p_bytes"\\}$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^known = \\{"step_time_s", "rank_time_s", "p2p_bytes"\\}  ->  known = \\{"step_time_s", "RANK_TIME_S", "p2p_bytes"\\}$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^known = \\{"step_time_s", "rank_time_s", "p2p_bytes"\\}  ->  known = \\{"step_time_s", "rank_time_s", "XXp2p_bytesXX"\\}$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^known = \\{"step_time_s", "rank_time_s", "p2p_bytes"\\}  ->  known = \\{"step_time_s", "rank_time_s", "P2P_BYTES"\\}$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^extra=\\{k: v for k, v in est\\.items\\(\\) if k not in known\\},  ->  extra=None,$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^enumerate\\(_as_list\\(est\\["rank_time_s"\\], "estimate\\.rank_time_s"\\)\\)\\),  ->  enumerate\\(_as_list\\(est\\["rank_time_s"\\], None\\)\\)\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^enumerate\\(_as_list\\(est\\["rank_time_s"\\], "estimate\\.rank_time_s"\\)\\)\\),  ->  enumerate\\(_as_list\\(est\\["rank_time_s"\\], "XXestimate\\.rank_time_sXX"\\)\\)\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^enumerate\\(_as_list\\(est\\["rank_time_s"\\], "estimate\\.rank_time_s"\\)\\)\\),  ->  enumerate\\(_as_list\\(est\\["rank_time_s"\\], "ESTIMATE\\.RANK_TIME_S"\\)\\)\\),$',
     _PLAN_JSON),
    ("*planner.plan.xǁStepPlanǁfrom_dict__*", '^p2p_bytes=_as_int\\(est\\["p2p_bytes"\\], "estimate\\.p2p_bytes"\\),  ->  p2p_bytes=_as_int\\(est\\["p2p_bytes"\\], None\\),$',
     _PLAN_JSON),
    ("*pp_balance.x__place_runs__*", r"^threshold = max_t - delta \* max_t  ->  threshold = max_t \+ delta \* max_t$",
     "tests/planner/test_planner_pp_balance.py::test_only_pipelines_below_the_threshold_take_work_while_one_exists"),
    ("*placement.xǁFreeRanksǁtake__*", '^if len\\(buckets\\[g\\]\\) >= whole:  ->  if len\\(buckets\\[g\\]\\) > whole:$',
     "tests/planner/test_ring_placer.py"),
    ("*placement.xǁFreeRanksǁtake__*", '^fit = next\\(\\(k for c in range\\(rest, g \\+ 1\\)  ->  fit = next\\(\\(k for c in range\\(rest, g - 1\\)$',
     "tests/planner/test_ring_placer.py"),
    ("*placement.xǁFreeRanksǁtake__*", '^whole, rest = divmod\\(d, g\\) if d > g else \\(0, d\\)  ->  whole, rest = divmod\\(d, g\\) if \\(d > g\\) and False else \\(0, d\\)$',
     "tests/planner/test_ring_placer.py"),
    ("*placement.xǁFreeRanksǁtake__*", '^if left <= 0:  ->  if left < 0:$',
     "tests/planner/test_ring_placer.py"),
    ("*placement.xǁFreeRanksǁtake__*", '^if len\\(plan\\) > self\\.topology\\.min_nodes\\(d\\) and not fallback:  ->  if len\\(plan\\) >= self\\.topology\\.min_nodes\\(d\\) and not fallback:$',
     "tests/planner/test_ring_placer.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):  ->  if len\\(p\\.ring\\) == 1 or k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):  ->  if len\\(p\\.ring\\) != 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):  ->  if len\\(p\\.ring\\) == 2 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):  ->  if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(None, -1\\):$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], -1\\):  ->  if len\\(p\\.ring\\) == 1 and k > last_ring\\.get\\(p\\.ring\\[0\\], \\+1\\):$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if r not in first or t < first\\[r\\]\\[0\\]:  ->  if r not in first or t <= first\\[r\\]\\[0\\]:$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if r not in first or t < first\\[r\\]\\[0\\]:  ->  if r not in first or t < first\\[r\\]\\[1\\]:$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if not last_ring\\.keys\\(\\) <= first\\.keys\\(\\):  ->  if not last_ring\\.keys\\(\\) < first\\.keys\\(\\):$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) > 1:  ->  if len\\(p\\.ring\\) >= 1:$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if len\\(p\\.ring\\) > 1:  ->  if len\\(p\\.ring\\) > 2:$',
     "tests/planner/test_pp_short_first.py"),
    ("*pp_balance.x_short_first__*", '^if not last_ring:  ->  if last_ring:$',
     "tests/planner/test_pp_short_first.py"),
    ("*offload_storage.x__gaps__*", '^gaps\\.append\\(\\(at, p\\.start\\)\\)  ->  gaps\\.append\\(None\\)$',
     _UNITS),
    ("*offload_storage.x__gaps__*", '^if p\\.end <= at or p\\.start >= hi:  ->  if p\\.end <= at and p\\.start >= hi:$',
     _UNITS),
    ("*offload_storage.x_storage_bytes__*", '^flat = torch\\.empty\\(0, dtype=torch\\.uint8, device=device\\)  ->  flat = torch\\.empty\\(0, dtype=torch\\.uint8, device=None\\)$',
     _UNITS),
    ("*offload_storage.x_storage_bytes__*", '^flat = torch\\.empty\\(0, dtype=torch\\.uint8, device=device\\)  ->  flat = torch\\.empty\\(0, dtype=torch\\.uint8, \\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^src = storage_bytes\\(tensor\\.untyped_storage\\(\\), tensor\\.device\\)  ->  src = storage_bytes\\(tensor\\.untyped_storage\\(\\), None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^if mid > lo:  # the host wins: tails inside \\[lo, mid\\) are copied out and dropped  ->  if mid >= lo:  # the host wins: tails inside \\[lo, mid\\) are copied out and dropped$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for p in \\[p for p in self\\.pieces if not p\\.on_host and p\\.start < mid and p\\.end > lo\\]:  ->  for p in \\[p for p in self\\.pieces if not p\\.on_host and p\\.start <= mid and p\\.end > lo\\]:$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for p in \\[p for p in self\\.pieces if not p\\.on_host and p\\.start < mid and p\\.end > lo\\]:  ->  for p in \\[p for p in self\\.pieces if not p\\.on_host and p\\.start < mid and p\\.end >= lo\\]:$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\.pieces\\.remove\\(p\\)  ->  self\\.pieces\\.remove\\(None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^owner\\.untrack_storage\\(p\\.tail\\)  ->  owner\\.untrack_storage\\(None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(None, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(p\\.start, None\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(p\\.start, \\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(None, mid\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, None\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(mid\\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, mid\\), p\\.end\\)\\):  ->  for s, e in \\(\\(p\\.start, max\\(p\\.start, lo\\)\\), \\(min\\(p\\.end, \\), p\\.end\\)\\):$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^if e > s:  ->  if e >= s:$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\._add_tail\\(src, s, e\\)  ->  self\\._add_tail\\(None, s, e\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\._add_tail\\(src, s, e\\)  ->  self\\._add_tail\\(src, None, e\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\._add_tail\\(src, s, e\\)  ->  self\\._add_tail\\(src, s, None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\._add_tail\\(src, s, e\\)  ->  self\\._add_tail\\(s, e\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\._add_tail\\(src, s, e\\)  ->  self\\._add_tail\\(src, e\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^self\\._add_tail\\(src, s, e\\)  ->  self\\._add_tail\\(src, s, \\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁcover__*", '^piece\\.buffer = owner\\.pool\\.acquire\\(e - s\\)  ->  piece\\.buffer = owner\\.pool\\.acquire\\(e \\+ s\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁis_storage__*", '^return not self\\.ref\\.expired\\(\\) and StorageWeakRef\\(storage\\) == self\\.ref  ->  return not self\\.ref\\.expired\\(\\) or StorageWeakRef\\(storage\\) == self\\.ref$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁmake_resident__*", '^self\\.full = storage_bytes\\(tensor\\.untyped_storage\\(\\), tensor\\.device\\)  ->  self\\.full = storage_bytes\\(tensor\\.untyped_storage\\(\\), None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁmake_resident__*", '^owner\\.pool\\.release\\(p\\.buffer, ready=p\\.event\\)  ->  owner\\.pool\\.release\\(p\\.buffer, ready=None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁmake_resident__*", '^owner\\.pool\\.release\\(p\\.buffer, ready=p\\.event\\)  ->  owner\\.pool\\.release\\(p\\.buffer, \\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁmake_resident__*", '^owner\\.untrack_storage\\(p\\.tail\\)  ->  owner\\.untrack_storage\\(None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁreload__*", '^device=owner\\.device\\)  ->  device=None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁreload__*", '^device=owner\\.device\\)  ->  \\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁreload__*", '^full = torch\\.empty\\(max\\(p\\.end for p in self\\.pieces\\) - self\\.base, dtype=torch\\.uint8,  ->  full = torch\\.empty\\(max\\(p\\.end for p in self\\.pieces\\) \\+ self\\.base, dtype=torch\\.uint8,$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁunheld_bytes__*", '^return sum\\(e - s for s, e in _gaps\\(self\\.pieces, lo, hi\\)\\)  ->  return sum\\(e \\+ s for s, e in _gaps\\(self\\.pieces, lo, hi\\)\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁview__*", '^size, stride\\)  ->  size, None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁview__*", '^size, stride\\)  ->  size, \\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁview__*", '^return out\\.set_\\(self\\.full\\.untyped_storage\\(\\), \\(offset_bytes - self\\.base\\) // element,  ->  return out\\.set_\\(self\\.full\\.untyped_storage\\(\\), \\(offset_bytes \\+ self\\.base\\) // element,$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁview__*", '^out = torch\\.empty\\(0, dtype=dtype, device=self\\.full\\.device\\)  ->  out = torch\\.empty\\(0, dtype=dtype, device=None\\)$',
     _UNITS),
    ("*offload_storage.xǁOffloadedStorageǁview__*", '^out = torch\\.empty\\(0, dtype=dtype, device=self\\.full\\.device\\)  ->  out = torch\\.empty\\(0, dtype=dtype, \\)$',
     _UNITS),
    ("*offload_storage.xǁSavedActivationǁ__del____*", '^if self\\.kept is not None and self\\.tracked:  ->  if self\\.kept is not None or self\\.tracked:$',
     _UNITS),
    ("*.balance.x__plan_balance__*", r"floor > best\[0\] \* \(1 \+ 1e-9\):  ->  .*floor > best\[1\]",
     _CHOICE + "test_skipping_by_the_floors_never_changes_the_plan"),
    ("*.balance.x__units_floor__*", r"return 0\.0  ->  return 1\.0",
     _CHOICE + "test_skipping_by_the_floors_never_changes_the_plan"),
    ("*.balance.x__best_dp_assignment__*", r"ctx\.nodes\)\[0\]  ->  ",
     _CHOICE + "test_the_fill_candidate_is_alg1_on_the_unwidened_units_and_the_nodes"),
    ("*.balance.x__best_pp_plan__*", r"ctx\.nodes\)\[0\]  ->  .*(None\)|, \))\[0\]",
     _CHOICE + "test_the_fill_candidate_is_alg1_on_the_unwidened_units_and_the_nodes"),
    ("*.balance.x__best_pp_plan__*", r"if u\.ring_size == 1\), ctx\.nodes\)\[0\]  ->  .*if u\.ring_size != 1\)",
     _CHOICE + "test_the_fill_candidate_is_alg1_on_the_unwidened_units_and_the_nodes"),
    ("*.balance.x__best_pp_plan__*", r"pool\.append\(\(\"fill\", fill, 0, base\)\)  ->  ",
     _CHOICE + "test_the_fill_candidate_is_alg1_on_the_unwidened_units_and_the_nodes"),
    ("*.balance.x__best_pp_plan__*", r"moved = short_first\(placements, units_of\)  ->  moved = None",
     _CHOICE + "test_the_1f1b_runs_are_pp_balance_with_the_fill_and_drain_of_the_stages"),
    ("*.balance.x__best_pp_plan__*", r"candidates\.append\(\(name \+ \"\+short-first\", moved, grown, units_of\)\)  ->  ",
     _CHOICE + "test_the_1f1b_runs_are_pp_balance_with_the_fill_and_drain_of_the_stages"),
    ("*.balance.x__best_pp_plan__*", r"fill_drain=request\.pp_size - 1, \*\*kw\), widened, units\)\]  ->  ",
     _CHOICE + "test_the_1f1b_runs_are_pp_balance_with_the_fill_and_drain_of_the_stages"),
    ("*.balance.x__best_pp_plan__*", r"if request\.ep_size > 1 and request\.even_expert_slots and request\.pp_size == 1:  ->  ",
     _CHOICE + "test_expert_group_plans_are_evened_once_and_named_balance"),
    ("*.balance.x__best_pp_plan__*", r"plan = even_expert_slots\(plan, request, ctx\.cost_model, NAME\)  ->  ",
     _CHOICE + "test_expert_group_plans_are_evened_once_and_named_balance"),
    ("*.balance.x__plan_balance__*", r"if request\.ep_size > 1 and request\.even_expert_slots and request\.pp_size > 1:  ->  ",
     _CHOICE + "test_expert_group_plans_are_evened_once_and_named_balance"),
    ("*.balance.x__plan_balance__*", r"plan = even_expert_slots\(plan, request, cost_model, NAME\).*  ->  ",
     _CHOICE + "test_expert_group_plans_are_evened_once_and_named_balance"),
    ("*.balance.x__plan_balance__*", r"if request\.pp_size > 1 or request\.ep_size > 1:  .*  ->  .*request\.ep_size > 2:",
     "tests/planner/test_ep_slots.py"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*",
     r"if record is not None and not self\._eligible\(tensor\):  ->  if record is None and",
     _EDGES + "test_a_small_view_of_an_offloaded_storage_moves_no_bytes_of_its_own"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__mutmut_5", r"return 0  ->  return 1",
     _EDGES + "test_a_small_view_of_an_offloaded_storage_moves_no_bytes_of_its_own"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__mutmut_41", r"return 0  ->  return 1",
     _EDGES + "test_a_view_of_bytes_already_held_moves_nothing_more"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*", r"return \(hi - lo\) // size .*  ->  return \(hi \+ lo\)",
     _EDGES + "test_a_token_view_at_an_offset_offloads_its_share_of_its_own_span"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*",
     r"if self\._offloaded_whole < self\.ratio \* self\._eligible_whole - 1e-9:  ->  .*(\+ 1e-9|- 1\.000000001):",
     _EDGES + "test_whole_tensors_follow_the_running_fraction_to_the_byte"),
    ("*offload.xǁMicroBatchOffloadǁ_eligible__*", r"and nbytes >= self\.owner\.min_tensor_bytes\)  ->  and nbytes > ",
     _EDGES + "test_a_tensor_of_exactly_min_tensor_bytes_is_worth_a_copy"),
    ("*offload.xǁMicroBatchOffloadǁ_saved__*", r"if layer is not None and layer > record\.layer:.*  ->  if layer is None and",
     _EDGES + "test_a_storage_saved_again_in_later_layers_is_reloaded_ahead_of_the_last_one"),
    ("*offload.xǁMicroBatchOffloadǁ_saved__*", r"record\.layer = layer  ->  record\.layer = None",
     _EDGES + "test_a_storage_saved_again_in_later_layers_is_reloaded_ahead_of_the_last_one"),
    ("*offload.xǁMicroBatchOffloadǁ_saved__*", r"if host > 0:  ->  if host >= 0:",
     _EDGES + "test_whole_tensors_follow_the_running_fraction_to_the_byte"),
    ("*offload.xǁMicroBatchOffloadǁ_saved__*", r"_resident_storages\.add\(ptr\)  ->  .*\.add\(None\)",
     _EDGES + "test_a_storage_with_a_resident_view_stays_resident"),
    ("*offload.xǁMicroBatchOffloadǁ_saved__*", r"^record = None  ->  record = \"\"",
     "tests/runtime/test_runtime_offload_storage.py::test_a_new_storage_at_a_freed_storages_address_is_offloaded_on_its_own"),
    ("*offload.xǁMicroBatchOffloadǁ_saved__mutmut_38", r"SavedActivation\(self, tensor, layer, record\)  ->  return SavedActivation\(self, tensor, None, record\)",
     _EDGES + "test_a_layer_that_saves_only_views_of_earlier_storages_still_starts_the_reloads_below"),
    ("*offload.xǁMicroBatchOffloadǁreload_layer__*", r"self\.counters\.on_demand_reloads \+= 1  ->  ",
     _EDGES + "test_after_a_layer_that_saves_nothing_a_layer_reloads_on_demand_all_at_once"),
    ("*offload.xǁMicroBatchOffloadǁ_eligible__*", r"return \(tensor\.is_floating_point\(\) and .*  ->  return \(tensor\.is_floating_point\(\) or ",
     _EDGES + "test_integer_tensors_are_never_offloaded"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*", r"new = hi - lo if record is None else .*  ->  new = hi \+ lo if",
     _EDGES + "test_whole_tensors_follow_the_running_fraction_to_the_byte"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*", r"new = hi - lo if record is None else .*  ->  new = hi - lo if \(record is None\) or True",
     _EDGES + "test_a_view_of_bytes_already_held_moves_nothing_more"),
    ("*offload.xǁMicroBatchOffloadǁ_host_bytes__*",
     r"record\.unheld_bytes\(lo, hi\)  ->  .*record\.unheld_bytes\((None, hi|lo, None|hi|lo, )\)",
     _EDGES + "test_a_view_of_bytes_already_held_moves_nothing_more"),
    ("*config.xǁ_RecordedStoreǁ__call____*", r"if option_string and option_string not in given:  ->  if option_string or",
     "tests/integration/test_config.py::test_given_flags_lists_each_flag_on_the_command_line_once_in_order"),
]

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}


def _mutmut_config(target: Target) -> str:
    tests = "\n".join(f"    {t}" for t in target.tests)
    return (
        "[mutmut]\n"
        f"source_paths = {PKG}\n"
        f"only_mutate =\n    {target.file}\n"
        f"pytest_add_cli_args_test_selection =\n{tests}\n"
        "pytest_add_cli_args = -p no:cacheprovider\n"
        "also_copy =\n    pytest.ini\n"
        # torch is not fork-safe after use: fork every mutant from a clean server process
        "process_isolation = forkserver\n"
        "use_git_change_detection = false\n"
        # log lines and the text of error messages are not behaviour under test (tests match the
        # part of a message that names the value; the wording may improve freely)
        "do_not_mutate_patterns =\n    logger\\.\n    ^\\s*raise \\w+\\(\n"
        "    ^\\s*f?[\"'][^\"']*[\"']\\s*\\)*,?\\s*(#.*)?$\n"
    )


def _mutations(mutants_file: Path, module: str) -> dict[str, str]:
    """Every mutant of the file: full name -> "original line(s) -> mutated line(s)"."""
    tree = ast.parse(mutants_file.read_text(encoding="utf-8"))
    lines = mutants_file.read_text(encoding="utf-8").splitlines()
    bodies: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "__mutmut_" in node.name:
            bodies[node.name] = lines[node.lineno:node.end_lineno]  # without the def line
            bodies[node.name + ":def"] = [lines[node.lineno - 1].replace(node.name, "f", 1)]
    out = {}
    for name in bodies:
        if name.endswith(":def") or name.endswith("__mutmut_orig"):
            continue
        orig = name.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"
        if orig not in bodies:
            continue
        a = bodies[orig + ":def"] + bodies[orig]
        b = bodies[name + ":def"] + bodies[name]
        diff = [l for l in difflib.unified_diff(a, b, lineterm="", n=0) if not l.startswith(("---", "+++", "@@"))]
        minus = " / ".join(l[1:].strip() for l in diff if l.startswith("-"))
        plus = " / ".join(l[1:].strip() for l in diff if l.startswith("+"))
        out[f"{module}.{name}"] = f"{minus}  ->  {plus}"
    return out


def _touches(pattern: str, mutation: str) -> bool:
    """Whether the part of the original text that the mutation changes overlaps a match of
    ``pattern`` (a call line may carry the resume offset next to unrelated arguments)."""
    before, _, after = mutation.partition("  ->  ")
    i = 0
    while i < min(len(before), len(after)) and before[i] == after[i]:
        i += 1
    j = 0
    while j < min(len(before), len(after)) - i and before[-1 - j] == after[-1 - j]:
        j += 1
    lo, hi = i, max(i + 1, len(before) - j)
    return any(m.start() < hi and lo < m.end() for m in re.finditer(pattern, before))


def _justification(name: str, mutation: str) -> str | None:
    for glob, pattern, reason in EQUIVALENT:
        if fnmatch.fnmatch(name, glob) and re.search(pattern, mutation):
            return reason
    for glob, pattern, test in KILLED_SINCE:
        if fnmatch.fnmatch(name, glob) and re.search(pattern, mutation):
            return f"killed since by `{test}` (added after this run; the mutant planted by hand fails it)"
    return None


def _children_cpu_s() -> float:
    """User + system CPU seconds of every finished child process and their descendants."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _mutmut(python: str, work: Path, names: list[str], max_children: int, timeout_s: float) -> bool:
    """Run mutmut on ``names``; False if it ran past ``timeout_s`` (then it and its workers are
    stopped, and the mutants decided so far stay in its meta file: a partial result)."""
    with open(work / "mutmut.log", "a", encoding="utf-8") as log:
        # its own session, so that a timeout stops the fork server and the workers too
        proc = subprocess.Popen([python, "-m", "mutmut", "run", "--max-children", str(max_children), *names],
                                cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONWARNINGS="ignore"))
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait_s)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return False
    if code != 0:
        tail = (work / "mutmut.log").read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"mutmut failed in {work} (exit {code}):\n{tail}")
    return True


def run_target(python: str, target: Target, max_children: int, keep: bool, timeout_s: int,
               resume: Path | None = None):
    """(table row, survivor rows, timeout rows, unjustified count, mutants, seconds per mutant)
    of one target. ``timeout_s`` bounds the whole target; past it the mutants decided so far
    make a row marked PARTIAL with exact counts (the rest are "other", never survivors).

    ``resume``: the work folder a partial run of this target kept (``--keep``); only the mutants
    it has not decided run (the source must be unchanged since, or mutmut remakes them)."""
    deadline = time.monotonic() + timeout_s
    module = target.file[:-3].replace("/", ".")
    meta_file = Path(resume or "") / "mutants" / (target.file + ".meta")
    work = resume if resume is not None else Path(tempfile.mkdtemp(prefix=f"mutmut-{target.key}-"))
    keep = keep or resume is not None
    cpu_before = _children_cpu_s()
    try:
        if resume is not None and not meta_file.is_file():
            raise SystemExit(f"--resume {resume}: no {meta_file.relative_to(resume)} there")
        if resume is None:
            copy_tree(work)
            (work / "setup.cfg").write_text(_mutmut_config(target), encoding="utf-8")
            progress(f"{target.key}: generating mutants and mapping tests in {work}")
            # mutmut generates every mutant of the file, maps tests to functions and runs what
            # the names match; it insists on a match, so this first pass runs mutant 1 of each
            # function the target names (mutants of the file's other functions are never run)
            first = [f"{module}.{f}__mutmut_1" for f in target.functions]
            if not _mutmut(python, work, first, max_children, deadline - time.monotonic()):
                raise SystemExit(f"{target.key}: mapping the tests alone took over {timeout_s} s (--timeout)")
        mutations = _mutations(work / "mutants" / target.file, module)
        chosen = sorted(
            n for n, m in mutations.items()
            if any(fnmatch.fnmatch(n.rsplit("__mutmut_", 1)[0], f"{module}.{f}") for f in target.functions)
            and (target.lines is None or _touches(target.lines, m))
        )
        decided = json.loads((work / "mutants" / (target.file + ".meta")).read_text(encoding="utf-8"))
        todo = [n for n in chosen if decided["exit_code_by_key"].get(n) is None]  # the first pass ran some
        progress(f"{target.key}: running {len(todo)} of its {len(chosen)} mutants")
        start = time.perf_counter()
        finished = not todo or _mutmut(python, work, todo, max_children, deadline - time.monotonic())
        elapsed = time.perf_counter() - start
        meta = json.loads((work / "mutants" / (target.file + ".meta")).read_text(encoding="utf-8"))
        codes = {n: meta["exit_code_by_key"].get(n) for n in chosen}
        status = {n: STATUS.get(c, "suspicious" if c is not None else "not run") for n, c in codes.items()}
        count = {s: list(status.values()).count(s) for s in set(status.values())}
        ran = [n for n in chosen if status[n] != "not run"]
        # CPU seconds of mutmut and its workers per mutant run now: what the run costs on an
        # idle machine (wall time on a shared one says more about the other jobs)
        now_ran = [n for n in todo if status[n] != "not run"]
        # (after a timeout the stopped workers are not reaped by this process: no CPU figure)
        seconds = {"cpu_per_mutant": round((_children_cpu_s() - cpu_before) / max(1, len(now_ran)), 1)
                   if finished else None,
                   "wall_per_mutant": round(elapsed * max_children / max(1, len(now_ran)), 1),
                   "mutants_this_run": len(now_ran)}
        label = target.label if finished and len(ran) == len(chosen) else (
            f"{target.label} - PARTIAL: {len(ran)} of {len(chosen)} run")
        survivors, unjustified = [], 0
        timeouts = [[label, n.rsplit(".", 1)[-1], f"`{mutations[n]}`"] for n in chosen
                    if status[n] == "timeout"]
        for name in chosen:
            if status[name] in ("killed", "timeout", "not run"):  # a timeout: the mutant made a test hang
                continue
            reason = _justification(name, mutations[name])
            unjustified += reason is None
            survivors.append([label, name.rsplit(".", 1)[-1], f"`{mutations[name]}`",
                              f"{status[name]}: " + (reason or "**NOT JUSTIFIED**")])
        justified = len(survivors) - unjustified
        row = [label, len(chosen), count.get("killed", 0), count.get("timeout", 0),
               count.get("survived", 0), count.get("no tests", 0),
               len(chosen) - sum(count.get(s, 0) for s in ("killed", "timeout", "survived", "no tests")),
               justified, unjustified, f"{elapsed / 60:.1f}"]
        progress(f"{target.key}: {row}; per mutant: {seconds}")
        return row, survivors, timeouts, unjustified, len(chosen), seconds
    finally:
        if keep:
            progress(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _rejudge(state: dict) -> None:
    """Survivors of earlier runs judged again by the current :data:`EQUIVALENT` table (a reason
    added after a run applies to it; a row whose status says it was killed since keeps that, and so
    does a row of a target that is no longer in :data:`TARGETS`, e.g. one renamed when its module was
    split: its mutant names no longer say which module to judge them by)."""
    for entry in state.values():
        unjustified = 0
        for row in entry.get("survivors", []):
            status, _, old_reason = row[3].partition(": ")
            target = next((t for t in TARGETS if row[0].startswith(t.label)), None)
            name = f"{target.file[:-3].replace('/', '.')}.{row[1]}" if target else row[1]
            before = row[2].strip("`").partition("  ->  ")[0].split(" / ")[0]
            source = (ROOT / target.file).read_text(encoding="utf-8") if target else ""
            stale = target is not None and before not in source
            reason = ("stale: this line is no longer in the code (changed after this run); the "
                      "function's current code is in a later row" if stale else None)
            reason = reason or _justification(name, row[2].strip("`")) or (
                old_reason if old_reason != "**NOT JUSTIFIED**" and ("killed since" in old_reason or target is None)
                else None)
            row[3] = f"{status}: " + (reason or "**NOT JUSTIFIED**")
            unjustified += reason is None
        if "survivors" in entry and entry["row"][-3:-1] != [None, None]:
            entry["unjustified"] = unjustified
            entry["row"][-3] = len(entry["survivors"]) - unjustified
            entry["row"][-2] = unjustified


def run_mutmut(python: str, targets: list[Target], max_children: int, keep: bool,
               timeout_s: int, note: str = "", resume: Path | None = None) -> tuple[str, bool]:
    if targets and subprocess.run([python, "-c", "import mutmut"], capture_output=True).returncode != 0:
        raise SystemExit("mutmut is not installed: .venv/bin/pip install -e .[mutation] "
                         "(or pip install mutmut==3.8.1)")
    state = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.exists() else {}
    _rejudge(state)
    if not targets:
        RESULTS.write_text(json.dumps(state, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for target in targets:
        row, surv, hung, bad, n, seconds = run_target(python, target, max_children, keep, timeout_s, resume)
        before = state.get(target.key, {})
        if resume is not None and before.get("work") == str(resume):  # the run it continued: its minutes too
            row[-1] = f"{float(row[-1]) + float(before['row'][-1]):.1f}"
        # reread: another run of this script (other targets) may have written meanwhile
        if RESULTS.exists():
            state.update({k: v for k, v in json.loads(RESULTS.read_text(encoding="utf-8")).items()
                          if k != target.key})
        state[target.key] = {"row": row, "survivors": surv, "timeouts": hung, "unjustified": bad,
                             "mutants": n, "seconds_per_mutant": seconds,
                             "work": str(resume) if resume is not None else None,
                             "date": time.strftime("%Y-%m-%d"), "workers": max_children}
        RESULTS.write_text(json.dumps(state, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    # the table shows every target's latest run (``--targets`` reruns only some of them)
    known = [t.key for t in TARGETS if t.key in state]
    rows = [list(state[k]["row"]) for k in known]
    for row, key in zip(rows, known):
        target = next(t for t in TARGETS if t.key == key)
        if row[0].split(" - PARTIAL")[0] != target.label:  # e.g. before its module was split
            row[0] = f"{target.label} - STALE: last run as `{row[0]}`, on code since moved; rerun"
    survivors = [s for k in known for s in state[k]["survivors"]]
    timeouts = [t for k in known for t in state[k].get("timeouts", [])]
    unjustified = sum(state[k]["unjustified"] for k in known)
    total = sum(state[k]["mutants"] for k in known)
    minutes = sum(float(state[k]["row"][-1]) for k in known)
    workers = " or ".join(str(w) for w in sorted({state[k].get("workers", max_children) for k in known}))
    body = (
        "### Mutation check (mutmut)\n\n"
        f"`scripts/mutation_check.py --part mutmut`: mutmut 3 over the functions named in the script, "
        f"{total} mutants, {minutes:.0f} min of mutant runs with {workers} workers (plus about "
        "a minute per target to generate mutants and map tests); a timeout counts as detected (the "
        f"mutant made a test hang). Per-target results: `{RESULTS.relative_to(ROOT)}`. "
        + machine_line() + (f" {note}" if note else "") + "\n\n"
        + markdown_table(["module", "mutants", "killed", "timeout", "survived", "no test ran it", "other",
                          "equivalent (justified)", "unjustified", "minutes"], rows) + "\n"
    )
    if survivors:
        body += ("\nEvery mutant not detected, with the reason no test can detect it (mutants are "
                 "renumbered when the code changes; the mutation is what counts):\n\n"
                 + markdown_table(["module", "mutant", "mutation", "status: reason"], survivors) + "\n")
    if timeouts:
        body += ("\nThe mutants that timed out (counted as detected: a test ran past mutmut's limit, "
                 "usually a loop that no longer ends), so they can be checked by hand:\n\n"
                 + markdown_table(["module", "mutant", "mutation"], timeouts) + "\n")
    return body, unjustified == 0


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("both", "planted", "mutmut"), default="both")
    ap.add_argument("--targets", default="all",
                    help=f"comma-separated subset of: {', '.join(t.key for t in TARGETS)} (default all; "
                         "'none' runs nothing and rewrites the table from docs/mutation_check.json)")
    ap.add_argument("--max-children", type=int, default=2, help="mutmut workers (default 2)")
    ap.add_argument("--timeout", type=int, default=3600,
                    help="seconds per target (default 3600); past it the target's row is PARTIAL")
    ap.add_argument("--no-write", action="store_true", help="print the sections instead of writing docs/testing.md")
    ap.add_argument("--keep", action="store_true", help="keep mutmut's work folder (to inspect mutants)")
    ap.add_argument("--resume", type=Path, default=None,
                    help="continue the partial run of one target in the work folder it kept (--keep)")
    ap.add_argument("--note", default="", help="a remark on the machine for the tables (e.g. its load)")
    args = ap.parse_args()
    python = sys.executable
    ok = True
    if args.part in ("both", "planted"):
        body, caught = run_planted(python, timeout_s=900)
        ok &= caught
        body = body.replace(machine_line(), machine_line() + (f" {args.note}" if args.note else ""), 1)
        print(body) if args.no_write else write_section("planted", body, TESTING_MD)
    if args.part in ("both", "mutmut"):
        wanted = None if args.targets == "all" else set(args.targets.split(",")) - {"none"}
        unknown = (wanted or set()) - {t.key for t in TARGETS}
        if unknown:
            raise SystemExit(f"--targets: unknown {sorted(unknown)}; choose from {[t.key for t in TARGETS]}")
        targets = [t for t in TARGETS if wanted is None or t.key in wanted]
        if args.resume is not None and len(targets) != 1:
            raise SystemExit("--resume continues one target: name it with --targets")
        body, clean = run_mutmut(python, targets, args.max_children, args.keep, args.timeout, args.note,
                                 args.resume)
        ok &= clean
        print(body) if args.no_write else write_section("mutmut", body, TESTING_MD)
    if not ok:
        progress("a planted bug was not caught, or a surviving mutant is not justified (see the tables)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
