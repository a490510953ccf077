"""Argument checks shared by the example DataModules."""

from __future__ import annotations

__all__ = ["check_split_settings"]


def check_split_settings(val_fraction: float, test_fraction: float, num_workers: int, **positive: int) -> None:
    """Raise ValueError, naming the `data.*` setting and the fix, for a split or loader setting that cannot work.

    Args:
        val_fraction: share of the data held out for validation, within (0, 1).
        test_fraction: share held out for testing, within (0, 1); together with `val_fraction` below 1.
        num_workers: DataLoader worker processes, >= 0.
        **positive: settings that must be >= 1 (`batch_size=32`, ...).
    """
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"`data.{name}={value}` must be >= 1.")
    for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"`data.{name}={fraction}` must be within (0, 1).")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"`data.val_fraction={val_fraction}` plus `data.test_fraction={test_fraction}` must be below 1 to "
            "leave data for training; lower one of them."
        )
    if num_workers < 0:
        raise ValueError(f"`data.num_workers={num_workers}` must be >= 0.")
