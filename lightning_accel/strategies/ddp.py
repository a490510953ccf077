"""DDPStrategy with separate timeouts for joining the process group and for each collective."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel.errors import LightningAccelWarning

__all__ = ["DDPStrategy"]


def _seconds(name: str, value: float | timedelta) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"`{name}={value!r}` must be a positive number of seconds.")
    return timedelta(seconds=value)


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's DDPStrategy, with `init_timeout_s` for the rendezvous and `timeout_s` for every collective.

    A job whose ranks start minutes apart (a slow node, a queue) needs a long wait to join; a collective that
    hangs (a dead rank, a deadlock) should fail fast. torch's single `timeout` cannot do both.

    Args:
        init_timeout_s: seconds to wait for every rank to join the process group.
        timeout_s: seconds a collective may wait before the job fails (NCCL: with
            `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`, which `nccl=auto` sets, the process is torn down).
        **kwargs: Lightning's DDPStrategy arguments (and DistributedDataParallel's).
    """

    def __init__(self, *, init_timeout_s: float | timedelta = 600.0, timeout_s: float | timedelta = 1800.0,
                 **kwargs: Any) -> None:  # fmt: skip
        self.init_timeout = _seconds("init_timeout_s", init_timeout_s)
        self.collective_timeout = _seconds("timeout_s", timeout_s)
        super().__init__(timeout=self.collective_timeout, **kwargs)

    @override
    def setup_distributed(self) -> None:
        import torch.distributed as dist

        self._timeout = self.init_timeout
        try:
            super().setup_distributed()
        finally:
            self._timeout = self.collective_timeout
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is None or self.init_timeout == self.collective_timeout:
            if set_timeout is None:
                rank_zero_warn(
                    "This torch cannot change a process group's timeout after init; collectives use "
                    f"`init_timeout_s={self.init_timeout.total_seconds():g}`.",
                    category=LightningAccelWarning,
                )
            return
        set_timeout(self.collective_timeout)
