"""accel-tune's search: the moves from a measured bottleneck (`search`), the loop that measures candidates round by
round and confirms the pick (`autopilot`), and the preset file it writes (`preset_file`); `tune.py` is the CLI."""

from __future__ import annotations

__all__: list[str] = []
