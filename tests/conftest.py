"""Suite-wide hooks: the ``megatron`` marker that selects CI's second lane.

Every test whose module touches Megatron gets the marker (the rule and why it is static:
:mod:`megatron_bytescale.testing.lanes`); ``.ci/run`` then runs ``pytest -m megatron`` on
Python 3.12 with megatron-core 0.19.x after the whole suite on Python 3.11. A test marked
``one_lane`` by hand, with its reason, stays on the first lane: what it checks does not change
with megatron-core's version, and the second lane's minutes are CI's scarcest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_bytescale.testing.lanes import MARKER, is_megatron_test

ROOT = Path(__file__).resolve().parents[1]


#: A hand marker for a Megatron test whose subject does not depend on megatron-core's version
#: (the launcher's signal handling, say): it runs on lane 1 only. It must give its reason.
ONE_LANE = "one_lane"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: imports megatron (run on both CI lanes: megatron-core 0.16.1 "
                   "and 0.19.x); given automatically, see megatron_bytescale/testing/lanes.py")
    config.addinivalue_line(
        "markers", f"{ONE_LANE}(reason): a Megatron test whose subject does not depend on "
                   "megatron-core's version; runs on the first CI lane only")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    verdict: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path not in verdict:
            verdict[path] = is_megatron_test(path, ROOT)
        one_lane = item.get_closest_marker(ONE_LANE)
        if one_lane is not None and not one_lane.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{ONE_LANE} needs reason=...")
        if verdict[path] and one_lane is None:
            item.add_marker(MARKER)
