"""The one way a percentile is computed: every benchmark, and `ib bench profiles`.

Three definitions were in use (nearest rank rounded, nearest rank truncated, and the
median), so two tables could give different p95s for the same run. This is numpy's
default: linear interpolation between the closest ranks, which agrees with
``statistics.median`` at 50 and ``statistics.quantiles(method="inclusive")`` elsewhere.
"""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
