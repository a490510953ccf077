"""Hydra search-path plugin: lets any Hydra app select lightning_accel's config groups (see searchpath.py)."""
