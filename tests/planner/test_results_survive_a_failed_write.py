"""Results written at the end of a run survive a failed write: a temporary file and a rename
(an old file is never half-overwritten), else the results on stdout and one line naming where
they could not go."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_bytescale.tools import plan_cmd, simulate_cmd
from megatron_bytescale.tools.results_io import save_or_print, write_atomically


def test_a_failed_rename_keeps_the_old_file_and_prints_the_results(tmp_path, capsys, monkeypatch):
    path = tmp_path / "results.json"
    write_atomically(path, '{"old": 1}\n')

    def fail(*_args):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", fail)
    assert not save_or_print(path, '{"new": 2}\n', what="results JSON", prog="bytescale test")
    out, err = capsys.readouterr()
    assert out == '{"new": 2}\n'
    assert err.strip() == (f"bytescale test: could not write the results JSON to '{path}' (Read-only file "
                           "system); it is printed above on stdout instead")
    assert path.read_text() == '{"old": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary left


@pytest.mark.parametrize("main, argv", [
    (plan_cmd.main, ["--global-tokens", "200000", "--hdp-size", "16", "--context-length", "32768"]),
    (simulate_cmd.main, ["--global-tokens", "200000", "--hdp-size", "16", "--context-length", "32768",
                         "--variants", "static,balance"]),
])
def test_json_under_a_regular_file_is_printed_instead(tmp_path, capsys, main, argv):
    """An --json path whose parent is a file cannot be created, even by root."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "out.json"
    code = main([*argv, "--json", str(target), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "could not write the" in err and f"'{target}'" in err and "Traceback" not in err, err
    start = out.index("{")
    printed, _ = json.JSONDecoder().raw_decode(out[start:])
    assert printed["hdp_size"] == 16  # the whole JSON is on stdout


def test_the_results_go_through_a_hidden_temporary_next_to_them(tmp_path, monkeypatch):
    """The temporary is in the target's own folder (a rename across file systems would fail
    or copy), hidden and named after the target (a run killed mid-write leaves a file a user
    recognises and that no `*.json` glob picks up); missing folders are created."""
    target = tmp_path / "runs" / "a" / "results.json"
    real_replace = os.replace
    seen = []

    def spy(src, dst):
        seen.append((Path(src), Path(dst), Path(src).read_text(encoding="utf-8")))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_atomically(target, '{"tokens": 1}\n')
    (src, dst, text), = seen
    assert dst == target and src.parent == target.parent and text == '{"tokens": 1}\n'
    assert src.name.startswith(".results.json.") and src.name.endswith(".tmp"), src.name
    assert sorted(p.name for p in target.parent.iterdir()) == ["results.json"]


def test_saved_says_so_and_printed_text_ends_its_line(tmp_path, capsys, monkeypatch):
    assert save_or_print(tmp_path / "r.json", "{}", what="results JSON", prog="p") is True
    assert capsys.readouterr() == ("", "") and (tmp_path / "r.json").read_text() == "{}"

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    assert save_or_print(tmp_path / "r.json", '{"a": 1}', what="results JSON", prog="p") is False
    out, err = capsys.readouterr()
    assert out == '{"a": 1}\n' and err.startswith("p: could not write the results JSON")
