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

Two probe lines let tests check a run without parsing Megatron's rounded log:
``HDPLOSS <loss>`` (the last rank, every training iteration, full precision) and
``HDPCHECK rank R micro_batches N rings [...] forward_only B tokens T`` (every rank, every HDP
step; T: tokens of the whole global batch).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

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


def install_probes() -> None:
    """Print the ``HDPCHECK`` and ``HDPLOSS`` lines (see the module docstring)."""
    import megatron.training.training as training

    from megatron_bytescale.integration import megatron_lm_step

    run = megatron_lm_step.run_micro_batches

    def probed_run(step, **kwargs):
        rings = sorted(mb.ring_size for mb in step.micro_batches)
        print(f"HDPCHECK rank {dist.get_rank()} micro_batches {step.num_micro_batches} "
              f"rings {rings} forward_only {kwargs.get('forward_only')} "
              f"tokens {step.global_batch.total_tokens}", flush=True)
        return run(step, **kwargs)

    megatron_lm_step.run_micro_batches = probed_run
    train_step = training.train_step

    def probed_train_step(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if dist.get_rank() == dist.get_world_size() - 1 and "lm loss" in out[0]:
            print(f"HDPLOSS {float(out[0]['lm loss']):.9f}", flush=True)
        return out

    training.train_step = probed_train_step


def main() -> None:
    torch.set_num_threads(1)
    tree = os.environ.get("MEGATRON_LM_DIR")
    if not tree or not os.path.isfile(os.path.join(tree, "pretrain_gpt.py")):
        raise SystemExit(f"cpu_pretrain: set MEGATRON_LM_DIR to a patched Megatron-LM tree "
                         f"(got {tree!r})")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [tree] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    install_cpu_stand_ins()
    install_probes()
    sys.argv = [os.path.join(tree, "pretrain_gpt.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
