"""Which tests CI's second lane (Python 3.12, megatron-core 0.19) runs: every test that imports
megatron, found from the source, so a new Megatron test cannot fall out of it."""

from __future__ import annotations

from pathlib import Path

from megatron_bytescale.testing.lanes import MARKER, imports_megatron, is_megatron_test

ROOT = Path(__file__).resolve().parents[2]


def test_the_megatron_tests_of_this_suite_are_in_the_lane():
    for name in ("tests/integration/test_megatron_lm_patch.py",      # its folder
                 "tests/integration/test_megatron_versions.py",
                 "tests/planner/test_planner_data.py",              # imports megatron in a test
                 "tests/planner/test_planner_reliability.py",
                 "tests/planner/test_planner_cli.py",               # through the CLI's tools
                 "tests/sim/test_sim_cli.py"):
        assert is_megatron_test(ROOT / name, ROOT), name
    for name in ("tests/planner/test_planner_zigzag.py", "tests/runtime/test_runtime_layout.py",
                 "tests/sim/test_sim_step.py", "tests/planner/test_planner_external.py",
                 "tests/planner/test_planner_lanes.py"):
        assert not is_megatron_test(ROOT / name, ROOT), name


def test_imports_are_followed_through_modules_functions_and_relative_imports(tmp_path):
    pkg = tmp_path / "megatron_bytescale"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("def f():\n    import megatron.core.parallel_state\n")
    (pkg / "sub" / "mid.py").write_text("from .deep import f\n")
    (pkg / "clean.py").write_text("import numpy\nimport megatron_bytescale.sub\n")
    tests = tmp_path / "tests" / "planner"
    tests.mkdir(parents=True)
    (tests / "helper_cases.py").write_text("def g():\n    from megatron_bytescale.sub import mid\n")
    (tests / "test_a.py").write_text("from helper_cases import g\n")          # rootdir import
    (tests / "test_b.py").write_text("from megatron_bytescale import clean\n")
    (tests / "test_c.py").write_text("def test():\n    from megatron import core\n")
    (tests / "test_d.py").write_text("import megatron_bytescale.sub.mid as m\n")
    verdict = {p.name: imports_megatron(p, tmp_path) for p in sorted(tests.glob("test_*.py"))}
    assert verdict == {"test_a.py": True, "test_b.py": False, "test_c.py": True,
                       "test_d.py": True}
    (tmp_path / "tests" / "integration").mkdir()
    plain = tmp_path / "tests" / "integration" / "test_e.py"
    plain.write_text("import numpy\n")
    assert is_megatron_test(plain, tmp_path) and not imports_megatron(plain, tmp_path)


def test_the_marker_is_given_at_collection(request):
    assert MARKER == "megatron"
    assert request.node.get_closest_marker(MARKER) is None  # this module touches no megatron


def test_one_lane_tests_leave_the_second_lane_and_give_a_reason():
    """``one_lane`` takes a Megatron test off the second lane only, never silently."""
    import subprocess
    import sys

    target = "tests/integration/test_demo_reliability.py"
    source = (ROOT / target).read_text()
    marked = source.count("@pytest.mark.one_lane(reason=")
    assert marked == source.count("one_lane") >= 2  # every use gives its reason

    def collected(*args: str) -> set[str]:
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args, target],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return {line for line in done.stdout.splitlines() if "::" in line}

    every, lane2 = collected(), collected("-m", "megatron")
    off = every - lane2
    assert lane2 and off and all("stop" in name or "signal" in name for name in off), off
    assert len(off) == 3  # the two signal cases and the stopped worker
