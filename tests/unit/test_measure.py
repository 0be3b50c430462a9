"""The one percentile every benchmark and `ib bench profiles` report (ops/measure.py)."""

from __future__ import annotations

import statistics

import pytest

from ops.measure import percentile


def test_percentile_interpolates_like_numpy_and_agrees_with_the_median():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    assert percentile(values, 50) == statistics.median(values)
    assert percentile(values, 90) == pytest.approx(statistics.quantiles(values, n=10, method="inclusive")[-1])
    assert (percentile(values, 0), percentile(values, 100)) == (1.0, 9.0)
    assert percentile([7.0], 95) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
