"""The helpers that prepare and run the patched Megatron-LM tree (``testing/megatron_lm.py``)."""

from __future__ import annotations

import os
import shutil
import stat

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


def test_a_run_that_times_out_leaves_no_process_behind(patched_megatron_lm, tmp_path):
    run = run_pretrain_gpt(patched_megatron_lm, "--help", ranks=2, cwd=tmp_path, timeout_s=4)
    assert run.timed_out and run.returncode == 124
    left = [p.pid for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(tmp_path)]
    assert left == []
