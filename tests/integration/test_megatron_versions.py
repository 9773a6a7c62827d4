"""Which Megatron the plugin runs on: the supported list, the refusal of anything else, and the
tree / patch / megatron-core that each Python gets (0.16.1 on 3.10-3.11, 0.19.x on 3.12+)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_bytescale.integration import compat
from megatron_bytescale.testing.megatron_lm import MEGATRON_LM_TAG

REPO = Path(__file__).resolve().parents[2]
SUPPORTED_TEXT = ("0.16.1 (Megatron-LM core_v0.16.1)", "0.19.x (Megatron-LM core_v0.19.0)")


@pytest.mark.parametrize("version", [(0, 15, 0), (0, 99, 0), (0, 16, 0), (0, 17, 0), (0, 18, 2),
                                     (1, 19, 0)])
def test_an_unsupported_version_is_refused_with_the_supported_list(version):
    with pytest.raises(compat.UnsupportedMegatronVersion) as err:
        compat.require_supported_megatron(version)
    message = str(err.value)
    assert f"megatron-core / Megatron-LM {'.'.join(map(str, version))} is not supported" in message
    for supported in SUPPORTED_TEXT:
        assert supported in message
    assert "\n" not in message


@pytest.mark.parametrize("version, tag", [((0, 16, 1), "core_v0.16.1"), ((0, 16, 4), "core_v0.16.1"),
                                          ((0, 19, 0), "core_v0.19.0"), ((0, 19, 2), "core_v0.19.0")])
def test_supported_versions_pick_their_patch(version, tag):
    assert compat.require_supported_megatron(version) == version
    assert compat.megatron_lm_patch_tag(version) == tag
    assert (REPO / "patches" / f"megatron-lm-{tag}.patch").is_file()


def test_versions_are_read_from_package_info_strings():
    assert compat.parse_megatron_version("0.19.1rc0") == (0, 19, 1)
    assert compat.parse_megatron_version("0.16.1") == (0, 16, 1)
    with pytest.raises(compat.UnsupportedMegatronVersion, match="cannot read"):
        compat.parse_megatron_version("dev")


def test_each_python_gets_its_megatron_and_tree():
    """setup.py's pins: 0.16.1 below Python 3.12, 0.19.x from 3.12; the test tree follows."""
    from megatron.core import package_info

    installed = compat.megatron_core_version()
    assert compat.parse_megatron_version(package_info.__version__) == installed
    if sys.version_info >= (3, 12):
        assert installed[:2] == (0, 19) and MEGATRON_LM_TAG == "core_v0.19.0"
    else:
        assert installed == (0, 16, 1) and MEGATRON_LM_TAG == "core_v0.16.1"


def _fake_megatron(root: Path, major: int, minor: int, patch: int) -> Path:
    """A Megatron-LM-shaped tree whose package_info says ``major.minor.patch`` (nothing else)."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "training").mkdir()
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text(textwrap.dedent(f"""\
        MAJOR = {major}
        MINOR = {minor}
        PATCH = {patch}
        __version__ = '{major}.{minor}.{patch}'
        """))
    (root / "megatron" / "training" / "training.py").write_text("")
    (root / "pretrain_gpt.py").write_text("")
    return root


@pytest.mark.parametrize("version", [(0, 15, 0), (0, 99, 0)])
def test_start_up_and_the_patch_script_refuse_an_unsupported_megatron(tmp_path, version):
    tree = _fake_megatron(tmp_path / "Megatron-LM", *version)
    shown = ".".join(map(str, version))
    # pretrain_gpt.py's first hook (the extra-args provider): one line on stderr, exit 2
    probe = subprocess.run(
        [sys.executable, "-c", "import argparse\n"
         "from megatron_bytescale.integration import megatron_lm\n"
         "megatron_lm.chain_extra_args_provider(None)(argparse.ArgumentParser())"],
        env={"PYTHONPATH": f"{tree}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 2, probe.stderr[-3000:]
    lines = probe.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron_bytescale: error: "), probe.stderr
    assert f"Megatron-LM {shown} is not supported" in lines[0]
    assert all(s in lines[0] for s in SUPPORTED_TEXT)
    # the patch script: refused before anything is touched, with the list
    script = subprocess.run(["bash", str(REPO / "scripts" / "apply_megatron_patches.sh"),
                             str(tree)], capture_output=True, text=True, timeout=60)
    assert script.returncode == 1
    assert f"is Megatron-LM {shown}; megatron_bytescale supports" in script.stderr
    assert "core_v0.16.1" in script.stderr and "core_v0.19.0" in script.stderr
    assert (tree / "pretrain_gpt.py").read_text() == ""


def test_megatron_tests_carry_the_marker_of_the_second_lane(request):
    """tests/conftest.py marks them at collection: `pytest -m megatron` (lane 2) selects this."""
    assert request.node.get_closest_marker("megatron") is not None


def test_the_moe_log_tracker_is_forgotten_so_a_deeper_model_can_log():
    """megatron-core sizes a log-tracker entry by the first model that records it; after
    ``forget_moe_log_tracker`` a model with more MoE layers records past the first one's size
    (what the MoE spawn's 4-layer reference needs after the 2-layer ones)."""
    import torch

    def record(layer: int, layers: int) -> None:
        value = torch.ones([])
        if compat.megatron_core_version() >= (0, 17, 0):
            from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

            get_moe_metrics_tracker().record("z_loss", value, layer, layers)
        else:
            from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

            save_to_aux_losses_tracker("z_loss", value, layer, layers)

    compat.forget_moe_log_tracker()
    record(2, 2)
    assert compat.moe_log_tracker_values("z_loss").tolist() == [0.0, 1.0]
    with pytest.raises(IndexError):  # the entry keeps its first size
        record(4, 4)
    compat.forget_moe_log_tracker()
    assert compat.moe_log_tracker_values("z_loss") is None
    record(4, 4)
    assert compat.moe_log_tracker_values("z_loss").tolist() == [0.0, 0.0, 0.0, 1.0]
    compat.forget_moe_log_tracker()
