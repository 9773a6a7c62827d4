"""``gpu_check.sh`` starts on a bare machine: Python + torch, no pip, no numpy, only the wheels.

The GPU machine has Python and torch and nothing else, and no internet: everything the check
imports beyond torch must arrive as the wheels ``gpu_check.sh --fetch-wheels`` fetched. This
builds that machine here:

* a virtual environment made ``--without-pip`` and without system site packages, whose only
  packages are torch and what torch's own wheel requires (linked in from this interpreter's
  site-packages through a ``.pth``): ``numpy``, ``packaging`` and ``megatron`` do NOT import;
* the wheels fetched for this interpreter's Python version (cp311 here; the GPU machine's is
  cp312) by ``gpu_check.sh --fetch-wheels --python-version``;
* ``gpu_check.sh OUT --small`` with that interpreter: it must install the wheels without pip
  and run the sections that import megatron-core and the whole package.

Fetching needs the package registry. Where it cannot be reached the test skips, except on CI
(``CI=true``), where it must run.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _top_levels(distribution: str) -> set[str]:
    """The top-level names a distribution puts into site-packages (packages, modules, its
    dist-info)."""
    dist = metadata.distribution(distribution)
    names = set()
    for f in dist.files or []:
        top = f.parts[0]
        if top not in ("..", "__pycache__") and not top.endswith(".data"):
            names.add(top)
    return names


def _torch_requirements() -> list[str]:
    """torch's requirements, transitively (sympy needs mpmath, jinja2 MarkupSafe)."""
    seen: list[str] = []
    todo = ["torch"]
    while todo:
        name = todo.pop()
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # an optional platform requirement (triton, nvidia-*) not on this machine
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            dep = re.split(r"[\s<>=!~\[(;]", requirement, maxsplit=1)[0]
            if dep not in seen:
                seen.append(dep)
                todo.append(dep)
    return seen


def _bare_python(root: Path) -> Path:
    """A venv without pip whose only importable packages are torch and torch's requirements."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    farm = root / "torch-only"
    farm.mkdir()
    names = set()
    for dist in ["torch", *_torch_requirements()]:
        try:
            names |= _top_levels(dist)
        except metadata.PackageNotFoundError:
            continue  # an optional platform requirement (triton, nvidia-*) not on this machine
    for name in sorted(names):
        if (site / name).exists():
            (farm / name).symlink_to(site / name)
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(purelib, "torch_only.pth").write_text(str(farm) + "\n")
    return python


def _fetch(dest: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, BYTESCALE_WHEELS=str(dest))
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--fetch-wheels",
                           "--python-version", PYTHON_VERSION],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)  # fmt: skip


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bare")
    fetched = _fetch(root / "whl")
    if fetched.returncode:
        why = (fetched.stderr or fetched.stdout).strip().splitlines()[-1:]
        if os.environ.get("CI", "").lower() != "true":
            pytest.skip(f"cannot fetch the wheels from the package registry here: {why}")
        pytest.fail(f"--fetch-wheels failed on CI: {fetched.stderr[-2000:]}")
    python = _bare_python(root)
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u, torch; print(torch.__version__, "
         "[m for m in ('numpy', 'packaging', 'megatron', 'pip') if u.find_spec(m)])"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""),
    )  # fmt: skip
    out = root / "out"
    env = dict(os.environ, PYTHON=str(python), BYTESCALE_WHEELS=str(root / "whl"),
               BYTESCALE_SITE=str(root / "site"), PYTHONPATH="",
               PYTHONWARNINGS="ignore::UserWarning", OMP_NUM_THREADS="2")  # fmt: skip
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--small",
                           "--sections", "a,f,g", "--budget-s", "450"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)  # fmt: skip
    records = []
    if (out / "gpu_check.jsonl").exists():
        records = [json.loads(x) for x in (out / "gpu_check.jsonl").read_text().splitlines()]
    return fetched, probe, done, records, sorted(p.name for p in (root / "whl").glob("*.whl"))


def test_the_bare_interpreter_has_torch_and_nothing_else(bare_run):
    _, probe, *_ = bare_run
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split(" ", 1)[1].strip() == "[]", probe.stdout


def test_fetch_wheels_brings_megatron_core_and_its_needs_but_not_torch(bare_run):
    *_, wheels = bare_run
    projects = {re.sub(r"[-_.]+", "-", w.split("-")[0]).lower() for w in wheels}
    assert {"megatron-core", "numpy", "packaging"} <= projects, wheels
    assert "torch" not in projects and not any(p.startswith("nvidia") for p in projects)
    tag = "cp" + PYTHON_VERSION.replace(".", "")
    assert all(tag in w or "py3-none-any" in w for w in wheels), wheels


def test_gpu_check_runs_from_the_wheels_without_pip(bare_run):
    _, _, done, records, _ = bare_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "without pip" in done.stdout
    assert records and records[-1]["name"] == "done" and records[-1]["failures"] == 0
    assert not [r for r in records if "error" in r], [r for r in records if "error" in r]
    measured = {r["section"] for r in records if "skipped" not in r}
    assert {"a", "f", "g"} <= measured, measured
    env = next(r for r in records if r["name"] == "environment")
    assert env.get("megatron.core"), env  # imported from the unzipped wheel
