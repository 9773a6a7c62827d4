"""Shared by the benchmark scripts: replace one named section of docs/benchmarks.md.

Each benchmark owns the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``, so
benchmarks can be rerun one at a time without disturbing the others' tables.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import os

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
IMG_DIR = BENCHMARKS_MD.parent / "img"
"""Plots referenced from docs/benchmarks.md (and the README)."""
HEADER = "# Benchmarks\n\nEvery table here is written by a script in `scripts/bench_*.py`; rerun it to refresh.\n"


def machine_line() -> str:
    """One line naming the machine, for the top of every table."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}."


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Write ``body`` as section ``name`` of ``path``, replacing an earlier version of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else HEADER
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
