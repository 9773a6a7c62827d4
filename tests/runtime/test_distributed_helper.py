"""``testing.distributed.run_distributed``: ranks forked from a fork server that imported torch
and megatron-core once still see the caller's environment and working folder of the call, not
those of the server's start (what a spawned rank would see)."""

from __future__ import annotations

import os

from megatron_bytescale.testing.distributed import run_distributed


def _what_the_rank_sees(rank: int, world_size: int) -> tuple[int, str | None, str]:
    return rank, os.environ.get("BYTESCALE_TEST_MARK"), os.getcwd()


def test_ranks_see_the_environment_and_folder_of_the_call(tmp_path, monkeypatch):
    monkeypatch.delenv("BYTESCALE_TEST_MARK", raising=False)
    first = run_distributed(2, _what_the_rank_sees)  # the fork server runs from here on
    assert [(r, mark) for r, mark, _ in first] == [(0, None), (1, None)]
    monkeypatch.setenv("BYTESCALE_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    later = run_distributed(2, _what_the_rank_sees)
    assert later == [(r, "set after the server started", str(tmp_path)) for r in (0, 1)]
