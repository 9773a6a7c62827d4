#!/usr/bin/env python
"""Planning wait on the critical path: local loader vs the Ray loader, 16,384-rank plans.

Writes section ``loader`` of docs/benchmarks.md. One training process plays HDP rank 0 of a
16,384-rank job: it takes a step from ``HDPDataIterator`` and then "trains" for ``--step-s``
seconds (a sleep: a GPU-bound step leaves the host idle), for ``--steps`` steps of a 32M-token
Byted-like global batch (2M context, C = 8K, LLaMA-7B cost model, balance scheduler). The wait
is the wall time of ``next(iterator)``: everything the training thread waits for before it can
build its micro-batches (reading, planning, validating, hashing the plan, fetching tokens, and
the hand-over). Steady state = the steps after the first two.

Modes, side by side in one run:

* local, no prefetch: every rank reads the lengths and plans at the start of the step;
* local, prefetch 1: the same on a background thread of every rank, one step ahead;
* ray, no prefetch: the planner actor plans ahead, the rank fetches the plan and its tokens
  at the start of the step;
* ray, prefetch 1: the rank's fetch of step t+1 also runs while step t trains.

Usage: ``.venv/bin/python scripts/bench_loader.py [--steps 10] [--step-s 2] [--no-write]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from benchmarks_md import machine_line, markdown_table, write_section  # noqa: E402

from megatron_bytescale.data.hdp_iterator import HDPDataIterator  # noqa: E402
from megatron_bytescale.data.ray_loader import RayLoaderOptions  # noqa: E402
from megatron_bytescale.data.synthetic_batches import synthetic_global_batches  # noqa: E402
from megatron_bytescale.planner.presets import preset_cost_model  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402

RANKS = 16384
TOKENS = 32 * 2**20
CONTEXT = 2**21
CAPACITY = 8192
WARMUP = 2


class RankOf:
    """HDP rank ``rank`` of ``size`` without processes (what the iterator needs of a group)."""

    group, device = None, torch.device("cpu")

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def global_rank(self, hdp_rank: int) -> int:
        return hdp_rank

    def __int__(self) -> int:
        return self.rank


def progress(msg: str) -> None:
    print(f"[bench_loader] {msg}", file=sys.stderr, flush=True)


def run_mode(name: str, source, planner, *, dataloader: str, prefetch: int, steps: int,
             step_s: float) -> dict:
    iterator = HDPDataIterator(source, planner=planner, hdp=RankOf(0, RANKS), prefetch=prefetch,
                               dataloader=dataloader,
                               ray_options=RayLoaderOptions(num_readers=2, lookahead=2))
    waits, plan_s, tokens = [], [], []
    for i in range(steps):
        start = time.perf_counter()
        step = next(iterator)
        waits.append(time.perf_counter() - start)
        plan_s.append(step.plan_s)
        held = step.global_batch.tokens_by_seq
        tokens.append(getattr(held, "num_tokens", step.total_tokens))
        progress(f"{name}: step {step.index} waited {waits[-1] * 1e3:8.1f} ms "
                 f"(reading + planning {step.plan_s * 1e3:.0f} ms)")
        time.sleep(step_s)  # "training"
    iterator.close()
    steady = waits[WARMUP:]
    return {"first": waits[0], "median": statistics.median(steady), "max": max(steady),
            "plan_s": statistics.median(plan_s[WARMUP:]), "tokens": statistics.median(tokens)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per mode (default 10)")
    ap.add_argument("--step-s", type=float, default=2.0,
                    help="seconds one step trains (default 2; the cost model puts this step at ~29 s)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must be > {WARMUP} (the first {WARMUP} steps are warm-up)")

    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    source = functools.partial(synthetic_global_batches, dataset="byted", tokens_per_batch=TOKENS,
                               max_length=CONTEXT, steps=args.steps, seed=0, vocab_size=32000)
    planner = functools.partial(make_plan, scheduler="balance", hdp_size=RANKS,
                                capacity=CAPACITY, cost_model=preset_cost_model("llama-7b"),
                                context_length=CONTEXT)
    modes = [("local, no prefetch", "local", 0), ("local, prefetch 1", "local", 1),
             ("ray, no prefetch", "ray", 0), ("ray, prefetch 1", "ray", 1)]
    load_before = os.getloadavg()[0]
    results = {}
    for name, loader, prefetch in modes:
        progress(f"{name} ...")
        results[name] = run_mode(name, source, planner, dataloader=loader, prefetch=prefetch,
                                 steps=args.steps, step_s=args.step_s)
    load_after = os.getloadavg()[0]
    ray.shutdown()

    rows = [[name, f"{r['median'] * 1e3:.1f}", f"{r['max'] * 1e3:.1f}", f"{r['first'] * 1e3:.0f}",
             f"{r['plan_s'] * 1e3:.0f}", f"{r['tokens']:,.0f}"] for name, r in results.items()]
    table = markdown_table(
        ["loader", "wait ms (steady median)", "wait ms (steady max)", "first step ms",
         "read + plan (+ fetch) ms, off the path when prefetched", "tokens this rank received"],
        rows)
    body = f"""## Planning wait on the critical path: local vs Ray loader (`scripts/bench_loader.py`)

{machine_line()} Load average {load_before:.1f} before, {load_after:.1f} after (the machine is
shared). Ray {ray.__version__}, a local instance (2 CPUs), 2 reader actors, lookahead 2.

One training process as HDP rank 0 of **{RANKS:,} ranks**; each step is a {TOKENS // 2**20}M-token
Byted-like global batch (2M context, C = {CAPACITY:,}, LLaMA-7B cost model, balance
scheduler) and trains {args.step_s:g} s (a sleep). *Wait* is the wall time of
`next(iterator)`, steps {WARMUP + 1}-{args.steps}: what the training thread waits for before it
builds its micro-batches (reading, planning, validation, the deadlock check, the plan hash,
fetching the tokens).

{table}

How to read it: without prefetch the local loader puts reading and planning (about
{results['local, no prefetch']['plan_s'] * 1e3:.0f} ms here) on every step's critical path, and one step of
background planning hides it, but every rank plans every step (16,384 times the CPU) and its
source holds the whole batch ("tokens this rank received": all of them). The Ray loader plans
each step once, in its planner actor, and each rank receives only the tokens of its own
micro-batches (plus the label token after each zigzag part). Without prefetch the rank waits
for the plan's transfer (1.2 MB pickled at this size, ~0.1 s to unpickle), its token fetch,
and, whenever the planner actor is behind, for planning itself: here the actor shares 2 busy
cores with everything else and takes {results['ray, prefetch 1']['plan_s'] * 1e3:.0f} ms or more per step, close to the
{args.step_s:g} s step. With prefetch 1 (the default) the fetch of step t+1 runs while step t trains, and
the steady wait is the hand-over only: the goal of ~0 ms. On a real job the step is far longer
(the cost model puts this one at ~29 s on H100s) and the planner actor has a CPU of its own.
A single process consumes here; that the planner plans each step once however many ranks
fetch it, and that every rank gets the local loader's plans and tokens, is tested in
`tests/integration/test_ray_loader.py`.
"""
    if args.no_write:
        print(body)
    else:
        write_section("loader", body)
        progress("wrote section 'loader' of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
