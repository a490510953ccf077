"""`python -m lightning_accel.gpu_check` runs the GPU check."""

from __future__ import annotations

import sys

from lightning_accel.gpu_check.check_runner import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
