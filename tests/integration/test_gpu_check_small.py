"""``scripts/gpu_check.py --small``: the prepared GPU check's own code at toy sizes on the CPU.

The GPU run happens once, on a machine this suite never sees; this run keeps every section of
the script working (sections a-f, JSON lines written as it goes, the report), so the script
cannot rot between GPU runs. Also the set-up's torch detection (``scripts/detect_torch.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.jsonl"
    env = dict(os.environ, PYTHONWARNINGS="ignore::UserWarning", OMP_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--small", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
    )  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return done, records, out


def test_every_section_measures_and_passes(small_run):
    done, records, _ = small_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert records[0]["name"] == "start" and records[-1]["name"] == "done"
    assert records[-1]["failures"] == 0
    failed = [r for r in records if r.get("ok") is False or "error" in r]
    assert not failed, failed
    measured = {r["section"] for r in records if "skipped" not in r}
    assert set("abcdefg") <= measured
    names = {r["name"] for r in records}
    assert {f"ring{n}/{w}" for n in (1, 2, 3, 4, 8) for w in ("accumulator", "input")} <= names
    assert {"fp32_grads_vs_megatron", "loss_drops", "layer_fit", "pack", "ring_overhead"} <= names
    # d's speed targets are recorded, not judged, until a GPU run has set them
    overhead = next(r for r in records if r["name"] == "ring_overhead")
    assert "ok" not in overhead and overhead["target"] == 0.10 and "meets_target" in overhead
    # g: resident bytes fall with the ratio as Eq. 3 says; gradients unchanged
    offload = [r for r in records if r["section"] == "g"]
    assert [r["offload_ratio"] for r in offload] == [0.0, 0.25, 0.5, 0.75, 1.0]
    fractions = [r["resident_fraction"] for r in offload]
    assert fractions == sorted(fractions, reverse=True) and fractions[-1] < 0.5, fractions
    assert all(r["ok"] and r["grads_vs_ratio0"] == 0.0 for r in offload), offload
    grads = next(r for r in records if r["name"] == "fp32_grads_vs_megatron")
    assert grads["worst"] <= 1e-5 and grads["parameters"] > 10  # vs megatron-core's own GPT


def test_report_writes_the_gpu_section(small_run, tmp_path):
    _, _, out = small_run
    docs = tmp_path / "benchmarks.md"
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--report", str(out),
                    "--docs", str(docs)], check=True, capture_output=True, timeout=120)  # fmt: skip
    text = docs.read_text()
    assert "<!-- BEGIN gpu -->" in text and "not a GPU run" in text and "| ring8/input |" in text


def test_bad_arguments_are_one_line_errors(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--small",
                           "--sections", "a,z", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--sections: unknown ['z']" in done.stderr


def _detect_torch():
    spec = importlib.util.spec_from_file_location("detect_torch", REPO / "scripts" / "detect_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "in_venv, gpu, cuda, version, expected",
    [
        (True, False, None, "2.13.0", "reuse torch 2.13.0"),  # an activated venv with torch
        (False, True, "13.0", "2.11.0+cu130", "system torch 2.11.0+cu130"),  # NGC / conda base
        (False, True, None, "2.13.0", "mismatch torch"),  # CPU-only torch on a GPU machine
        (False, True, "12.1", "2.1.0", "mismatch torch 2.1.0"),  # too old for the runtime
        (False, False, None, "2.1.0", "none"),  # too old, no GPU: a venv with the CPU wheel
    ],
)
def test_setup_keeps_the_torch_the_machine_has(monkeypatch, in_venv, gpu, cuda, version, expected):
    import torch

    detect = _detect_torch()
    monkeypatch.setattr(detect, "has_nvidia_gpu", lambda: gpu)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(sys, "prefix", "/venv" if in_venv else sys.base_prefix)
    decision = detect.decide()
    assert decision.startswith(expected), decision


def test_detect_torch_runs_as_a_script():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "detect_torch.py")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.split()[0] in ("reuse", "system", "mismatch")


def test_the_check_imports_only_public_names():
    """The check uses the package as a user would: no ``_private`` module or name."""
    import ast

    private = []
    for script in ("gpu_check.py", "bench_ring_numerics.py"):
        tree = ast.parse((REPO / "scripts" / script).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_bytescale"):
                parts = node.module.split(".") + [alias.name for alias in node.names]
                private += [f"{script}: {node.module}" for p in parts if p.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("runtime", "integration", "planner"):
                    private.append(f"{script}: {node.value.id}.{node.attr}")
    assert not private, private
