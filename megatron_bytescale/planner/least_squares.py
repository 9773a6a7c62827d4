"""The least-squares pieces every fit of the cost model shares (``CostModel.fit``, the ring
terms of :mod:`.profile`): samples checked into an array, and a solver whose coefficients are all
>= 0 (a negative coefficient fitted to noise would make some micro-batches look free)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def samples_array(samples: Iterable[Sequence[float]], what: str) -> np.ndarray:
    """``(length, value)`` samples as an (n, 2) float array; a clear error for anything else."""
    try:
        arr = np.asarray([tuple(x) for x in samples], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be pairs (length, value): {exc}") from exc
    if arr.size == 0:
        return np.zeros((0, 2))
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what} must be pairs (length, value), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr[:, 0] <= 0):
        raise ValueError(f"{what}: lengths must be > 0 and all values finite")
    return arr


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0, by trying each subset of free coefficients.

    Columns are scaled to unit norm first so that s^2 next to 1 stays well conditioned.
    """
    n = x.shape[1]
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(n)
        full[cols] = coef
        resid = float(np.sum((xs @ full - y) ** 2))
        if best is None or resid < best[0] - 1e-15 * max(1.0, abs(best[0])):
            best = (resid, full)
    if best is None:
        return [0.0] * n
    return [float(c) for c in best[1] / scale]
