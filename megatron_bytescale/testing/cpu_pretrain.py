"""CPU launcher for a patched Megatron-LM ``pretrain_gpt.py`` (tests only).

Run by ``torch.distributed.run`` on each CPU rank, with ``$MEGATRON_LM_DIR`` naming the patched
tree (see :func:`megatron_bytescale.testing.megatron_lm.run_pretrain_gpt`)::

    MEGATRON_LM_DIR=/tmp/Megatron-LM python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 megatron_bytescale/testing/cpu_pretrain.py <pretrain_gpt.py flags>

Megatron-LM asserts CUDA at start-up and calls a few ``torch.cuda`` functions outside
megatron-core. This launcher replaces exactly those with CPU stand-ins (plus
:func:`~megatron_bytescale.testing.cpu_compat.enable_cpu_megatron` for megatron-core), then
runs ``pretrain_gpt.py`` as ``__main__``. None of this is in the patch: on GPUs the patched
tree runs Megatron's own code.

``--fork-ranks N`` (first argument) starts the ranks itself instead: it imports torch,
megatron-core, Megatron-LM and ``pretrain_gpt.py``'s own imports once, then forks N ranks with the
environment ``torch.distributed.run`` would give them. Each Megatron-LM rank otherwise spends
about 8 s of CPU importing the same modules, so on a 2-core test machine a 4-rank run starts
about 15 s sooner. A rank that fails stops the others, as under ``torch.distributed.run``.
Users launch with ``torchrun``; the tests keep runs on both launchers.

Two probe lines let tests check a run without parsing Megatron's rounded log:
``HDPLOSS <loss>`` (the last rank, every training iteration, full precision) and
``HDPCHECK rank R micro_batches N rings [...] forward_only B tokens T`` (every rank, every HDP
step; T: tokens of the whole global batch).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import importlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist


def install_cpu_stand_ins() -> None:
    """Replace the CUDA calls of Megatron-LM's start-up and loop with CPU equivalents."""
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()  # also torch.cuda.Stream / torch.cuda.stream
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    import megatron.training.arguments as arguments
    import megatron.training.initialize as init
    import megatron.training.training as training

    # validate_args reads the GPU architecture when TP > 1; a CPU answers as a pre-Blackwell
    # GPU, for which Megatron wants CUDA_DEVICE_MAX_CONNECTIONS=1 (as its launch scripts set)
    arguments.get_device_arch_version = lambda: 9
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.training.global_vars import get_args

    def initialize_distributed(*args, **kwargs):  # Megatron skips MPU set-up without GPUs
        megatron_args = get_args()
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=megatron_args.tensor_model_parallel_size,
            pipeline_model_parallel_size=megatron_args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=(
                megatron_args.virtual_pipeline_model_parallel_size),
            context_parallel_size=megatron_args.context_parallel_size,
        )

    init._initialize_distributed = initialize_distributed
    set_seed = init._set_random_seed

    def set_random_seed(seed, *args, **kwargs):
        set_seed(seed, *args, **kwargs)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    init._set_random_seed = set_random_seed
    init._compile_dependencies = lambda: None  # dataset C++ helpers, fused kernels: unused here
    training.initialize_megatron = functools.partial(init.initialize_megatron,
                                                     allow_no_cuda=True)


def _say(line: str) -> None:
    """Print ``line`` in one write: the ranks share one pipe, and under PYTHONUNBUFFERED=1
    ``print`` writes the text and its newline apart, so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def install_probes() -> None:
    """Print the ``HDPCHECK`` and ``HDPLOSS`` lines (see the module docstring)."""
    import megatron.training.training as training

    from megatron_bytescale.integration import megatron_lm_step

    run = megatron_lm_step.run_micro_batches

    def probed_run(step, **kwargs):
        rings = sorted(mb.ring_size for mb in step.micro_batches)
        _say(f"HDPCHECK rank {dist.get_rank()} micro_batches {step.num_micro_batches} "
             f"rings {rings} forward_only {kwargs.get('forward_only')} "
             f"tokens {step.global_batch.total_tokens}")
        return run(step, **kwargs)

    megatron_lm_step.run_micro_batches = probed_run
    train_step = training.train_step

    def probed_train_step(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if dist.get_rank() == dist.get_world_size() - 1 and "lm loss" in out[0]:
            _say(f"HDPLOSS {float(out[0]['lm loss']):.9f}")
        return out

    training.train_step = probed_train_step


def preimport(script: str) -> None:
    """Import the modules ``script`` imports at its top level (what every rank would import)."""
    tree = ast.parse(open(script, encoding="utf-8").read(), filename=script)
    for node in tree.body:
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and
                 not node.level else [])
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # the rank meets the same error where the script imports it
                pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank: int, ranks: int, port: int, argv: list[str]) -> None:
    """The body of a forked rank: never returns."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                          LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", ROLE_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_forked(ranks: int, argv: list[str], *, grace_s: float = 10.0) -> int:
    """Fork ``ranks`` ranks running ``argv`` (script first); the first failure's exit code."""
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}

    def stop_all(*_: object) -> None:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while children and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid:
                children.pop(pid, None)
            else:
                time.sleep(0.05)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def on_signal(signum: int, _frame: object) -> None:
        stop_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, ranks, port, argv)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rank is not None and not failed:
            failed = code if code > 0 else 128 - code
            print(f"cpu_pretrain: rank {rank} exited with {code}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            stop_all()
    return failed


def main() -> None:
    torch.set_num_threads(1)
    args = sys.argv[1:]
    ranks = 0
    if args[:1] == ["--fork-ranks"]:
        if len(args) < 2 or not args[1].isdigit() or int(args[1]) < 1:
            raise SystemExit(f"cpu_pretrain: --fork-ranks takes a positive number of ranks "
                             f"(got {args[1:2]})")
        ranks, args = int(args[1]), args[2:]
    tree = os.environ.get("MEGATRON_LM_DIR")
    if not tree or not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        raise SystemExit(f"cpu_pretrain: set MEGATRON_LM_DIR to a patched Megatron-LM tree "
                         f"(got {tree!r})")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [tree] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    install_cpu_stand_ins()
    install_probes()
    argv = [os.path.join(tree, "pretrain_gpt.py"), *args]
    if ranks:
        preimport(argv[0])
        sys.exit(run_forked(ranks, argv))
    sys.argv = argv
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
