"""`python -m lightning_accel.dash` runs accel-dash."""

from __future__ import annotations

import sys

from lightning_accel.dash.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
