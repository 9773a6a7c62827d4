"""`read_lengths` at its limits: each bound exactly, what each message names.

The bad-input table (`test_bad_inputs.py`) checks that each bad file is refused; here each
limit is checked on both sides (the largest length, the largest file, a NUL in a later chunk)
and each message for the words that tell the user what is wrong.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import megatron_bytescale.data.lengths as lengths_mod
from megatron_bytescale.data.lengths import LengthsFileError, read_lengths, write_lengths
from megatron_bytescale.planner.plan import MAX_SEQUENCE_LENGTH


def _file(tmp_path, text: str | bytes, name: str = "lengths.txt"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_the_longest_allowed_length_is_read_and_one_more_is_refused(tmp_path):
    assert read_lengths(_file(tmp_path, f"{MAX_SEQUENCE_LENGTH}\n")).tolist() == [MAX_SEQUENCE_LENGTH]
    assert read_lengths(_file(tmp_path, f"[{MAX_SEQUENCE_LENGTH}]")).tolist() == [MAX_SEQUENCE_LENGTH]
    with pytest.raises(LengthsFileError, match=r"line 1: length 1099511627777 is longer than"):
        read_lengths(_file(tmp_path, f"{MAX_SEQUENCE_LENGTH + 1}\n"))
    with pytest.raises(LengthsFileError, match=r"element 0: length 1099511627777 is longer than"):
        read_lengths(_file(tmp_path, f"[{MAX_SEQUENCE_LENGTH + 1}]"))


def test_a_length_of_the_most_digits_read_is_shown_in_full(tmp_path):
    """30 digits, the most either format reads (more are refused by the number reader)."""
    with pytest.raises(LengthsFileError, match=r"length " + "9" * 30 + " is longer"):  # 30 digits: in full
        read_lengths(_file(tmp_path, "[" + "9" * 30 + "]"))


def test_the_lengths_are_int64_and_write_lengths_reads_back(tmp_path):
    path = tmp_path / "w.txt"
    write_lengths(path, [3, 4096, 7])
    out = read_lengths(path)
    assert out.dtype == np.int64 and out.tolist() == [3, 4096, 7]
    assert read_lengths(_file(tmp_path, "[5, 6]", "j.json")).dtype == np.int64


def test_only_spaces_and_tabs_are_stripped_from_a_line(tmp_path):
    assert read_lengths(_file(tmp_path, " \t12\t \n")).tolist() == [12]
    for junk in ("\x0b", "\x0c", "\x1c", "\u00a0", "X"):
        with pytest.raises(LengthsFileError, match="line 1"):
            read_lengths(_file(tmp_path, f"12{junk}\n"))


def test_a_line_of_more_than_30_digits_is_refused_by_its_digit_count(tmp_path):
    with pytest.raises(LengthsFileError, match=r"number of 31 digits .*at most 30 digits"):
        read_lengths(_file(tmp_path, "1" * 31 + "\n"))


def test_the_file_is_read_in_bounded_chunks(tmp_path, monkeypatch):
    """Every read asks for at most one chunk, so a file far past the limit is refused after
    reading just past it, not after reading it whole."""
    import pathlib

    asked = []
    real_open = pathlib.Path.open

    def recording_open(self, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        real_read = handle.read

        class Handle:
            def read(self, n=-1):
                asked.append(n)
                return real_read(n)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.close()

        return Handle()

    big = _file(tmp_path, "1\n" * 1000)
    monkeypatch.setattr(lengths_mod, "_CHUNK_BYTES", 4)
    monkeypatch.setattr(lengths_mod, "MAX_FILE_BYTES", 8)
    monkeypatch.setattr(pathlib.Path, "open", recording_open)
    with pytest.raises(LengthsFileError, match="larger than"):
        read_lengths(big)
    assert asked == [4, 4, 4]


def test_json_is_recognised_after_leading_blanks(tmp_path):
    assert read_lengths(_file(tmp_path, "\n  [7, 8]")).tolist() == [7, 8]


@pytest.mark.parametrize("text, kind", [('{"a": 1}', "an object"), ("[[1]]", None)])
def test_a_json_that_is_not_a_list_of_integers_is_named(tmp_path, text, kind):
    with pytest.raises(LengthsFileError) as exc:
        read_lengths(_file(tmp_path, text, "x.json"))
    if kind:
        assert str(exc.value).endswith(f"got {kind}")
    else:
        assert "element 0" in str(exc.value)


def test_the_file_limit_holds_to_the_byte_across_chunks(tmp_path, monkeypatch):
    """With 4-byte chunks and a 12-byte limit: 12 bytes read (three chunks joined in order),
    13 refused naming the limit; a NUL in the third chunk named at its byte."""
    monkeypatch.setattr(lengths_mod, "_CHUNK_BYTES", 4)
    monkeypatch.setattr(lengths_mod, "MAX_FILE_BYTES", 12)
    assert read_lengths(_file(tmp_path, "123\n456\n789\n")).tolist() == [123, 456, 789]
    with pytest.raises(LengthsFileError, match=r"is larger than 0 MiB \(or endless\)"):
        read_lengths(_file(tmp_path, "123\n456\n7890\n"))
    with pytest.raises(LengthsFileError, match=r"a NUL byte at byte 9\)"):
        read_lengths(_file(tmp_path, b"123\n456\n7\x008\x00"))
    with pytest.raises(LengthsFileError, match=r"a NUL byte at byte 0\)"):
        read_lengths(_file(tmp_path, b"\x00123"))


def test_a_fifo_is_refused_as_a_lengths_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(LengthsFileError, match=r"^lengths file '"):
        read_lengths(fifo)
