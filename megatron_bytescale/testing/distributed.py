"""Run a function on N CPU processes with a gloo process group, for tests and the CPU demo.

A fresh process spends 3-8 s of CPU importing torch and megatron-core, so tests start one group
of processes and run many checks inside it, and the processes are forked from a server that
imported those once (``multiprocessing``'s fork server, :data:`PRELOAD`); each gets the
parent's environment, working folder and ``sys.path`` of the moment it starts, as a spawned one
would. Failures come back as the child's traceback; a hang comes back as a timeout error naming the ranks that did not finish, never as a stuck
test run.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


#: What the fork server imports once for every process forked from it (a missing one is skipped).
PRELOAD = ("numpy", "torch", "torch.distributed", "megatron.core",
           "megatron.core.pipeline_parallel", "megatron.core.models.gpt")


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (first use)
    return ctx


class DistributedTestError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def _child(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple,
    results: "mp.Queue",
    timeout_s: float,
    hard_exit: bool = False,
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None:  # the fork server's environment is that of its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args)
        results.put(("ok", rank, out))
    except BaseException:  # report everything, including KeyboardInterrupt from a kill
        results.put(("err", rank, traceback.format_exc()))
    finally:
        if hard_exit:  # gloo work left pending on purpose would block the teardown
            results.close()
            results.join_thread()
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 300.0,
    hard_exit: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes.

    ``fn`` must be importable (a module-level function). Returns the per-rank return values
    (which must be picklable) in rank order. Raises :class:`DistributedTestError` with every
    failing rank's traceback, or with the ranks that did not finish within ``timeout_s``.

    ``hard_exit`` ends each process right after it reported, without tearing the process group
    down: for runs that leave gloo operations pending on purpose (a deadlock shown by
    ``testing.stream_order``), whose teardown would wait for them.
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    ctx = _context()
    results: "mp.Queue" = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bytescale-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(rank, world_size, init_file, fn, args, results, timeout_s, hard_exit,
                      dict(os.environ)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while len(outputs) + len(errors) < world_size:
                try:
                    status, rank, payload = results.get(timeout=timeout_s)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
                    raise DistributedTestError(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                        + _format_errors(errors)
                    ) from None
                if status == "ok":
                    outputs[rank] = payload
                else:
                    errors[rank] = payload
                    # one failure usually leaves the others blocked in a collective
                    if len(errors) == 1:
                        _drain_after_failure(results, outputs, errors, world_size, grace_s=10.0)
                        break
        finally:
            for p in procs:
                p.join(timeout=5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    if errors:
        raise DistributedTestError(f"{len(errors)} of {world_size} ranks failed" + _format_errors(errors))
    return [outputs[r] for r in range(world_size)]


def _drain_after_failure(
    results: "mp.Queue", outputs: dict, errors: dict, world_size: int, grace_s: float
) -> None:
    """Collect what the other ranks report for a short while after the first failure."""
    while len(outputs) + len(errors) < world_size:
        try:
            status, rank, payload = results.get(timeout=grace_s)
        except queue.Empty:
            return
        (outputs if status == "ok" else errors)[rank] = payload


def _format_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
