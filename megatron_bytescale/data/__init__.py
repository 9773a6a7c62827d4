"""Length metadata for the planner: file readers and synthetic distributions (numpy only here;
the Megatron ``.idx`` reader lives in :mod:`megatron_bytescale.integration.indexed_lengths`)."""

from .lengths import LengthsFileError, read_lengths, write_lengths
from .synthetic import GENERATORS, byted, github, lognormal, synthetic_lengths, uniform

__all__ = [
    "GENERATORS",
    "LengthsFileError",
    "byted",
    "github",
    "lognormal",
    "read_lengths",
    "synthetic_lengths",
    "uniform",
    "write_lengths",
]
