#!/usr/bin/env python
"""Resuming the Megatron-LM document batches at step k: walking the k batches vs seeking.

Writes section ``resume`` of docs/benchmarks.md. ``pretrain_gpt.py --bytescale-hdp --load``
rebuilds its data iterator at step k = the checkpoint's consumed samples; every rank then
finds where global batch k starts in the seeded document stream
(``megatron_lm_data.budget_batches(skip_batches=k)``). Walking the stream looks at every
document of the k batches in Python; the seek (``data.batch_seek``) does one binary search per
batch over numpy arrays of each epoch's sequences. Both must give the same batch k (checked
here for every walked k; the tests check it over many small cases).

Data: 200,000 documents with log-normal lengths (median ~670 tokens, a web-text-like mix),
4M-token global batches (1,024 x 4,096, as ``--global-batch-size 1024 --seq-length 4096``),
context 4,096: about 3,400 documents per batch, an epoch every ~65 batches.

Usage: ``.venv/bin/python scripts/bench_resume.py [--walk-max 1000] [--no-write]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.integration.megatron_lm_data import (  # noqa: E402
    DocumentSource,
    budget_batches,
)

DOCUMENTS = 200_000
BUDGET = 1024 * 4096
CONTEXT = 4096
STEPS = (100, 1_000, 10_000, 100_000)


def progress(msg: str) -> None:
    print(f"[bench_resume] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walk-max", type=int, default=1_000,
                    help="walk only up to this many steps (default 1,000: ~10 µs per document)")
    ap.add_argument("--no-write", action="store_true",
                    help="print the section instead of writing it")
    args = ap.parse_args()

    lengths = (np.random.default_rng(0).lognormal(6.5, 1.2, DOCUMENTS) + 2).astype(np.int64)
    source = DocumentSource(name="bench", lengths=lengths, read=lambda d, s, n: np.zeros(n))
    kwargs = dict(tokens_per_batch=BUDGET, context_length=CONTEXT, seed=1234)
    load_before = os.getloadavg()[0]
    rows = []
    for k in STEPS:
        start = time.perf_counter()
        sought = next(budget_batches(source, skip_batches=k, **kwargs))
        seek_s = time.perf_counter() - start
        walk, same = "not run", "-"  # (extrapolated below)
        if k <= args.walk_max:
            start = time.perf_counter()
            walked = next(itertools.islice(budget_batches(source, **kwargs), k, None))
            walk_s = time.perf_counter() - start
            if walked.tokens_by_seq.pieces != sought.tokens_by_seq.pieces:
                raise SystemExit(f"step {k}: the seek's batch differs from the walk's")
            walk, same = f"{walk_s:.2f}", "yes"
            per_document = walk_s / (k * len(sought.lengths))
        visits = k * len(sought.lengths)
        progress(f"step {k:,}: seek {seek_s:.2f} s, walk {walk} s")
        rows.append([f"{k:,}", f"~{visits / 1e6:,.1f}M", walk, f"{seek_s:.2f}", same])
    walk_last = per_document * visits
    load_after = os.getloadavg()[0]
    table = markdown_table(["resume at step", "documents before it", "walk s", "seek s",
                            "same batch"], rows)
    title = "Resuming the Megatron-LM batches at step k: walk vs seek (`scripts/bench_resume.py`)"
    body = f"""## {title}

{machine_line()} Load average {load_before:.1f} before, {load_after:.1f} after (the machine is
shared).

{DOCUMENTS:,} documents (log-normal lengths), {BUDGET // 2**20}M-token global batches,
context {CONTEXT:,}: ~{len(sought.lengths):,} documents per batch. Time for a rank to reach
global batch k when `pretrain_gpt.py --load` resumes there (unweighted `--data-path`; a
weighted blend still walks, as its choice of dataset depends on every document before).

{table}

The walk costs {per_document * 1e6:.1f} µs per document here, so resuming at step
{STEPS[-1]:,} would walk for ~{walk_last / 60:.0f} min ({walk_last / seek_s:.0f}x the seek's
{seek_s:.0f} s). The seek does one binary search per batch and numpy passes over the
sequences of each epoch it crosses: still linear in the documents, but at numpy's speed.
"""
    if args.no_write:
        print(body)
    else:
        write_section("resume", body)
        progress("wrote section 'resume' of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
