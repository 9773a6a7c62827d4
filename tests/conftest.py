"""Suite-wide hooks: the ``megatron`` marker that selects CI's second lane.

Every test whose module touches Megatron gets the marker (the rule and why it is static:
:mod:`megatron_bytescale.testing.lanes`); ``.ci/run`` then runs ``pytest -m megatron`` on
Python 3.12 with megatron-core 0.19.x after the whole suite on Python 3.11.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_bytescale.testing.lanes import MARKER, is_megatron_test

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: imports megatron (run on both CI lanes: megatron-core 0.16.1 "
                   "and 0.19.x); given automatically, see megatron_bytescale/testing/lanes.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    verdict: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path not in verdict:
            verdict[path] = is_megatron_test(path, ROOT)
        if verdict[path]:
            item.add_marker(MARKER)
