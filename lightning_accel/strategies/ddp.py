"""DDPStrategy with separate timeouts for joining the process group and for each collective."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel.errors import ConfigError, LightningAccelWarning

__all__ = ["DDPStrategy"]

log = logging.getLogger(__name__)


def _seconds(name: str, value: float | timedelta) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"`{name}={value!r}` must be a positive number of seconds.", setting=name)
    return timedelta(seconds=value)


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's DDPStrategy, with `init_timeout_s` for the rendezvous and `timeout_s` for every collective.

    A job whose ranks start minutes apart (a slow node, a queue) needs a long wait to join; a collective that
    hangs (a dead rank, a deadlock) should fail fast. torch's single `timeout` cannot do both.

    Args:
        init_timeout_s: seconds to wait for every rank to join the process group.
        timeout_s: seconds a collective may wait before the job fails (NCCL: with
            `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`, which `nccl=auto` sets, the process is torn down); 1800 when
            neither it nor `timeout` is given.
        timeout: Lightning's own argument, accepted as it is there (a `timedelta`, or seconds): the collective
            timeout, as `timeout_s`.
        **kwargs: Lightning's DDPStrategy arguments (and DistributedDataParallel's).

    Raises:
        ConfigError: (a ValueError) for a timeout that is not a positive number of seconds, or both `timeout` and
            `timeout_s`.
    """

    def __init__(
        self,
        *,
        init_timeout_s: float | timedelta = 600.0,
        timeout_s: float | timedelta | None = None,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if timeout is not None and timeout_s is not None:
            raise ConfigError(
                f"`timeout={timeout!r}` and `timeout_s={timeout_s!r}` both set the collective timeout; give one.",
                setting="timeout_s",
            )
        self.init_timeout = _seconds("init_timeout_s", init_timeout_s)
        if timeout is not None:
            self.collective_timeout = _seconds("timeout", timeout)
        else:
            self.collective_timeout = _seconds("timeout_s", 1800.0 if timeout_s is None else timeout_s)
        super().__init__(timeout=self.collective_timeout, **kwargs)

    @override
    def setup_distributed(self) -> None:
        import torch.distributed as dist

        self._timeout = self.init_timeout
        waited = self.init_timeout.total_seconds()
        environment = self.cluster_environment
        assert environment is not None, "Lightning gives a DDPStrategy its cluster environment before the setup"
        where = f"{environment.main_address}:{environment.main_port}"
        if self.num_nodes > 1 and self.local_rank == 0:
            log.info(
                f"node {self.node_rank}: waiting up to {waited:g} s (`init_timeout_s`) for "
                f"{self.num_nodes} nodes x {self.num_processes} processes to join at {where}"
            )
        try:
            super().setup_distributed()
        except Exception as err:
            text = str(err).lower()
            store_errors = tuple(
                getattr(dist, name) for name in ("DistStoreError", "DistNetworkError") if hasattr(dist, name)
            )
            if not isinstance(err, store_errors) and not any(
                k in text for k in ("timed out", "timeout", "waiting for clients")
            ):
                raise
            raise ConfigError(
                f"the job has {self.num_nodes} node(s) x {self.num_processes} process(es) (the Trainer's "
                f"num_nodes={self.num_nodes}), but not all of them joined at {where} within {waited:g} s "
                f"(`init_timeout_s={waited:g}`): {str(err).rstrip('.')}. Start the same command on every node with "
                "its NODE_RANK and the same MASTER_ADDR/MASTER_PORT (or launch with torchrun/srun), check that the "
                "nodes reach that address, or set the Trainer's num_nodes to the nodes you have.",
                setting="init_timeout_s",
            ) from None
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
