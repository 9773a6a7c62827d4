"""Which tests touch Megatron: the ones CI also runs on the second lane (Python 3.12, 0.19.x).

CI runs the whole suite on Python 3.11 with megatron-core 0.16.1, and again, on Python 3.12
with megatron-core 0.19.x and the core_v0.19.0 tree, every test that imports megatron. Which
those are is decided here, from the source, so that a new Megatron test can never silently fall
out of the second lane: ``tests/conftest.py`` gives the ``megatron`` marker to every test whose
module

* lies in one of :data:`MEGATRON_TEST_DIRS` (the integration tests: all of them drive
  megatron-core or Megatron-LM), or
* imports ``megatron`` directly or through any chain of imports of this package or of the test
  package (imports inside functions count: they run when the test does), or
* is marked ``@pytest.mark.megatron`` by hand (a test that reaches Megatron only through a
  subprocess, say).

The analysis is static (:mod:`ast`, nothing is imported), so it costs milliseconds.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

#: Test folders (relative to the repository root) whose every test counts as a Megatron test.
MEGATRON_TEST_DIRS = ("tests/integration",)
#: The marker the second CI lane selects (``pytest -m megatron``).
MARKER = "megatron"


def _module_file(name: str, root: Path) -> Optional[Path]:
    """The source file of module ``name`` inside the repository ``root`` (None: not ours)."""
    parts = name.split(".")
    if parts[0] not in ("megatron_bytescale", "tests"):
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(path: Path, root: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it, relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # submodules
    return names


def imports_megatron(path: Path, root: Path) -> bool:
    """True if the module at ``path`` reaches ``megatron`` through any chain of imports."""
    return _reaches_megatron(Path(path).resolve(), Path(root).resolve())


@lru_cache(maxsize=None)
def _reaches_megatron(path: Path, root: Path) -> bool:
    seen: set[Path] = set()
    stack = [path]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in _imported_names(current, root):
            if name == "megatron" or name.startswith("megatron."):
                return True
            target = _module_file(name, root)
            sibling = current.parent / f"{name.split('.')[0]}.py"  # pytest's rootdir imports
            for found in (target, sibling if sibling.is_file() else None):
                if found is not None:
                    stack.append(found.resolve())
            for parent in _parents(name):  # importing a.b.c runs a/__init__ and a/b/__init__
                target = _module_file(parent, root)
                if target is not None:
                    stack.append(target.resolve())
    return False


def _parents(name: str) -> Iterable[str]:
    parts = name.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts)))


def is_megatron_test(path: Path, root: Path) -> bool:
    """True if the tests in ``path`` belong to the Megatron lane (see the module docstring)."""
    path, root = Path(path).resolve(), Path(root).resolve()
    rel = path.relative_to(root).as_posix()
    if any(rel.startswith(d.rstrip("/") + "/") for d in MEGATRON_TEST_DIRS):
        return True
    return imports_megatron(path, root)
