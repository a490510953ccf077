"""lightning_accel.measure: intervals, paired ratios, verdicts and interleaving (the interference probe is
`system.interference`'s: tests/system/test_interference.py)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from lightning_accel import measure
from lightning_accel.measure import Interval, interleaved, ratio, summarize, verdict


def test_small_samples_get_their_range_and_larger_ones_a_bootstrap() -> None:
    assert summarize([3.0]) == Interval(3.0, 3.0, 3.0, 1, "single")
    assert summarize([1.0, 3.0, 2.0]) == Interval(2.0, 1.0, 3.0, 3, "min-max")
    many = summarize([10.0, 11.0, 9.0, 10.5, 9.5, 10.2, 30.0])  # one outlier
    assert many.method == "bootstrap 95%" and many.median == 10.2
    assert many.low >= 9.0 and many.high < 30.0  # the median's interval, not the range
    assert summarize([10.0, 11.0, 9.0, 10.5, 9.5, 10.2, 30.0]) == many  # fixed seed: reproducible
    assert summarize([1.0, math.nan, None, 2.0]).n == 2  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no finite"):
        summarize([math.inf])


def test_ratios_pair_the_values_of_one_round() -> None:
    # round 2 ran under load: both sides slowed alike, and the paired ratio stays put
    paired = ratio([10.0, 20.0], [5.0, 10.0])
    assert (paired.median, paired.low, paired.high) == (2.0, 2.0, 2.0)
    # a missing value drops its round; with no full pair, every combination is summarized
    assert ratio([10.0, None, 12.0], [5.0, 6.0, None]).n == 1
    unpaired = ratio([10.0, None], [None, 5.0])
    assert unpaired.median == 2.0


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(1.1, 1.3, "faster"), (0.7, 0.95, "slower"), (0.9, 1.2, "no clear difference"), (1.0, 1.2, "no clear difference")],
)
def test_an_interval_holding_one_is_no_clear_difference(low: float, high: float, expected: str) -> None:
    assert verdict(Interval((low + high) / 2, low, high, 3, "min-max")) == expected


def test_interleaving_runs_every_item_once_per_round() -> None:
    assert list(interleaved("ab", 2)) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    with pytest.raises(ValueError, match="repeats"):
        list(interleaved("ab", 0))


def test_measure_imports_no_lightning() -> None:
    code = "import sys, lightning_accel.measure; print(any(m.split('.')[0] == 'lightning' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert measure.__all__


def test_measure_and_system_do_not_import_each_other() -> None:
    """The interference probe is `system.interference`'s: measure (statistics) and system (facts) stay apart."""
    code = "import sys, lightning_accel.measure; print(sorted(m for m in sys.modules if '.system' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
