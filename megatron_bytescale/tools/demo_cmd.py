"""``bytescale demo``: a small megatron-core GPT on CPU, static DP x CP vs HDP naive vs balance.

The command launches ``python -m torch.distributed.run --standalone --nproc-per-node N`` itself
(gloo, CPU), waits for the ranks (:mod:`.demo_worker`) to train every mode on the same global
batches from the same initial weights, then prints the comparison table and writes a plot.
How to read the output: ``docs/demo.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..env import omp_num_threads
from .demo_process import PROGRESS_BAR_ENV, RESULTS_ENV, Interrupted, run_supervised
from .demo_settings import BUILTIN_DATASETS, DEFAULT_MODES, DEFAULT_TIMEOUT_MINUTES, MODES, DemoSettings

DEFAULT_CAPACITY = 512


def build_parser() -> argparse.ArgumentParser:
    from megatron_bytescale.integration.config import add_bytescale_args

    parser = argparse.ArgumentParser(
        prog="bytescale demo",
        description=(
            "Train a small megatron-core GPT on CPU ranks (gloo) three ways on identical data and "
            "initial weights: static DP x CP (Megatron-style packing, one ring over the CP group), "
            "HDP naive and HDP balance (and, with --bytescale-offload, HDP balance with selective "
            "activation offload); print per-step loss, tokens/s, P2P bytes and per-rank busy "
            "time, then a comparison table and a plot."
        ),
    )
    demo = parser.add_argument_group("demo")
    demo.add_argument(
        "--data",
        default="stdlib",
        help=f"comma-separated datasets: {', '.join(BUILTIN_DATASETS)}, a .jsonl file "
        "(text field) or a Megatron indexed prefix (default: stdlib)",
    )
    demo.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated modes to compare, of {','.join(MODES)} (default: "
        f"{','.join(DEFAULT_MODES)}; --bytescale-offload adds offload: HDP balance with "
        "selective activation offload)",
    )
    demo.add_argument("--ranks", type=int, default=4, help="CPU processes = HDP ranks (default: 4)")
    demo.add_argument(
        "--steps",
        type=int,
        default=DemoSettings().steps,
        help="training steps per mode (default: %(default)s)",
    )
    demo.add_argument(
        "--micro-batches-per-rank",
        type=int,
        default=DemoSettings().micro_batches_per_rank,
        help="global batch = ranks x capacity x this many tokens (default: %(default)s)",
    )
    defaults = DemoSettings()
    demo.add_argument("--num-layers", type=int, default=defaults.num_layers)
    demo.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    demo.add_argument("--num-attention-heads", type=int, default=defaults.num_attention_heads)
    demo.add_argument(
        "--num-query-groups", type=int, default=defaults.num_query_groups, help="KV heads (GQA)"
    )
    demo.add_argument("--ffn-hidden-size", type=int, default=defaults.ffn_hidden_size)
    demo.add_argument("--lr", type=float, default=defaults.lr)
    demo.add_argument("--seed", type=int, default=1234)
    demo.add_argument(
        "--out",
        default="out/demo",
        help="directory for results.json, cost_model.json and demo.png (default: %(default)s)",
    )
    demo.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    demo.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=DEFAULT_TIMEOUT_MINUTES,
        help="how long the ranks wait for one that does not answer before the job stops, naming "
        "it (gloo's own default: 30 minutes; default: %(default)s)",
    )
    add_bytescale_args(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """Demo settings from the parsed command line; ValueError names the bad flag."""
    from megatron_bytescale.integration.config import ByteScaleConfig

    config = ByteScaleConfig.from_args(args)
    ignored = {"scheduler": "--modes", "hdp": "--modes", "overlong": "--data"}
    for name, instead in ignored.items():
        if getattr(config, name) != getattr(ByteScaleConfig(), name):
            raise ValueError(
                f"bytescale demo does not take --bytescale-{name}: it runs every mode named by "
                f"{instead} (static, naive, balance) on the same batches"
            )
    if config.dataloader != "local":
        raise ValueError(
            f"bytescale demo plans with the local loader; --bytescale-dataloader "
            f"{config.dataloader} serves pretrain_gpt.py and your own loop (docs/megatron_lm.md)"
        )
    if config.cost_model:
        from megatron_bytescale.planner.cost_model import CostModel

        try:
            cost_model = CostModel.load(config.cost_model)
        except ValueError as exc:
            raise ValueError(f"--bytescale-cost-model: {exc}") from exc
        if cost_model.num_layers != args.num_layers:
            raise ValueError(
                f"--bytescale-cost-model {config.cost_model} describes {cost_model.num_layers} "
                f"layers, the demo model has {args.num_layers}; pass --num-layers "
                f"{cost_model.num_layers} or fit a new one"
            )
    datasets = tuple(d.strip() for d in args.data.split(",") if d.strip())
    if not datasets:
        raise ValueError(
            f"--data {args.data!r} names no dataset; give one or more of "
            f"{', '.join(BUILTIN_DATASETS)}, a .jsonl file or a Megatron indexed prefix"
        )
    if not args.out.strip():
        raise ValueError("--out is empty; give the directory for the results, e.g. out/demo")
    capacity = config.capacity or DEFAULT_CAPACITY
    context = config.context_length or args.ranks * capacity
    return DemoSettings(
        datasets=datasets,
        modes=demo_modes(args.modes, offload=config.offload),
        ranks=args.ranks,
        steps=args.steps,
        capacity=capacity,
        context_length=context,
        micro_batches_per_rank=args.micro_batches_per_rank,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        lr=args.lr,
        seed=args.seed,
        plan_mode=config.plan_mode,
        offload=config.offload,
        host_memory_gb=config.host_memory_gb,
        align=config.align,
        attention_backend=config.attention_backend,
        check_plan_hash=config.check_plan_hash,
        plan_prefetch=config.plan_prefetch,
        cost_model=str(Path(config.cost_model).resolve()) if config.cost_model else None,
        out_dir=str(Path(args.out).resolve()),
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def demo_modes(text: str, *, offload: bool) -> tuple[str, ...]:
    """The modes of ``--modes``, plus ``offload`` when ``--bytescale-offload`` asks for it."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    return modes + ("offload",) if offload and "offload" not in modes else modes


def run_demo_job(settings: DemoSettings) -> dict[str, Any]:
    """Launch the torchrun job for ``settings`` and return the results rank 0 handed over.

    Rank 0 writes them into a private temporary directory, not into ``--out``: the launcher
    writes the output directory itself (:func:`save_results`), after every worker is done.
    """
    import tempfile

    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings_path = out / "settings.json"
    settings.save(settings_path)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(settings.ranks),
        "-m", "megatron_bytescale.tools.demo_worker", "--settings", str(settings_path),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bytescale-demo-") as handoff:
        results_path = Path(handoff) / "results.json"
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
        env[RESULTS_ENV] = str(results_path)
        if sys.stderr.isatty():
            env[PROGRESS_BAR_ENV] = "1"
        returncode = run_supervised(command, env=env)  # raises Interrupted on SIGINT/SIGTERM/SIGHUP
        if returncode != 0 or not results_path.exists():
            raise RuntimeError(
                f"the demo's torchrun job failed (exit code {returncode}); see the rank output above"
            )
        return json.loads(results_path.read_text(encoding="utf-8"))


def save_results(results: dict[str, Any], out_dir: Path) -> bool:
    """Write ``results.json`` and ``cost_model.json`` into ``out_dir`` (temporary file and
    rename); whatever cannot be written is printed on stdout with a line saying so. Saved?"""
    from .results_io import save_or_print

    prog = "bytescale demo"
    saved = save_or_print(out_dir / "results.json", json.dumps(results, indent=1) + "\n",
                          what="results JSON", prog=prog)
    # reusable: bytescale demo / pretrain_gpt.py --bytescale-cost-model out/demo/cost_model.json
    cost_model = json.dumps(results["calibration"]["cost_model"], indent=2) + "\n"
    return save_or_print(out_dir / "cost_model.json", cost_model, what="cost model JSON", prog=prog) and saved


def prepare_out_dir(settings: DemoSettings, flag: str) -> None:
    """Create ``--out`` now, so a bad path is one line before any worker starts."""
    out = Path(settings.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".bytescale-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"--out {flag}: cannot create the directory or write into it ({exc.strerror or exc})"
        ) from None


def check_datasets(settings: DemoSettings) -> None:
    """Build every dataset's global batches here, as the workers will: a bad file, a missing
    prefix or too little data is reported in one line instead of inside every worker."""
    from .demo_data import demo_global_batches

    for name in settings.datasets:
        try:
            demo_global_batches(name, settings)
        except OSError as exc:
            raise ValueError(f"--data {name}: {exc.strerror or exc}") from None


def print_report(results: dict[str, Any], *, plot: bool, out_dir: Path, saved: bool = True) -> None:
    from .demo_report import comparison_rows, settings_line, summarize, text_table, write_plot

    print("\n" + settings_line(results))
    for name, modes in summarize(results).items():
        headers, rows = comparison_rows(modes)
        print(f"\n{name}: {results['datasets'][name]['description']}")
        print(text_table(headers, rows))
    if saved:
        print(f"\nresults: {out_dir / 'results.json'}")
    if plot:
        path = write_plot(results, out_dir / "demo.png")
        print(f"plot:    {path}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C outside the training job (checks, report, plot)
        print("bytescale demo: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT


def _run(args: argparse.Namespace) -> int:
    try:
        omp_num_threads()  # the workers' threads: libgomp would only warn once per rank
        settings = settings_from_args(args)
        prepare_out_dir(settings, args.out)
        check_datasets(settings)
    except ValueError as exc:
        print(f"bytescale demo: error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        results = run_demo_job(settings)
    except Interrupted as exc:
        what = "interrupted (SIGINT)" if exc.signum == signal.SIGINT else str(exc)
        print(f"bytescale demo: {what}; torchrun and its workers were stopped", file=sys.stderr)
        return 128 + exc.signum
    except RuntimeError as exc:
        print(f"bytescale demo: {exc}", file=sys.stderr)
        return 1
    out_dir = Path(settings.out_dir)
    saved = save_results(results, out_dir)
    try:
        print_report(results, plot=not args.no_plot, out_dir=out_dir, saved=saved)
    except OSError as exc:  # the plot: the results themselves are saved or printed already
        print(f"bytescale demo: could not write the plot into {str(out_dir)!r} ({exc.strerror or exc})",
              file=sys.stderr)
        saved = False
    print(f"total time: {time.perf_counter() - start:.0f} s")
    return 0 if saved else 1
