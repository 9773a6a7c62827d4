"""A patched, throw-away Megatron-LM tree for tests, and its ``pretrain_gpt.py`` on CPU ranks.

The project's patch for the installed megatron-core (:data:`MEGATRON_LM_TAG`: ``core_v0.16.1``
with megatron-core 0.16.1 on Python 3.10-3.11, ``core_v0.19.0`` with 0.19.x on Python 3.12+;
``integration.compat`` decides) is tested against a real Megatron-LM tree at that tag:
``$MEGATRON_LM_DIR`` when set, otherwise the unmodified tree that ships beside the repository in
``shared/megatron-lm/<tag>`` (CI lays ``shared/`` next to its clone). That tree is never edited:
:func:`prepare_patched_megatron_lm`
copies it to a temporary folder (or adds a git worktree at the tag, for a git checkout) and
applies the patch there with ``scripts/apply_megatron_patches.sh``, exactly as a user would.

:func:`run_pretrain_gpt` then runs the patched ``pretrain_gpt.py`` on CPU gloo ranks (forked
by :mod:`.cpu_pretrain`, or under ``torch.distributed.run``) through it (stand-ins for
Megatron's CUDA-only start-up calls, which live in the launcher, never in the patch). On a
time-out the launcher and all its workers are stopped: none is left behind.

``megatron.training`` needs a few packages that the megatron-core wheel does not pull in (six,
regex, pydantic, pyyaml, psutil, triton: the ``megatron-lm`` extra of setup.py, part of the
``test`` extra); :func:`missing_megatron_lm_packages` says which one is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..integration.compat import megatron_lm_patch_tag

__all__ = [
    "MEGATRON_LM_TAG",
    "MegatronLMRun",
    "PatchedMegatronLM",
    "ValidatedArgs",
    "find_megatron_lm_source",
    "missing_megatron_lm_packages",
    "prepare_patched_megatron_lm",
    "remove_patched_megatron_lm",
    "repository_root",
    "run_pretrain_gpt",
    "terminate_process_tree",
    "validate_megatron_flags",
]

#: The Megatron-LM tag whose tree and patch fit the installed megatron-core (0.16.1 or 0.19.x).
MEGATRON_LM_TAG = megatron_lm_patch_tag()
#: Where the unmodified tree lies relative to an ancestor of the repository.
SHARED_TREE = Path("shared") / "megatron-lm" / MEGATRON_LM_TAG
#: Set to 1 to turn "no Megatron-LM tree / package missing" from a skip into a failure (CI).
REQUIRE_ENV = "BYTESCALE_REQUIRE_MEGATRON_LM"


def repository_root() -> Path:
    """The megatron_bytescale checkout this package runs from (holds patches/ and scripts/)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "patches" / f"megatron-lm-{MEGATRON_LM_TAG}.patch").is_file():
        raise FileNotFoundError(
            f"{root} has no patches/megatron-lm-{MEGATRON_LM_TAG}.patch: the Megatron-LM test "
            "helpers need a source checkout of megatron_bytescale (pip install -e .)"
        )
    return root


def find_megatron_lm_source(start: Optional[Path] = None) -> Optional[Path]:
    """The Megatron-LM tree to test against, or None if there is none.

    ``$MEGATRON_LM_DIR`` if set (it must hold ``pretrain_gpt.py``); otherwise the nearest
    ``shared/megatron-lm/<MEGATRON_LM_TAG>`` found in ``start`` (default: the repository root) or
    one of its ancestors, so a clone with ``shared/`` beside it and a worktree below the
    folder that holds ``shared/`` both find it.
    """
    value = os.environ.get("MEGATRON_LM_DIR")
    if value:
        path = Path(value).expanduser().resolve()
        if not (path / "pretrain_gpt.py").is_file():
            raise FileNotFoundError(
                f"MEGATRON_LM_DIR={value} is not a Megatron-LM tree (no pretrain_gpt.py); point "
                f"it to a checkout at tag {MEGATRON_LM_TAG} or unset it to use {SHARED_TREE}"
            )
        return path
    here = (start or repository_root()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / SHARED_TREE
        if (candidate / "pretrain_gpt.py").is_file():
            return candidate
    return None


@dataclass(frozen=True, kw_only=True)
class PatchedMegatronLM:
    """A patched copy of a Megatron-LM tree and what applying the patch printed.

    ``apply`` is the first run of ``apply_megatron_patches.sh`` (it applies), ``reapply`` the
    second (it must say "already applied").
    """

    root: Path
    source: Path
    worktree: bool
    apply: subprocess.CompletedProcess
    reapply: subprocess.CompletedProcess

    def env(self, **extra: str) -> dict[str, str]:
        """The environment to run this tree's Python with: the tree first on ``PYTHONPATH``."""
        path = [str(self.root), os.environ.get("MEGATRON_LM_PYTHONPATH", "")]
        return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
                    PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MEGATRON_LM_DIR=str(self.root),
                    **extra)


def prepare_patched_megatron_lm(source: Path, parent: Path) -> PatchedMegatronLM:
    """Copy ``source`` into ``parent/Megatron-LM`` and apply the patch there (twice).

    A git checkout that has the tag gets a detached worktree at the tag instead of a copy (its
    own working-tree edits stay out); any other tree is copied without ``.git`` and made
    writable (the shared tree is read-only on CI). ``source`` itself is never written.
    """
    target = Path(parent) / "Megatron-LM"
    worktree = _has_tag(source) and subprocess.run(
        ["git", "-C", str(source), "worktree", "add", "--detach", str(target), MEGATRON_LM_TAG],
        capture_output=True, text=True,
    ).returncode == 0  # fmt: skip
    if not worktree:
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        _make_writable(target)
    script = repository_root() / "scripts" / "apply_megatron_patches.sh"
    runs = [subprocess.run(["bash", str(script), str(target)], capture_output=True, text=True)
            for _ in range(2)]
    return PatchedMegatronLM(root=target, source=Path(source), worktree=worktree,
                             apply=runs[0], reapply=runs[1])


def remove_patched_megatron_lm(tree: PatchedMegatronLM) -> None:
    """Remove the worktree registration (for a git checkout); the copy goes with its folder."""
    if tree.worktree:
        subprocess.run(["git", "-C", str(tree.source), "worktree", "remove", "--force",
                        str(tree.root)], capture_output=True)


def _has_tag(source: Path) -> bool:
    probe = subprocess.run(["git", "-C", str(source), "rev-parse", "-q", "--verify",
                            f"refs/tags/{MEGATRON_LM_TAG}"], capture_output=True, text=True)
    return probe.returncode == 0 and (Path(source) / ".git").exists()


def _make_writable(root: Path) -> None:
    for folder, _, files in os.walk(root):
        os.chmod(folder, os.stat(folder).st_mode | stat.S_IWUSR | stat.S_IXUSR)
        for name in files:
            path = os.path.join(folder, name)
            os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)


def missing_megatron_lm_packages(tree: PatchedMegatronLM) -> Optional[str]:
    """None if ``megatron.training`` of the tree imports, else the import error's last line."""
    probe = subprocess.run(
        [sys.executable, "-c", "import megatron.training.arguments, megatron.training.training"],
        env=tree.env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {probe.returncode}"


@dataclass(frozen=True, kw_only=True)
class MegatronLMRun:
    """What a :func:`run_pretrain_gpt` run printed, and how it ended (124: timed out)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    def tail(self, chars: int = 6000) -> str:
        """The end of both streams, for an assertion message."""
        return (f"exit {self.returncode}{' (timed out)' if self.timed_out else ''}\n"
                f"--- stdout ---\n{self.stdout[-chars // 3:]}\n--- stderr ---\n"
                f"{self.stderr[-2 * chars // 3:]}")


def run_pretrain_gpt(tree: PatchedMegatronLM, *flags: str, ranks: int, cwd: Path,
                     timeout_s: float = 600.0, env: Optional[dict[str, str]] = None,
                     launcher: str = "fork") -> MegatronLMRun:
    """Run the patched ``pretrain_gpt.py`` with ``flags`` on ``ranks`` CPU gloo processes.

    The ranks run :mod:`megatron_bytescale.testing.cpu_pretrain`. ``launcher="torchrun"``
    starts them as users do, under ``torch.distributed.run --standalone``; the default
    ``"fork"`` has ``cpu_pretrain`` import Megatron once and fork the ranks (the same
    environment, seconds of CPU saved per rank). Add ``--distributed-backend gloo`` and
    ``--use-cpu-initialization`` to ``flags``, as a CPU run needs them.
    """
    from . import cpu_pretrain

    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(ranks), cpu_pretrain.__file__, *flags]
    elif launcher == "fork":
        command = [sys.executable, cpu_pretrain.__file__, "--fork-ranks", str(ranks), *flags]
    else:
        raise ValueError(f"launcher must be 'fork' or 'torchrun', not {launcher!r}")
    process = subprocess.Popen(command, cwd=cwd, env=tree.env(**(env or {})),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        return MegatronLMRun(returncode=process.returncode, stdout=stdout, stderr=stderr)
    except subprocess.TimeoutExpired:
        terminate_process_tree(process.pid)
        stdout, stderr = process.communicate()
        return MegatronLMRun(returncode=124, stdout=stdout, stderr=stderr, timed_out=True)
    finally:
        if process.poll() is None:  # an interrupt (Ctrl-C) while waiting: take it all down
            terminate_process_tree(process.pid)
            process.wait()


def terminate_process_tree(pid: int, *, grace_s: float = 10.0) -> None:
    """SIGTERM ``pid`` and every process below it, then SIGKILL what is left after ``grace_s``.

    ``torch.distributed.run`` starts each worker in a session of its own, so killing the
    launcher's process group would leave the workers running: they are collected first.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


# Parses each flag set with the patched parse_args + validate_args in ONE process (imports of
# megatron.training cost seconds): one JSON line per set.
_VALIDATE = textwrap.dedent("""
    import contextlib, io, json, sys
    import megatron.training.arguments as arguments
    from megatron.training.arguments import parse_args, validate_args
    from megatron_bytescale.integration import megatron_lm
    flag_sets, attributes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    # validate_args reads the GPU architecture when TP > 1, and its compute capability for
    # --moe-grouped-gemm: answer as the GPU named
    import torch
    device_arch = int(sys.argv[3])
    arguments.get_device_arch_version = lambda: device_arch
    torch.cuda.get_device_capability = lambda *a, **k: (device_arch, 0)
    for flags in flag_sets:
        sys.argv = ["pretrain_gpt.py"] + flags
        report = io.StringIO()  # the plugin's refusals: one report on stderr, then exit 2
        try:
            with contextlib.redirect_stderr(report):
                args = validate_args(parse_args(megatron_lm.chain_extra_args_provider(None)), {})
            out = dict(values={a: getattr(args, a, None) for a in attributes})
        except (Exception, SystemExit) as exc:
            out = dict(error=type(exc).__name__, message=str(exc), stderr=report.getvalue())
        print("VALIDATED " + json.dumps(out, default=repr), flush=True)
""")


@dataclass(frozen=True, kw_only=True)
class ValidatedArgs:
    """One flag set after the patched ``validate_args``: the attributes asked for, or the
    exception's type and message when Megatron or the plugin refused the flags."""

    values: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    message: str = ""
    stderr: str = ""
    """What was printed while refusing (the plugin reports its refusals there, then exits 2)."""

    @property
    def refused(self) -> bool:
        return self.error is not None


def validate_megatron_flags(tree: PatchedMegatronLM, flag_sets: Sequence[Sequence[str]],
                            attributes: Sequence[str], *, world_size: int = 4,
                            device_arch: int = 9, timeout_s: float = 300.0) -> list[ValidatedArgs]:
    """Run the patched ``parse_args`` + ``validate_args`` on each flag set, in one process.

    ``world_size`` is what Megatron reads from ``$WORLD_SIZE`` (no process group is made).
    With TP > 1 (and for ``--moe-grouped-gemm``) Megatron's ``validate_args`` asks for the
    GPU's major compute capability; it gets ``device_arch`` (9: Hopper, as Megatron's H100
    examples; then it requires ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which those examples export
    and so does this call).
    Returns, per flag set, the ``attributes`` of the validated args or the refusal.
    """
    run = subprocess.run(
        [sys.executable, "-c", _VALIDATE, json.dumps([list(f) for f in flag_sets]),
         json.dumps(list(attributes)), str(int(device_arch))],
        env=tree.env(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0",
                     CUDA_DEVICE_MAX_CONNECTIONS="1"), cwd=tree.root,
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    lines = [x[len("VALIDATED "):] for x in run.stdout.splitlines() if x.startswith("VALIDATED ")]
    if run.returncode != 0 or len(lines) != len(flag_sets):
        raise RuntimeError(f"validating Megatron flags failed (exit {run.returncode}):\n"
                           f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return [ValidatedArgs(**json.loads(line)) for line in lines]
