"""One rank of ``bytescale demo`` (started by torchrun; see :mod:`.demo_cmd`).

Every rank: joins the gloo group, installs the CPU stand-ins for megatron's CUDA calls,
initialises Megatron for HDP (CP = 1, DP = ranks), builds the same global batches, and trains
a small megatron-core GPT on them once per mode (static DP x CP, HDP naive, HDP balance) from
the same initial weights. HDP rank 0 calibrates the planner's cost model on this model and
broadcasts it. After every step the ranks' records are gathered on rank 0, which prints one
line per step and a progress bar, and at the end writes ``results.json`` for the launcher.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_bytescale.runtime.liveness import Heartbeat

from .demo_data import demo_global_batches, vocab_size_of
from .demo_process import PROGRESS_BAR_ENV, RESULTS_ENV, die_with_parent
from .demo_settings import DemoSettings

logger = logging.getLogger(__name__)

MODE_LABELS = {"static": "static DPxCP", "naive": "HDP naive", "balance": "HDP balance",
               "offload": "HDP offload"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescale-demo-worker")
    parser.add_argument(
        "--settings", required=True, help="DemoSettings JSON written by bytescale demo"
    )
    args = parser.parse_args(argv)
    die_with_parent()  # torchrun gone (killed) -> this worker goes too, never trains alone
    settings = DemoSettings.load(args.settings)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    timeout = timedelta(minutes=settings.distributed_timeout_minutes)
    dist.init_process_group("gloo", timeout=timeout)
    heartbeat = Heartbeat.from_env(rank=dist.get_rank(), world_size=dist.get_world_size()).start()
    try:
        try:
            results = run_demo(settings)
        except RuntimeError:  # a collective failed: name the rank that stopped answering
            if report_silent_ranks(heartbeat, timeout):
                return 1
            raise
        dist.barrier()  # every collective is done: a failed write below strands no other rank
        if dist.get_rank() == 0 and not hand_over_results(results, settings):
            return 1
    finally:
        heartbeat.stop()
        dist.destroy_process_group()
    return 0


def hand_over_results(results: dict[str, Any], settings: DemoSettings) -> bool:
    """Rank 0: write the results where the launcher reads them (``$BYTESCALE_DEMO_RESULTS``,
    else ``results.json`` and ``cost_model.json`` in the output directory, when the worker runs
    under a torchrun of the user's own); printed on stdout if that fails. Saved?"""
    from .results_io import save_or_print

    prog = "bytescale demo"
    text = json.dumps(results, indent=1) + "\n"
    if os.environ.get(RESULTS_ENV):
        return save_or_print(os.environ[RESULTS_ENV], text, what="results JSON", prog=prog)
    out = Path(settings.out_dir)
    saved = save_or_print(out / "results.json", text, what="results JSON", prog=prog)
    cost_model = json.dumps(results["calibration"]["cost_model"], indent=2) + "\n"
    return save_or_print(out / "cost_model.json", cost_model, what="cost model JSON", prog=prog) and saved


def report_silent_ranks(heartbeat: Heartbeat, timeout: timedelta) -> bool:
    """After a failed collective: if some ranks' heartbeats stopped, the lowest live rank says
    which (once for the job, not once per rank); returns whether any rank was silent."""
    silent = heartbeat.silent_ranks()
    if not silent:
        return False
    live = [r for r in range(heartbeat.world_size) if r not in silent]
    if live and heartbeat.rank == live[0]:
        who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
        print(
            f"bytescale demo: {who} did not answer within {timeout.total_seconds():g} s (the HDP "
            f"group timeout, --distributed-timeout-minutes) and {'is' if len(silent) == 1 else 'are'} "
            "not alive either (stopped, e.g. by SIGSTOP, or hung); the other ranks gave up. "
            "Raise --distributed-timeout-minutes if one step can legitimately take longer",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return True


def given_cost_model(path: str, num_layers: int) -> Any:
    """A :class:`Calibration` holding the cost model of ``path`` (no measurement)."""
    from megatron_bytescale.integration.calibration import Calibration
    from megatron_bytescale.planner.cost_model import CostModel

    cost_model = CostModel.load(path)
    if cost_model.num_layers != num_layers:
        raise SystemExit(
            f"--bytescale-cost-model {path} describes {cost_model.num_layers} layers, the demo "
            f"model has {num_layers}; pass --num-layers {cost_model.num_layers} or fit a new one"
        )
    return Calibration(
        cost_model=cost_model, time_samples=(), activation_samples=(),
        p2p_bandwidth=cost_model.p2p_bandwidth_intra, p2p_latency_s=cost_model.p2p_latency_s,
    )  # fmt: skip


def run_demo(settings: DemoSettings) -> dict[str, Any]:
    """Train every dataset x mode; return (on rank 0) everything the report needs."""
    from megatron_bytescale.integration.calibration import calibrate_cost_model
    from megatron_bytescale.integration.config import ByteScaleConfig
    from megatron_bytescale.integration.groups import initialize_hdp_model_parallel
    from megatron_bytescale.integration.training import (
        build_gpt_model,
        make_transformer_config,
        seed_model_parallel,
    )
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    if torch.cuda.is_available():
        raise SystemExit(
            "bytescale demo is the CPU demo (gloo, CPU stand-ins); this machine has CUDA"
        )
    enable_cpu_megatron()
    rank = dist.get_rank()
    config = ByteScaleConfig(
        hdp=True, capacity=settings.capacity, context_length=settings.context_length,
        offload=settings.offload, plan_mode=settings.plan_mode, align=settings.align,
        attention_backend=settings.attention_backend, check_plan_hash=settings.check_plan_hash,
        plan_prefetch=settings.plan_prefetch,
    )  # fmt: skip
    manager = initialize_hdp_model_parallel(
        attention_backend=config.ring_attention_backend,
        distributed_timeout_minutes=settings.distributed_timeout_minutes,
    )
    datasets = []
    for name in settings.datasets:
        batches, description = demo_global_batches(name, settings)
        datasets.append((name, batches, description))
    vocab_size = max(vocab_size_of(b) for _, b, _ in datasets)

    seed_model_parallel(settings.seed)
    torch.manual_seed(settings.seed)
    model_config = make_transformer_config(
        num_layers=settings.num_layers, hidden_size=settings.hidden_size,
        num_attention_heads=settings.num_attention_heads,
        num_query_groups=settings.num_query_groups, ffn_hidden_size=settings.ffn_hidden_size,
    )  # fmt: skip
    first = build_gpt_model(
        model_config, vocab_size=vocab_size, max_sequence_length=settings.context_length
    )
    initial_state = {
        k: (v.clone() if torch.is_tensor(v) else v) for k, v in first.state_dict().items()
    }
    head_dim = settings.hidden_size // settings.num_attention_heads
    if settings.cost_model:
        calibration = given_cost_model(settings.cost_model, settings.num_layers)
    else:
        calibration = calibrate_cost_model(
            first, manager, lengths=settings.effective_calibration_lengths,
            kv_bytes_per_token=2 * settings.num_query_groups * head_dim * 4, vocab_size=vocab_size,
        )  # fmt: skip
    del first

    printer = StepPrinter(
        enabled=rank == 0, total=len(datasets) * len(settings.modes) * settings.steps
    )
    printer.header(settings, calibration, manager.size)
    results: dict[str, Any] = {
        "settings": json.loads(settings.to_json()),
        "world_size": dist.get_world_size(),
        "cpu_count": os.cpu_count(),
        "vocab_size": vocab_size,
        "calibration": {
            "cost_model": calibration.cost_model.to_dict(),
            "time_samples": calibration.time_samples,
            "p2p_bandwidth": calibration.p2p_bandwidth,
            "p2p_latency_s": calibration.p2p_latency_s,
            # the ring terms' fit: (D, documents, tokens, seconds) with predictions before/after
            "ring_fit": None if getattr(calibration, "ring_fit", None) is None else {
                "samples": [list(x) for x in calibration.ring_fit.samples],
                "before": list(calibration.ring_fit.predicted_before),
                "after": list(calibration.ring_fit.predicted_after),
            },
        },
        "datasets": {},
    }
    for name, batches, description in datasets:
        runs = {
            mode: mode_steps(
                mode, name, batches, settings=settings, config=config, manager=manager,
                model_config=model_config, initial_state=initial_state, vocab_size=vocab_size,
                cost_model=calibration.cost_model, printer=printer,
            )  # fmt: skip
            for mode in settings.modes
        }
        rows: dict[str, list] = {mode: [] for mode in settings.modes}
        if settings.interleave_modes:
            # step 1 of every mode, then step 2 of every mode, ...: a machine whose load drifts
            # during the run slows every mode alike instead of whichever ran last
            for _ in range(settings.steps):
                for mode, run in runs.items():
                    rows[mode].append(next(run))
        else:
            for mode, run in runs.items():
                rows[mode] = list(run)
        modes = {mode: {"label": MODE_LABELS[mode], "steps": [r for r in rows[mode] if r is not None]}
                 for mode in settings.modes}
        results["datasets"][name] = {"description": description, "modes": modes}
    printer.finish()
    return results


def mode_steps(
    mode: str,
    dataset: str,
    batches: list,
    *,
    settings: DemoSettings,
    config: Any,
    manager: Any,
    model_config: Any,
    initial_state: dict,
    vocab_size: int,
    cost_model: Any,
    printer: "StepPrinter",
) -> Iterator[dict[str, Any] | None]:
    """Train ``settings.steps`` steps of one mode from the shared initial weights, yielding each
    step's row (rank 0; ``None`` on the other ranks) as soon as it is done.

    Nothing is built before the first ``next``; every rank must advance the modes in the same
    order (the steps are collective).

    Every mode runs with an activation offloader, so the saved activations each rank keeps
    resident are measured the same way everywhere; only the ``offload`` mode (HDP balance with
    selective offload) plans ratios above 0, the others keep everything on the "device".
    """
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.offload import activation_offloader
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.integration.training import build_gpt_model, wrap_for_hdp
    from megatron_bytescale.runtime import CommCounters, plan_p2p_bytes

    model = build_gpt_model(
        model_config, vocab_size=vocab_size, max_sequence_length=settings.context_length
    )
    model.load_state_dict(initial_state)
    ddp, optimizer = wrap_for_hdp(model, lr=settings.lr)
    offloader = activation_offloader(ddp, min_tensor_bytes=0)
    mode_config = dataclasses.replace(config, offload=mode == "offload",
                                      host_memory_gb=settings.host_memory_gb)
    planner = make_step_planner(
        mode_config, hdp_size=manager.size, cost_model=cost_model,
        scheduler="balance" if mode == "offload" else mode,
    )
    iterator = HDPDataIterator(
        batches, planner=planner, hdp=manager.hdp, plan_mode=config.plan_mode,
        check_plan_hash=config.check_plan_hash, prefetch=config.plan_prefetch,
    )  # fmt: skip
    counters = CommCounters()
    for _ in range(settings.steps):
        plan_start = time.perf_counter()
        step = next(iterator)
        plan_s = time.perf_counter() - plan_start
        record = run_hdp_step(
            step, model=ddp, optimizer=optimizer, manager=manager, counters=counters,
            offloader=offloader,
        )
        offload = record.offload
        mine = {
            "busy_s": record.busy_s, "reduce_wall_s": record.reduce_wall_s,
            "p2p_bytes": record.p2p_bytes, "tokens": record.tokens, "loss_sum": record.loss_sum,
            "micro_batches": len(record.micro_batches), "started_at": record.started_at,
            "done_at": record.micro_batches_done_at, "finished_at": record.finished_at,
            "plan_s": plan_s, "optimizer_wall_s": record.optimizer_wall_s,
            # per micro-batch: order, ring size, tokens held, CPU seconds, wall seconds
            "mb": [[m.order, m.ring_size, m.tokens, m.busy_s, m.wall_s] for m in record.micro_batches],
            # activation offload: peak resident saved bytes, bytes offloaded, reload wait seconds
            "offload": [offload.peak_resident_bytes, offload.offloaded_bytes, offload.reload_wait_s],
        }  # fmt: skip
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if printer.enabled:
            # what the runtime formula says the step's rings send (fp32 K/V, fp32 dK/dV)
            formula = plan_p2p_bytes(
                step.plan, num_kv_heads=settings.num_query_groups,
                head_dim=settings.hidden_size // settings.num_attention_heads, element_size=4,
                num_layers=settings.num_layers,
            )  # fmt: skip
            row = step_row(step, gathered, p2p_bytes_formula=formula)
            printer.step(dataset, mode, row)
            yield row
        else:
            yield None


def step_row(
    step: Any, per_rank: list[dict[str, Any]], *, p2p_bytes_formula: int | None = None
) -> dict[str, Any]:
    """One step of one mode, over all ranks (``p2p_bytes`` measured, ``p2p_bytes_formula``
    from :func:`~megatron_bytescale.runtime.plan_p2p_bytes` of the step's plan)."""
    wall = max(r["finished_at"] for r in per_rank) - min(r["started_at"] for r in per_rank)
    loss_sum = sum(r["loss_sum"] for r in per_rank)
    estimate = step.plan.estimate
    return {
        "step": step.index,
        "loss": loss_sum / max(1, step.global_loss_tokens),
        "tokens": step.total_tokens,
        "loss_tokens": step.global_loss_tokens,
        "wall_s": wall,
        "phase_wall_s": max(r["done_at"] for r in per_rank) - min(r["started_at"] for r in per_rank),
        "tokens_per_s": step.total_tokens / wall if wall > 0 else 0.0,
        "p2p_bytes": sum(r["p2p_bytes"] for r in per_rank),
        "p2p_bytes_formula": p2p_bytes_formula,
        "sequences": len(step.plan.sequences),
        "batch_tokens": step.global_batch.total_tokens,
        "busy_s": [r["busy_s"] for r in per_rank],
        "reduce_wall_s": [r["reduce_wall_s"] for r in per_rank],
        "micro_batches": [r["micro_batches"] for r in per_rank],
        "rank_tokens": [r["tokens"] for r in per_rank],
        "ring_sizes": dict(sorted(Counter(step.plan.ring_sizes()).items())),
        "plan_s": max(r["plan_s"] for r in per_rank),
        "estimated_step_s": estimate.step_time_s if estimate is not None else None,
        "optimizer_wall_s": [r["optimizer_wall_s"] for r in per_rank],
        # what the simulator needs to replan and re-time this step (docs/reproduction.md)
        "lengths": [s.length for s in sorted(step.plan.sequences, key=lambda s: s.id)],
        "plan_hash": step.plan.content_hash(),
        "micro_batch_records": [r["mb"] for r in per_rank],
        "peak_saved_bytes": [r["offload"][0] for r in per_rank] if "offload" in per_rank[0] else None,
        "offloaded_bytes": sum(r["offload"][1] for r in per_rank) if "offload" in per_rank[0] else 0,
        "reload_wait_s": [r["offload"][2] for r in per_rank] if "offload" in per_rank[0] else None,
        "max_ring_size": max(step.plan.ring_sizes(), default=0),
    }


class StepPrinter:
    """Rank 0's per-step lines and a progress bar (stderr, only on a terminal)."""

    def __init__(self, *, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        # the launcher relays the workers' output through a pipe and says whether it ends on a terminal
        self.bar = enabled and (sys.stderr.isatty() or os.environ.get(PROGRESS_BAR_ENV) == "1")

    def header(self, settings: DemoSettings, calibration: Any, hdp_size: int) -> None:
        if not self.enabled:
            return
        cm = calibration.cost_model
        print(
            f"HDP over {hdp_size} CPU ranks (Megatron CP=1, DP={hdp_size}); "
            f"capacity C={settings.capacity}, "
            f"context {settings.context_length} (static CP={settings.static_cp_size}), "
            f"{settings.tokens_per_step} tokens/step\n"
            f"{'calibrated' if calibration.time_samples else 'given'} cost model "
            f"(per layer, fwd+bwd): T(s) = {cm.alpha1:.3g} s^2 + "
            f"{cm.beta1:.3g} s + {cm.gamma:.3g} seconds; "
            f"P2P {calibration.p2p_bandwidth / 1e6:.0f} MB/s, "
            f"{calibration.p2p_latency_s * 1e6:.0f} us latency, "
            f"ring step overhead {cm.ring_step_overhead_s * 1e3:.2f} ms per layer",
            flush=True,
        )

    def step(self, dataset: str, mode: str, row: dict[str, Any]) -> None:
        self.done += 1
        busy = " ".join(f"{b * 1000:5.0f}" for b in row["busy_s"])
        rings = ",".join(f"{size}x{count}" for size, count in row["ring_sizes"].items())
        line = (
            f"[{self.done:3d}/{self.total}] {dataset:<16} {MODE_LABELS[mode]:<12} "
            f"step {row['step']:3d} "
            f"loss {row['loss']:.3f}  {row['tokens_per_s']:7.0f} tok/s  "
            f"P2P {row['p2p_bytes'] / 1e6:6.2f} MB  busy ms [{busy}]  "
            f"mb {'/'.join(str(m) for m in row['micro_batches'])}  rings {rings}"
        )
        if row.get("peak_saved_bytes"):
            line += f"  saved {max(row['peak_saved_bytes']) / 1e6:.1f} MB"
            if row["offloaded_bytes"]:
                wait_ms = max(row["reload_wait_s"] or [0.0]) * 1e3  # slowest rank
                line += (f" (offloaded {row['offloaded_bytes'] / 1e6:.1f} MB, reload wait "
                         f"{wait_ms:.1f} ms)")
        if self.bar:
            sys.stderr.write("\r\x1b[K")
        print(line, flush=True)
        if self.bar:
            sys.stderr.write(self._bar())
            sys.stderr.flush()

    def _bar(self, width: int = 30) -> str:
        frac = self.done / max(1, self.total)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        filled = int(width * frac)
        bar = "#" * filled + "." * (width - filled)
        return f"[{bar}] {self.done}/{self.total} steps, eta {eta:4.0f} s"

    def finish(self) -> None:
        if self.bar:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
