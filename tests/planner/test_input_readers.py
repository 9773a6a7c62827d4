"""The shared input readers (``planner/inputs.py``) at their boundaries: the deepest nesting and
longest integer accepted and the first refused, what counts as a line and as a decimal, which
values are integers. tests/planner/test_bad_inputs.py checks the commands end to end; these
pin each limit exactly, so an off-by-one in a limit fails here."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from megatron_bytescale.planner.inputs import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    bounded_int,
    check_regular_file,
    json_depth,
    loads_json,
    parse_decimal,
    read_text_file,
    split_lines,
)


def test_only_regular_files_pass(tmp_path):
    regular = tmp_path / "lengths.txt"
    regular.write_text("1\n")
    assert check_regular_file(str(regular), "lengths file") == regular
    os.mkfifo(tmp_path / "pipe")
    cases = [(tmp_path / "missing", f"cannot read lengths file '{tmp_path / 'missing'}': it does not exist"),
             (tmp_path, f"lengths file '{tmp_path}' is a directory; give a regular file"),
             (tmp_path / "pipe", f"lengths file '{tmp_path / 'pipe'}' is a FIFO (named pipe); give a regular file"),
             ("/dev/null", "lengths file '/dev/null' is a device; give a regular file")]
    for path, message in cases:
        with pytest.raises(ValueError) as info:
            check_regular_file(path, "lengths file")
        assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("mode, kind", [
    (stat.S_IFSOCK | 0o600, "a socket"), (stat.S_IFBLK | 0o600, "a device"),
    (0o600, "not a regular file"),  # no file type bits: what no Linux file system reports
])
def test_other_file_types_are_named(tmp_path, monkeypatch, mode, kind):
    path = tmp_path / "x"
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: os.stat_result((mode,) + tuple(real(tmp_path))[1:])
                        if str(p) == str(path) else real(p, *a, **k))
    with pytest.raises(ValueError, match=rf"^node map '{path}' is {kind}; give a regular file"):
        check_regular_file(path, "node map")


def test_text_files_are_read_up_to_their_limit(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"12345")
    assert read_text_file(path, "lengths file", max_bytes=5) == "12345"
    with pytest.raises(ValueError, match=r"larger than 4 bytes"):
        read_text_file(path, "lengths file", max_bytes=4)
    sparse = tmp_path / "sparse.txt"  # 1 TiB of holes: reading it whole would not fit in memory
    with open(sparse, "wb") as handle:
        handle.truncate(2**40)
    with pytest.raises(ValueError, match=r"larger than 10 bytes"):
        read_text_file(sparse, "lengths file", max_bytes=10)
    with pytest.raises(ValueError, match=rf"^cannot read lengths file '{tmp_path / 'none'}'"):
        read_text_file(tmp_path / "none", "lengths file", max_bytes=10)
    path.write_bytes("ab\u00e9".encode() + b"\xff")
    with pytest.raises(ValueError, match=r"is not text \(not UTF-8 at byte 4\)"):
        read_text_file(path, "lengths file", max_bytes=100)


@pytest.mark.parametrize("text, depth", [
    ("", 0), ("1", 0), ("[]", 1), ("[[1], {}]", 2), ('{"a": [[1]]}', 3),
    ('["[[[[", "]]"]', 1),  # brackets inside strings do not nest
    ('["\\"[[[["]', 1),  # nor after an escaped quote
])
def test_json_depth(text, depth):
    assert json_depth(text) == depth


def test_json_nesting_limit_is_exact():
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(deepest) == MAX_JSON_DEPTH
    assert loads_json(deepest, "plan") is not None
    # 64 deep with more than 64 brackets in all: accepted (the depth, not the count, decides)
    assert loads_json("[[]," + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "]", "plan")[0] == []
    # a character JSON cannot hold outside a string is measured, not raised over
    with pytest.raises(ValueError, match="nests 70 levels deep"):
        loads_json("[" * 70 + "\ud800", "plan")
    # many brackets side by side are shallow
    assert loads_json("[" + ", ".join(["[]"] * (MAX_JSON_DEPTH + 5)) + "]", "plan")[0] == []
    too_deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(ValueError, match=rf"^plan is not valid JSON here: it nests {MAX_JSON_DEPTH + 1} levels deep "
                                         rf"\(at most {MAX_JSON_DEPTH}\)"):
        loads_json(too_deep, "plan")
    objects = '{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(ValueError, match="nests 65 levels deep"):
        loads_json(objects, "cost model")


def test_json_integer_length_limit_is_exact():
    longest = "9" * MAX_INT_DIGITS
    assert loads_json(f"[{longest}, -{longest}]", "node map") == [int(longest), -int(longest)]
    assert loads_json('["' + "9" * 50 + '"]', "node map") == ["9" * 50]  # a string is no number
    assert loads_json("[1." + "0" * 50 + ", 1e" + "0" * 40 + "1]", "node map") == [1.0, 10.0]  # floats
    for text in (f"[1{longest}]", f"[-1{longest}]", f'{{"a": 1{longest}}}'):
        with pytest.raises(ValueError, match=rf"^node map holds a number of {MAX_INT_DIGITS + 1} digits "
                                             r"\((-19{10}|19{11})\.\.\.\): out of range "
                                             rf"\(at most {MAX_INT_DIGITS} digits\)"):
            loads_json(text, "node map")


def test_invalid_json_names_where():
    with pytest.raises(ValueError, match=r"^cost model is not valid JSON \(line 2, column 1: "):
        loads_json('{"a": 1,\n}', "cost model")
    with pytest.raises(ValueError, match=r"^cost model is not valid JSON"):
        loads_json('"\\ud800', "cost model")


@pytest.mark.parametrize("text, lines", [
    ("", []), ("\n", [""]), ("a", ["a"]), ("a\n", ["a"]), ("a\n\nb", ["a", "", "b"]),
    ("ab\r\ncd\r\n", ["ab", "cd"]), ("a\rb\n", ["a\rb"]),
    ("4096\x0c812\x0b1\x1c2\u20283\n", ["4096\x0c812\x0b1\x1c2\u20283"]),
])
def test_lines_split_only_at_newlines(text, lines):
    assert split_lines(text) == lines


@pytest.mark.parametrize("text, value", [
    ("12", 12), (" 12\t", 12), ("+5", 5), ("-5", -5), ("0", 0), ("9" * 19, int("9" * 19)),
])
def test_decimals(text, value):
    assert parse_decimal(text, "line 1") == value


@pytest.mark.parametrize("text, message", [
    ("5_000", "line 1: '5_000' is not an integer written in the digits 0-9"),
    ("1e6", "line 1: '1e6' is not an integer"),
    ("\u0664\u0660", "line 1: '\u0664\u0660' is not an integer"),
    ("", "line 1: '' is not an integer"),
    ("12\n", "line 1: '12\\n' is not an integer"),
    ("x" * 41, "line 1: '" + "x" * 37 + "...' is not an integer"),
    ("x" * 40, "line 1: '" + "x" * 40 + "' is not an integer"),
    ("X12", "line 1: 'X12' is not an integer"),
    ("1" + "0" * 19, "line 1: a number of 20 digits (100000000000...) is out of range (at most 19 digits)"),
    ("-1" + "0" * 19, "line 1: a number of 20 digits (-10000000000...) is out of range (at most 19 digits)"),
])
def test_not_decimals(text, message):
    with pytest.raises(ValueError) as info:
        parse_decimal(text, "line 1")
    assert str(info.value).startswith(message), str(info.value)


def test_the_digit_limit_is_a_parameter():
    assert parse_decimal("1" * 25, "x", max_digits=25) == int("1" * 25)
    with pytest.raises(ValueError, match="a number of 4 digits"):
        parse_decimal("1234", "x", max_digits=3)
    assert parse_decimal("123", "x", max_digits=3) == 123


def test_bounded_integers():
    assert bounded_int(5, "ranks", low=5, high=5) == 5
    assert bounded_int(np.int64(7), "ranks", low=0, high=7) == 7 and type(bounded_int(np.int64(7), "r", low=0, high=7)) is int
    for value, message in [
        (True, "ranks (True) must be an integer"),
        (3.0, "ranks (3.0) must be an integer"),
        ("3", "ranks ('3') must be an integer"),
        (4, "ranks (4) must be between 5 and 1,000"),
        (1001, "ranks (1001) must be between 5 and 1,000"),
        (10**29, f"ranks ({10**29}) must be between"),
        (10**30, "ranks (an integer of about 31 digits) must be between"),
        (-10**30, "ranks (an integer of about 31 digits) must be between"),
        ("y" * 61, "ranks ('" + "y" * 56 + "...) must be an integer"),
        ("y" * 58, "ranks ('" + "y" * 58 + "') must be an integer"),  # a repr of 60 characters
        ("y" * 59, "ranks ('" + "y" * 56 + "...) must be an integer"),  # 61
    ]:
        with pytest.raises(ValueError) as info:
            bounded_int(value, "ranks", low=5, high=1000)
        assert str(info.value) == message or str(info.value).startswith(message), str(info.value)
