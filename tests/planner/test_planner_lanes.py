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
