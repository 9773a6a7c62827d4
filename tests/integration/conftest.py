"""Fixtures shared by the integration tests.

``patched_megatron_lm`` (session scope: the copy and patch happen once per test run) is a
patched throw-away copy of the Megatron-LM tree at the tag that fits the installed megatron-core
(``MEGATRON_LM_TAG``: core_v0.16.1 for 0.16.1, core_v0.19.0 for 0.19.x): ``$MEGATRON_LM_DIR``,
or by default the unmodified tree in ``shared/megatron-lm/<tag>`` beside the repository.
Use it with :func:`megatron_bytescale.testing.megatron_lm.run_pretrain_gpt`. Without a tree,
or without the packages ``megatron.training`` needs, the tests that use it skip with the
reason; with ``BYTESCALE_REQUIRE_MEGATRON_LM=1`` (set by ``.ci/run``) they fail instead, so
CI can never skip them silently.
"""

from __future__ import annotations

import os

import pytest

from megatron_bytescale.testing.megatron_lm import (
    MEGATRON_LM_TAG,
    REQUIRE_ENV,
    PatchedMegatronLM,
    find_megatron_lm_source,
    missing_megatron_lm_packages,
    prepare_patched_megatron_lm,
    remove_patched_megatron_lm,
)


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: the Megatron-LM tests must run here)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def patched_megatron_lm_tree(tmp_path_factory):
    """The patched copy, whether or not its ``megatron.training`` imports (patch tests)."""
    source = find_megatron_lm_source()
    if source is None:
        _unavailable(f"no Megatron-LM tree: set MEGATRON_LM_DIR to a checkout at tag "
                     f"{MEGATRON_LM_TAG}, or lay shared/megatron-lm/{MEGATRON_LM_TAG} beside the "
                     "repository")
    tree = prepare_patched_megatron_lm(source, tmp_path_factory.mktemp("megatron-lm"))
    yield tree
    remove_patched_megatron_lm(tree)


@pytest.fixture(scope="session")
def patched_megatron_lm(patched_megatron_lm_tree: PatchedMegatronLM) -> PatchedMegatronLM:
    """The patched copy, checked: the patch applied and ``megatron.training`` imports."""
    tree = patched_megatron_lm_tree
    if tree.apply.returncode != 0:
        pytest.fail(f"the patch does not apply to {tree.source}:\n{tree.apply.stdout}"
                    f"{tree.apply.stderr}")
    missing = missing_megatron_lm_packages(tree)
    if missing is not None:
        _unavailable(f"megatron.training of the patched tree does not import ({missing}); "
                     "install the test extra: pip install -e '.[test]'")
    return tree
