"""megatron_bytescale: ByteScale's Hybrid Data Parallelism as a Megatron-LM plugin."""

from setuptools import find_packages, setup

# The Ray loader (--bytescale-dataloader ray). In the test extra too, so CI runs its tests:
# measured 28 s to install on a 2-core machine, ~200 MB (Ray 2.60); triton is ~1 GB.
RAY_EXTRAS = ["ray>=2.9"]

MEGATRON_LM_EXTRAS = [
    "six", "regex", "pydantic>=2", "pyyaml", "psutil",
    'triton; platform_system == "Linux"',  # imported by megatron.training.initialize
]

setup(
    name="megatron_bytescale",
    version="0.1.0",
    description=(
        "Hybrid Data Parallelism (ByteScale, SIGCOMM'25) for Megatron-LM: dynamic rings, "
        "selective offload, balance scheduling"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_bytescale", "megatron_bytescale.*"]),
    install_requires=[
        "numpy>=1.24",
        # torch: any importable build is kept; scripts/setup_env.sh installs the CPU wheel
        # 2.13.0 only when none is importable (plain `pip install torch` pulls a CUDA build).
        "torch>=2.4",
        # The supported megatron-core for each Python (integration/compat.py refuses others):
        # 0.17+ declares Requires-Python>=3.12, so 0.16.1 is the newest on Python 3.10-3.11;
        # Python 3.12+ gets 0.19.x (Megatron-LM core_v0.19.0).
        'megatron-core==0.16.1; python_version < "3.12"',
        'megatron-core>=0.19.0,<0.20; python_version >= "3.12"',
        "matplotlib>=3.7",
    ],
    extras_require={
        # What Megatron-LM's `megatron.training` (pretrain_gpt.py) imports beyond the
        # megatron-core wheel; the tests run the patched pretrain_gpt.py, so `test` has them.
        "megatron-lm": MEGATRON_LM_EXTRAS,
        # tensorboard: the Megatron-LM tests read the HDP metrics back from its writer
        "test": ["pytest>=7", "hypothesis>=6.80", "tensorboard", *MEGATRON_LM_EXTRAS,
                 *RAY_EXTRAS],
        "ray": RAY_EXTRAS,
        # scripts/mutation_check.py (not part of the test suite)
        "mutation": ["mutmut==3.8.1"],
    },
    entry_points={"console_scripts": ["bytescale=megatron_bytescale.cli:main"]},
)
