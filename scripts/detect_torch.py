"""Which torch ``scripts/setup_env.sh`` should use; prints ONE line ``KIND description``.

KIND is ``reuse`` (this interpreter is a virtual environment that already imports a torch that
fits the machine: install into it), ``system`` (a base interpreter - system Python, an NGC
container, a conda env - with such a torch: make the venv with ``--system-site-packages`` so it
stays visible), ``mismatch`` (a CPU-only torch on a machine with NVIDIA GPUs: do not build on it)
or ``none`` (no torch: install the CPU wheel). Runs with the interpreter it describes, imports
nothing of this project, and never fails: anything unexpected is ``none``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def has_nvidia_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (the machine, whatever torch says)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


MIN_TORCH = (2, 4)  # the oldest torch whose flash varlen call forms the runtime uses


def _release(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; anything unreadable counts as new enough."""
    try:
        return tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return MIN_TORCH


def decide() -> str:
    try:
        import torch
    except Exception:  # noqa: BLE001 - a broken torch is no torch
        return "none"
    accelerator = torch.version.cuda or getattr(torch.version, "hip", None)
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
        f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU build")
    where = os.path.dirname(os.path.dirname(torch.__file__))
    description = f"torch {torch.__version__} ({build}) from {where}"
    gpu = has_nvidia_gpu()
    if gpu and not accelerator:
        return f"mismatch {description}: a CPU-only torch on a machine with NVIDIA GPUs"
    if _release(torch.__version__) < MIN_TORCH:
        if not gpu:
            return "none"  # too old to build on: a venv of its own gets the CPU wheel
        return f"mismatch {description}: older than torch {'.'.join(map(str, MIN_TORCH))}"
    kind = "reuse" if sys.prefix != sys.base_prefix else "system"
    return f"{kind} {description}"


if __name__ == "__main__":
    print(decide())
