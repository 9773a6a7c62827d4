"""Benchmark: the CPU demo's static DP x CP vs HDP naive vs HDP balance, three datasets, one run.

Runs ``bytescale demo`` once (one torchrun job, 4 CPU ranks) on the default corpus (Python
stdlib, one document per definition) and on the paper's GitHub-like and Byted-like length
mixes, then writes the comparison tables into the ``demo`` section of docs/benchmarks.md.
Extra arguments go to ``bytescale demo`` (e.g. ``--steps 20``). Rank 0 shows per-step lines
and a progress bar while it runs.

    .venv/bin/python scripts/bench_demo.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import IMG_DIR, machine_line, write_section  # noqa: E402

from megatron_bytescale.tools.demo_cmd import (  # noqa: E402
    build_parser,
    print_report,
    run_demo_job,
    settings_from_args,
)
from megatron_bytescale.tools.demo_report import benchmark_markdown  # noqa: E402

DATASETS = "stdlib,synthetic-github,synthetic-byted"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(["--data", DATASETS, "--out", "out/bench_demo", *argv])
    settings = settings_from_args(args)
    results = run_demo_job(settings)
    print_report(results, plot=True, out_dir=Path(settings.out_dir))
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(settings.out_dir) / "demo.png", IMG_DIR / "demo.png")
    body = benchmark_markdown(results, machine_line())
    body += "\n\n![loss curves and busy time per rank, per mode and dataset](img/demo.png)\n"
    write_section("demo", body)
    print("wrote section 'demo' of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
