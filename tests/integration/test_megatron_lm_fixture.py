"""The helpers that prepare and run the patched Megatron-LM tree (``testing/megatron_lm.py``)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time

import psutil
import pytest

from megatron_bytescale.testing.megatron_lm import (
    SHARED_TREE,
    find_megatron_lm_source,
    prepare_patched_megatron_lm,
    run_pretrain_gpt,
)


def test_the_shared_tree_is_found_from_below_the_folder_that_holds_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    tree = tmp_path / SHARED_TREE
    tree.mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    clone, worktree = tmp_path / "repo", tmp_path / "wt" / "branch"
    for start in (clone, worktree):
        start.mkdir(parents=True)
        assert find_megatron_lm_source(start) == tree.resolve()
    (tree / "pretrain_gpt.py").unlink()
    assert find_megatron_lm_source(clone) is None
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="MEGATRON_LM_DIR=.*nowhere.*no pretrain_gpt.py"):
        find_megatron_lm_source(clone)


def test_a_read_only_tree_is_copied_writable_and_patched_without_being_touched(
        patched_megatron_lm_tree, tmp_path):
    """CI lays shared/ without write bits: the copy must still take the patch."""
    clean = tmp_path / "read-only"
    shutil.copytree(patched_megatron_lm_tree.source, clean)
    modes = []
    for folder, _, files in os.walk(clean):
        for path in [folder, *(os.path.join(folder, f) for f in files)]:
            modes.append(path)
            os.chmod(path, os.stat(path).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        copy = prepare_patched_megatron_lm(clean, tmp_path / "copy")
        assert copy.apply.returncode == 0, copy.apply.stdout + copy.apply.stderr
        assert "megatron_bytescale" in (copy.root / "pretrain_gpt.py").read_text()
        assert "megatron_bytescale" not in (clean / "pretrain_gpt.py").read_text()
    finally:
        for path in reversed(modes):
            os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)


@pytest.mark.parametrize("launcher", ["fork", "torchrun"])
def test_a_run_that_times_out_leaves_no_process_behind(patched_megatron_lm, tmp_path, launcher):
    run = run_pretrain_gpt(patched_megatron_lm, "--help", ranks=2, cwd=tmp_path, timeout_s=4,
                           launcher=launcher)
    assert run.timed_out and run.returncode == 124
    left = [p.pid for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(tmp_path)]
    assert left == []


_RANK_SCRIPT = """
import os, sys, time
# One write per line: the ranks share one pipe, and under PYTHONUNBUFFERED=1 print() writes
# each of its arguments on its own, so two ranks' words could interleave.
line = " ".join(["RANK", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"],
                 os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], repr(sys.argv[1:])])
os.write(1, (line + "\\n").encode())
if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
    raise SystemExit(3)
if os.environ.get("FAIL_RANK"):
    time.sleep(120)  # the launcher must stop this rank when the other one fails
"""


def _forked(tmp_path, ranks: int, **env: str) -> "subprocess.CompletedProcess[str]":
    """``cpu_pretrain.run_forked`` on a small script, in a process of its own (it forks)."""
    script = tmp_path / "ranks.py"
    script.write_text(_RANK_SCRIPT)
    code = ("import sys; from megatron_bytescale.testing.cpu_pretrain import run_forked; "
            f"sys.exit(run_forked({ranks}, [{str(script)!r}, '--flag', 'x'], grace_s=2))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=90, cwd=tmp_path, env={**os.environ, **env})


@pytest.mark.one_lane(reason="the test launcher's forking, the same with any megatron-core")
def test_forked_ranks_get_the_environment_torchrun_gives(tmp_path):
    run = _forked(tmp_path, 3)
    assert run.returncode == 0, run.stderr
    lines = sorted(x.split() for x in run.stdout.splitlines() if x.startswith("RANK"))
    assert [x[1:4] for x in lines] == [[str(r), str(r), "3"] for r in range(3)]
    assert len({x[5] for x in lines}) == 1 and all(x[4] == "127.0.0.1" for x in lines)
    assert all(x[6:] == ["['--flag',", "'x']"] for x in lines)


@pytest.mark.one_lane(reason="the test launcher's forking, the same with any megatron-core")
def test_a_failed_forked_rank_stops_the_others_and_gives_its_exit_code(tmp_path):
    start = time.monotonic()
    run = _forked(tmp_path, 2, FAIL_RANK="1")
    assert run.returncode == 3, run.stderr
    assert "rank 1 exited with 3; stopping the other ranks" in run.stderr
    assert time.monotonic() - start < 60  # not the surviving rank's 120 s sleep
    left = [p.pid for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(tmp_path)]
    assert left == []
