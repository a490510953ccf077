"""The environment a test's subprocess starts from: this process's, without the variables of a distributed launch."""

from __future__ import annotations

import os

# Set by an in-process distributed fit (Lightning's launcher writes them into os.environ); a subprocess that inherits
# LOCAL_RANK believes its ranks were launched for it and waits for them forever.
DISTRIBUTED_ENV = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
)


def clean_env(**extra: str) -> dict[str, str]:
    """`os.environ` without `DISTRIBUTED_ENV`, with `extra` set."""
    return {**{k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}, **extra}
