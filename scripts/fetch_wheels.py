"""Fetch every wheel the GPU check needs beyond torch, for a machine without internet.

The GPU machine has Python and torch and nothing else (no numpy: torch does not require it; no
packaging; maybe no pip). This downloads, for its Python version and manylinux x86_64:

* megatron-core (``$MEGATRON_CORE``, default the version ``setup.py`` pins for the target
  Python: 0.16.1 below 3.12, 0.19.x from 3.12 on), and
* every requirement of it and of this package (``setup.py``'s ``install_requires``), and of
  those, transitively: each wheel's unconditional ``Requires-Dist`` (markers evaluated for the
  target Python on Linux x86_64, extras skipped), except torch and what comes with torch.

Each wheel is fetched with ``pip download --no-deps`` and the platform tags, so nothing of this
machine's own environment leaks in; one version per project. Used by
``bash scripts/gpu_check.sh --fetch-wheels``; ``gpu_check.sh`` installs the folder on the GPU
machine with pip, or without it by unzipping the wheels onto ``PYTHONPATH``.

    python scripts/fetch_wheels.py --python-version 3.12 --dest .whl
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
# torch and what its wheel brings (the GPU machine has them); never fetched
WITH_TORCH = {"torch", "triton", "filelock", "typing-extensions", "sympy", "mpmath", "networkx",
              "jinja2", "markupsafe", "fsspec", "setuptools"}  # fmt: skip
# this package's requirements the GPU check does not import (plots only)
NOT_FOR_THE_CHECK = {"matplotlib"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of the GPU machine (Linux x86_64, CPython ``python_version``)."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "os_name": "posix", "extra": ""}  # fmt: skip


def _applies(requirement: str, python_version: str) -> str | None:
    """``requirement`` without its marker when the marker holds on the target, else None."""
    try:
        from packaging.markers import Marker
    except ImportError:  # pip's own copy: pip is here whenever downloading works
        from pip._vendor.packaging.markers import Marker

    spec, _, marker = requirement.partition(";")
    if marker.strip() and not Marker(marker.strip()).evaluate(_target_environment(python_version)):
        return None
    return spec.strip()


def package_requirements(python_version: str) -> list[str]:
    """``install_requires`` of setup.py for the target Python, read without running setup.py
    (its markers, e.g. the megatron-core pin per Python, evaluated for the target)."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            listed = ast.literal_eval(node.value)
            return [r for r in (_applies(x, python_version) for x in listed) if r]
    raise SystemExit("setup.py has no install_requires list")


def requirements_of(wheel: Path, python_version: str) -> list[str]:
    """Unconditional Requires-Dist of ``wheel`` for the target (extras skipped)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))
    out = [_applies(r, python_version) for r in metadata.get_all("Requires-Dist") or []]
    return [r for r in out if r]


def project_of(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~\[(;]", requirement.strip(), maxsplit=1)[0])


def wheel_project(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def download(requirement: str, dest: Path, python_version: str, pip: list[str]) -> None:
    abi = "cp" + python_version.replace(".", "")
    command = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
               "--abi", "none", *(f"--platform={p}" for p in PLATFORMS), "--platform=any",
               "-d", str(dest), requirement]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"pip download {requirement} failed: {' / '.join(tail)}")


def fetch(dest: Path, python_version: str, megatron_core: str | None,
          pip: list[str]) -> list[Path]:
    """The wheels for ``python_version`` in ``dest``; ``megatron_core`` replaces setup.py's
    megatron-core requirement when given."""
    dest.mkdir(parents=True, exist_ok=True)
    ours = package_requirements(python_version)
    if megatron_core:
        ours = [megatron_core] + [r for r in ours if project_of(r) != "megatron-core"]
    wanted = sorted(ours, key=lambda r: project_of(r) != "megatron-core")  # megatron-core first
    done: set[str] = set()
    while wanted:
        requirement = wanted.pop(0)
        project = project_of(requirement)
        if project in done or project in WITH_TORCH or project in NOT_FOR_THE_CHECK:
            continue
        have = [w for w in dest.glob("*.whl") if wheel_project(w) == project]
        if not have:
            download(requirement, dest, python_version, pip)
            have = [w for w in dest.glob("*.whl") if wheel_project(w) == project]
        if len(have) != 1:
            raise SystemExit(f"{dest} holds {len(have)} wheels of {project}: keep one version")
        done.add(project)
        wanted += requirements_of(have[0], python_version)
    return sorted(w for w in dest.glob("*.whl") if wheel_project(w) in done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the GPU machine's Python, e.g. 3.12 (default: this interpreter's)")
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="folder for the wheels")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: give MAJOR.MINOR, e.g. 3.12")
    megatron_core = os.environ.get("MEGATRON_CORE") or None
    wheels = fetch(args.dest, args.python_version, megatron_core, [sys.executable, "-m", "pip"])
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels for Python {args.python_version} in {args.dest} ({size:.1f} MiB): "
          + ", ".join(w.name for w in wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
