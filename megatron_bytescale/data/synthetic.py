"""Synthetic global batches of sequence lengths (numpy only), for planning without data.

Every generator takes ``global_tokens`` (the batch sums to exactly this), ``seed`` and
``max_length`` (the context; default 2M = 2,097,152) and returns an int64 array of lengths in
random order.

``github`` and ``byted`` reproduce the data statistics the paper reports (paper.md §1.2, §8.2):

======================================================  =========  ===================
statistic (paper)                                       target     our mixture
======================================================  =========  ===================
Byted: samples <= 4K                                    ~80 %      80 %
Byted: samples at the 2M context                        0.05 %     0.05 %
Byted: tokens in those 2M samples                       12.1 %     12.1 % (rounded to whole sequences)
Byted: samples >= 128K                                  1 %        0.94 %
Byted: tokens in samples >= 128K                        44.3 %     44.3 %
Byted: tokens in samples > 256K                         37 %       37 %
GitHub: tokens in samples > 128K                        16.2 %     16.2 %
GitHub: tokens in samples > 256K                        9.8 %      9.8 %
======================================================  =========  ===================

The paper gives no sample-count shape for GitHub; we assume ~73 % of samples <= 2K (the "72 %"
label in Fig. 4's OCR, probably the smallest bucket) and no sequence at the full 2M.

How: each dataset is a mixture of length buckets ``[lo, hi)``, log-uniform inside, with a
*token* share per bucket (plus a point mass at ``max_length`` for Byted). A bucket's expected
sample count is ``global_tokens * share / mean_length``. Buckets of 8K tokens and more get that
count rounded, lengths at stratified quantiles, scaled so the bucket holds exactly its token
share (every batch carries its share of long sequences instead of a Poisson number of them,
so a 32M-token batch reproduces the statistics every time; a bucket whose share is less than
one sequence in a small batch gives its tokens to the short fill); the short
buckets are then drawn i.i.d., in proportion to their expected counts, until the batch holds
exactly ``global_tokens`` (the last one is cut). The mixture is calibrated at a 2M context;
with a shorter ``max_length`` lengths are clipped to it (documents longer than the context are
truncated, as a data pipeline would).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np

DEFAULT_MAX_LENGTH = 2_097_152
K = 1024


@dataclass(frozen=True)
class LengthMixture:
    """Buckets ``(lo, hi, token_share)`` (log-uniform in [lo, hi)) and a point mass at max_length."""

    name: str
    buckets: tuple[tuple[int, int, float], ...]
    point_mass_share: float = 0.0
    fill_below: int = 8 * K
    """Buckets with ``hi <= fill_below`` are drawn i.i.d. to fill the batch; the rest are stratified."""


BYTED = LengthMixture(
    name="byted",
    buckets=(
        (64, 1 * K, 0.0123),
        (1 * K, 4 * K + 1, 0.1277),
        (4 * K, 16 * K, 0.130),
        (16 * K, 64 * K, 0.200),
        (64 * K, 128 * K, 0.087),
        (128 * K, 256 * K + 1, 0.073),
        (256 * K + 1, 512 * K, 0.229),
        (512 * K, 2048 * K, 0.020),
    ),
    point_mass_share=0.121,
)

GITHUB = LengthMixture(
    name="github",
    buckets=(
        (32, 512, 0.020),
        (512, 2 * K, 0.100),
        (2 * K, 8 * K, 0.260),
        (8 * K, 32 * K, 0.240),
        (32 * K, 128 * K, 0.218),
        (128 * K + 1, 256 * K + 1, 0.064),
        (256 * K + 1, 2048 * K, 0.098),
    ),
)


def _check(global_tokens: int, seed: int, max_length: int) -> None:
    for name, v, lo in (("global_tokens", global_tokens, 1), ("max_length", max_length, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
            raise ValueError(f"{name} ({v!r}) must be an integer >= {lo}")


def _log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    x = np.exp(rng.uniform(math.log(lo), math.log(hi), size=n))
    return np.clip(np.floor(x).astype(np.int64), lo, hi - 1)


def _stratified_bucket(rng: np.random.Generator, lo: int, hi: int, n: int, tokens: float) -> np.ndarray:
    """``n`` lengths in [lo, hi) at stratified log-uniform quantiles, scaled to sum to ``tokens``.

    One draw per quantile slice ((i + u) / n) instead of n independent draws, and the scaling,
    make the bucket's token share the same in every batch (a few long sequences would otherwise
    swing it by tens of percent).
    """
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    q = (np.arange(n) + rng.uniform(size=n)) / n
    x = np.exp(math.log(lo) + q * (math.log(hi) - math.log(lo)))
    x *= tokens / x.sum()
    return np.clip(np.round(x), lo, hi - 1).astype(np.int64)


def _bucket_mean(lo: int, hi: int) -> float:
    return (hi - lo) / math.log(hi / lo)


def sample_mixture(mix: LengthMixture, global_tokens: int, *, seed: int = 0,
                   max_length: int = DEFAULT_MAX_LENGTH) -> np.ndarray:
    """Draw a batch of exactly ``global_tokens`` tokens from ``mix`` (see the module docstring)."""
    _check(global_tokens, seed, max_length)
    rng = np.random.default_rng(seed)
    strat: list[np.ndarray] = []
    fill_p: list[float] = []
    fill_b: list[tuple[int, int]] = []
    for lo, hi, share in mix.buckets:
        expected = global_tokens * share / _bucket_mean(lo, hi)
        if hi <= mix.fill_below:
            fill_b.append((lo, hi))
            fill_p.append(expected)
        else:
            strat.append(_stratified_bucket(rng, lo, hi, int(round(expected)), global_tokens * share))
    if mix.point_mass_share > 0:
        strat.append(np.full(int(round(global_tokens * mix.point_mass_share / DEFAULT_MAX_LENGTH)),
                            DEFAULT_MAX_LENGTH, dtype=np.int64))
    long_ = np.minimum(np.concatenate(strat) if strat else np.zeros(0, dtype=np.int64), max_length)
    long_ = rng.permutation(long_)
    cum = np.cumsum(long_)
    keep = int(np.searchsorted(cum, global_tokens, side="left"))
    if keep < len(long_):  # a tiny batch: the long sequences alone fill it
        out = long_[: keep + 1].copy()
        out[-1] -= int(cum[keep]) - global_tokens
        return rng.permutation(out[out > 0])
    budget = global_tokens - (int(cum[-1]) if len(cum) else 0)
    short = _fill(rng, fill_b, np.asarray(fill_p), budget, max_length)
    return rng.permutation(np.concatenate([long_, short]).astype(np.int64))


def _fill(rng: np.random.Generator, buckets: list[tuple[int, int]], weights: np.ndarray,
          budget: int, max_length: int) -> np.ndarray:
    if budget <= 0:
        return np.zeros(0, dtype=np.int64)
    if not buckets:
        buckets, weights = [(1, max(2, min(max_length, 4 * K) + 1))], np.ones(1)
    p = weights / weights.sum()
    mean = float(sum(pi * _bucket_mean(lo, hi) for pi, (lo, hi) in zip(p, buckets)))
    parts: list[np.ndarray] = []
    total = 0
    while total < budget:
        n = max(16, int((budget - total) / mean * 1.1))
        which = rng.choice(len(buckets), size=n, p=p)
        draw = np.empty(n, dtype=np.int64)
        for b, (lo, hi) in enumerate(buckets):
            idx = np.flatnonzero(which == b)
            draw[idx] = _log_uniform(rng, lo, hi, len(idx))
        draw = np.minimum(draw, max_length)
        parts.append(draw)
        total += int(draw.sum())
    return _trim_to_budget(np.concatenate(parts), budget)


def byted(global_tokens: int, *, seed: int = 0, max_length: int = DEFAULT_MAX_LENGTH) -> np.ndarray:
    """A Byted-like batch (production long-context data, paper §2 Fig. 4)."""
    return sample_mixture(BYTED, global_tokens, seed=seed, max_length=max_length)


def github(global_tokens: int, *, seed: int = 0, max_length: int = DEFAULT_MAX_LENGTH) -> np.ndarray:
    """A GitHub-like batch (open-source code, paper §2 Fig. 4)."""
    return sample_mixture(GITHUB, global_tokens, seed=seed, max_length=max_length)


def lognormal(global_tokens: int, *, seed: int = 0, max_length: int = DEFAULT_MAX_LENGTH,
              median: float = 4096.0, sigma: float = 1.5) -> np.ndarray:
    """Log-normal lengths (median ``median``, log-space std ``sigma``), clipped to [1, max_length]."""
    _check(global_tokens, seed, max_length)
    if not median > 0 or not sigma > 0:
        raise ValueError(f"median ({median!r}) and sigma ({sigma!r}) must be > 0")
    rng = np.random.default_rng(seed)
    return _draw_until(global_tokens, lambda n: np.clip(
        np.round(rng.lognormal(math.log(median), sigma, size=n)), 1, max_length).astype(np.int64),
        mean=min(float(max_length), median * math.exp(sigma * sigma / 2)))


def uniform(global_tokens: int, *, seed: int = 0, max_length: int = DEFAULT_MAX_LENGTH,
            min_length: int = 1) -> np.ndarray:
    """Lengths uniform in [min_length, max_length]."""
    _check(global_tokens, seed, max_length)
    if not 1 <= min_length <= max_length:
        raise ValueError(f"min_length ({min_length!r}) must be in [1, max_length={max_length}]")
    rng = np.random.default_rng(seed)
    return _draw_until(global_tokens, lambda n: rng.integers(min_length, max_length + 1, size=n, dtype=np.int64),
                       mean=(min_length + max_length) / 2)


def _draw_until(budget: int, draw: Callable[[int], np.ndarray], *, mean: float) -> np.ndarray:
    parts, total = [], 0
    while total < budget:
        d = draw(max(16, int((budget - total) / mean * 1.1)))
        parts.append(d)
        total += int(d.sum())
    return _trim_to_budget(np.concatenate(parts), budget)


def _trim_to_budget(lengths: np.ndarray, budget: int) -> np.ndarray:
    """The shortest prefix holding ``budget`` tokens, its last length cut so the sum is exact."""
    cum = np.cumsum(lengths)
    last = int(np.searchsorted(cum, budget, side="left"))
    out = lengths[: last + 1].copy()
    out[-1] -= int(cum[last]) - budget
    return out[out > 0]


GENERATORS: dict[str, Callable[..., np.ndarray]] = {
    "github": github,
    "byted": byted,
    "lognormal": lognormal,
    "uniform": uniform,
}


def synthetic_lengths(name: str, global_tokens: int, *, seed: int = 0,
                      max_length: int = DEFAULT_MAX_LENGTH) -> np.ndarray:
    """Lengths from the generator ``name`` (one of :data:`GENERATORS`)."""
    if name not in GENERATORS:
        raise ValueError(f"unknown synthetic dataset {name!r}; choose one of {sorted(GENERATORS)}")
    return GENERATORS[name](global_tokens, seed=seed, max_length=max_length)
