#!/usr/bin/env python
"""Mutation check of the core invariant modules; writes two sections of docs/testing.md.

A test suite is only as good as the bugs it catches. This script plants bugs and runs the tests
that should catch them, in a copy of the tree (the worktree is never modified):

1. ``planted``: the five bugs an audit once found the suite blind to (alignment ignored, order
   check dropped, balance widening to twice the lower bound, resume skipping samples instead of
   batches, bf16 ring accumulators), each planted by a textual edit, with the test files that
   must fail. Fast (~2-4 minutes): run it after changing the tests of those modules.
2. ``mutmut``: mutmut 3 (``pip install -e .[mutation]``) generates every mutant of the named
   functions of the core modules (zigzag split, ``StepPlan.validate``, execution order and
   deadlock check, the balance scheduler, the online-softmax merge, the token-level loss and
   model-config guard, the resume offset of the data path) and runs, for each, the tests that
   execute that function (in-process tests only: mutmut cannot see calls made inside spawned
   ranks, so every target here has an in-process test). Survivors must be killed by a test or
   listed in :data:`EQUIVALENT` with the reason they cannot be told apart; the script exits 1 if
   one is neither. ~10-25 minutes on 2 busy cores.

Neither part is in ``bash scripts/test.sh``.

Usage::

    .venv/bin/python scripts/mutation_check.py                 # both parts, writes docs/testing.md
    .venv/bin/python scripts/mutation_check.py --part planted  # only the five planted bugs
    .venv/bin/python scripts/mutation_check.py --part mutmut --targets zigzag,online_softmax
    .venv/bin/python scripts/mutation_check.py --no-write --keep   # print; keep the work folder
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
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
        (("megatron_bytescale/planner/schedulers/balance.py",
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
          '(getattr(args, "consumed_valid_samples", 0) or 0) // int(args.global_batch_size)',
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
                env=dict(os.environ, PYTHONWARNINGS="ignore"),
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
    """mutmut mutant-name globs (``x_<function>`` for functions, ``xǁClassǁmethod`` for methods)."""


def _globs(module: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{module}.{n}__mutmut_*" for n in names)


TARGETS = [
    Target("zigzag", "planner/zigzag.py", "megatron_bytescale/planner/zigzag.py",
           (f"{PKG}.planner.zigzag.*",)),
    Target("validate", "planner/plan.py (validate)", "megatron_bytescale/planner/plan.py",
           _globs(f"{PKG}.planner.plan", "x__validate", "x__check_piece_order", "x_resident_tokens")),
    Target("order", "planner/order.py (order, deadlock check)", "megatron_bytescale/planner/order.py",
           _globs(f"{PKG}.planner.order", "x_pipeline_ops", "x_rank_orders", "x__barrier_segments",
                  "x_simulate", "x_check_deadlock_free")),
    Target("balance", "planner/schedulers/balance.py", "megatron_bytescale/planner/schedulers/balance.py",
           (f"{PKG}.planner.schedulers.balance.*",)),
    Target("online_softmax", "runtime/online_softmax.py", "megatron_bytescale/runtime/online_softmax.py",
           (f"{PKG}.runtime.online_softmax.*",)),
    Target("loss", "integration/schedule.py (loss, config guard)", "megatron_bytescale/integration/schedule.py",
           _globs(f"{PKG}.integration.schedule", "x_token_level_loss", "x_check_model_config")),
    Target("resume_schedule", "integration/batch_schedule.py (resume offset)",
           "megatron_bytescale/integration/batch_schedule.py",
           (f"{PKG}.integration.batch_schedule.*",)),
    Target("resume_data", "integration/megatron_lm_data.py (resume offset)",
           "megatron_bytescale/integration/megatron_lm_data.py",
           _globs(f"{PKG}.integration.megatron_lm_data", "x_build_hdp_data_iterators", "x_budget_batches")),
]

# the in-process tests mutmut may run (it picks, per mutant, those that execute the function)
MUTMUT_TESTS = (
    "tests/planner/test_planner_zigzag.py",
    "tests/planner/test_planner_zigzag_splits.py",
    "tests/planner/test_planner_validate.py",
    "tests/planner/test_planner_order_estimate.py",
    "tests/planner/test_planner_balance_scale.py",
    "tests/planner/test_planner_schedulers.py",
    "tests/runtime/test_runtime_online_softmax.py",
    "tests/integration/test_token_loss.py",
    "tests/integration/test_guards.py",
    "tests/integration/test_resume_offset.py",
    "tests/integration/test_megatron_lm_data_semantics.py",
)

# Surviving mutants that no test can kill, with the reason. Keyed by (mutant-name glob, a regex
# the mutated line must match), so that renumbering after unrelated edits keeps them matched.
EQUIVALENT: list[tuple[str, str, str]] = []

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}


def _mutmut_config(targets: list[Target]) -> str:
    files = "\n".join(f"    {t.file}" for t in targets)
    tests = "\n".join(f"    {t}" for t in MUTMUT_TESTS if (ROOT / t).exists())
    return (
        "[mutmut]\n"
        f"source_paths = {PKG}\n"
        f"only_mutate =\n{files}\n"
        f"pytest_add_cli_args_test_selection =\n{tests}\n"
        "pytest_add_cli_args = -p no:cacheprovider\n"
        "also_copy =\n    pytest.ini\n"
        # torch is not fork-safe after use: fork every mutant from a clean server process
        "process_isolation = forkserver\n"
        "use_git_change_detection = false\n"
        # log lines are not behaviour
        "do_not_mutate_patterns =\n    logger\\.\n"
    )


def _mutated_line(python: str, work: Path, name: str) -> str:
    shown = subprocess.run([python, "-m", "mutmut", "show", name], cwd=work, capture_output=True,
                           text=True, timeout=120).stdout
    plus = [l[1:].strip() for l in shown.splitlines() if l.startswith("+") and not l.startswith("+++")]
    minus = [l[1:].strip() for l in shown.splitlines() if l.startswith("-") and not l.startswith("---")]
    return f"{' / '.join(minus)}  ->  {' / '.join(plus)}"


def _justification(name: str, line: str) -> str | None:
    for glob, pattern, reason in EQUIVALENT:
        if fnmatch.fnmatch(name, glob) and re.search(pattern, line):
            return reason
    return None


def run_mutmut(python: str, targets: list[Target], max_children: int, keep: bool,
               timeout_s: int) -> tuple[str, bool]:
    check = subprocess.run([python, "-c", "import mutmut"], capture_output=True)
    if check.returncode != 0:
        raise SystemExit("mutmut is not installed: .venv/bin/pip install -e .[mutation] "
                         "(or pip install mutmut==3.8.1)")
    work = Path(tempfile.mkdtemp(prefix="mutmut-"))
    try:
        copy_tree(work)
        (work / "setup.cfg").write_text(_mutmut_config(targets), encoding="utf-8")
        globs = [g for t in targets for g in t.functions]
        progress(f"mutmut in {work}: {len(targets)} targets, {max_children} workers (log: {work / 'mutmut.log'})")
        start = time.perf_counter()
        with open(work / "mutmut.log", "w", encoding="utf-8") as log:
            done = subprocess.run([python, "-m", "mutmut", "run", "--max-children", str(max_children), *globs],
                                  cwd=work, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=dict(os.environ, PYTHONWARNINGS="ignore"))
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            tail = (work / "mutmut.log").read_text(encoding="utf-8", errors="replace")[-3000:]
            raise SystemExit(f"mutmut failed (exit {done.returncode}):\n{tail}")
        results: dict[str, int | None] = {}
        for meta in (work / "mutants").rglob("*.meta"):
            results.update(json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"])
        rows, survivors, unjustified = [], [], 0
        for t in targets:
            mine = {n: c for n, c in results.items() if any(fnmatch.fnmatch(n, g) for g in t.functions)}
            status = [STATUS.get(c, "suspicious" if c is not None else "not run") for c in mine.values()]
            count = {s: status.count(s) for s in set(status)}
            # a timeout is a detection (the mutant made a test hang); the rest must be justified
            survived = sorted(n for n, c in mine.items() if STATUS.get(c) in ("survived", "no tests")
                              or c not in STATUS)
            justified = 0
            for name in survived:
                line = _mutated_line(python, work, name)
                reason = _justification(name, line)
                justified += reason is not None
                unjustified += reason is None
                survivors.append([t.label, name.rsplit(".", 1)[-1], f"`{line}`",
                                  f"{STATUS.get(mine[name], 'suspicious')}: " + (reason or "**NOT JUSTIFIED**")])
            rows.append([t.label, len(mine), count.get("killed", 0), count.get("timeout", 0),
                         count.get("survived", 0), count.get("no tests", 0),
                         count.get("suspicious", 0) + count.get("not run", 0) + count.get("skipped", 0),
                         justified, len(survived) - justified])
        body = (
            "### Mutation check (mutmut)\n\n"
            f"`scripts/mutation_check.py --part mutmut`: mutmut 3 over the functions named in the script, "
            f"{len(results)} mutants in {elapsed / 60:.1f} min with {max_children} workers. "
            + machine_line() + "\n\n"
            + markdown_table(["module", "mutants", "killed", "timeout (detected)", "survived",
                              "no test ran it", "other", "equivalent (justified)", "unjustified"], rows) + "\n"
        )
        if survivors:
            body += ("\nEvery mutant that was not killed, with the reason it cannot be (mutants are "
                     "renumbered when the code changes; the mutation is what counts):\n\n"
                     + markdown_table(["module", "mutant", "mutation", "status: reason"], survivors) + "\n")
        return body, unjustified == 0
    finally:
        if keep:
            progress(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("both", "planted", "mutmut"), default="both")
    ap.add_argument("--targets", default="all",
                    help=f"comma-separated subset of: {', '.join(t.key for t in TARGETS)} (default all)")
    ap.add_argument("--max-children", type=int, default=2, help="mutmut workers (default 2)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for the whole mutmut run")
    ap.add_argument("--no-write", action="store_true", help="print the sections instead of writing docs/testing.md")
    ap.add_argument("--keep", action="store_true", help="keep mutmut's work folder (to inspect mutants)")
    args = ap.parse_args()
    python = sys.executable
    ok = True
    if args.part in ("both", "planted"):
        body, caught = run_planted(python, timeout_s=900)
        ok &= caught
        print(body) if args.no_write else write_section("planted", body, TESTING_MD)
    if args.part in ("both", "mutmut"):
        wanted = None if args.targets == "all" else set(args.targets.split(","))
        unknown = (wanted or set()) - {t.key for t in TARGETS}
        if unknown:
            raise SystemExit(f"--targets: unknown {sorted(unknown)}; choose from {[t.key for t in TARGETS]}")
        targets = [t for t in TARGETS if wanted is None or t.key in wanted]
        body, clean = run_mutmut(python, targets, args.max_children, args.keep, args.timeout)
        ok &= clean
        print(body) if args.no_write else write_section("mutmut", body, TESTING_MD)
    if not ok:
        progress("a planted bug was not caught, or a surviving mutant is not justified (see the tables)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
