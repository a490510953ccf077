"""NCCL environment presets: the variables each one sets, computed from the machine's facts, never overriding yours."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lightning_accel.errors import ConfigError
from lightning_accel.system.host import IbPort, read_infiniband

__all__ = ["NCCL_PRESETS", "NcclPlan", "default_route_interface", "nccl_plan"]

NCCL_PRESETS = ("none", "auto", "ib", "socket", "nvls_off", "debug")


@dataclass(frozen=True)
class NcclPlan:
    """What a preset does to the environment of this process (and of the ranks it launches)."""

    preset: str
    set: dict[str, str] = field(default_factory=dict)
    """Variables to set: the preset's, minus those already in the environment."""
    kept: dict[str, str] = field(default_factory=dict)
    """Variables the preset would set but the user already set (their value, which wins)."""
    notes: list[str] = field(default_factory=list)
    """Why each choice was made, for the log."""

    def apply(self, env: dict[str, str] | os._Environ[str] | None = None) -> Callable[[], None]:
        """Write `set` into `env` (None: `os.environ`, inherited by every rank Lightning launches); returns the undo,
        which removes what this call added (a value changed since is left alone), so the next job of a
        same-process multirun starts from the user's environment, not this job's."""
        target = os.environ if env is None else env
        added = {key: value for key, value in self.set.items() if key not in target}
        target.update(added)

        def undo() -> None:
            for key, value in added.items():
                if target.get(key) == value:
                    del target[key]
            added.clear()

        return undo

    def describe(self) -> str:
        parts = [f"nccl={self.preset}: set " + (", ".join(f"{k}={v}" for k, v in self.set.items()) or "nothing")]
        if self.kept:
            parts.append("kept yours: " + ", ".join(f"{k}={v}" for k, v in self.kept.items()))
        return "; ".join(parts + self.notes)


def default_route_interface(root: str | os.PathLike[str] = "/") -> str | None:
    """The network interface of the default route (`<root>/proc/net/route`), the one NCCL's sockets should use."""
    try:
        lines = Path(root, "proc", "net", "route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":  # destination 0.0.0.0
            return fields[0]
    return None


def _active_hcas(ports: tuple[IbPort, ...]) -> list[str]:
    return sorted({p.device for p in ports if p.active})


def nccl_plan(
    preset: str,
    *,
    root: str | os.PathLike[str] = "/",
    env: Mapping[str, str] | None = None,
    socket_ifname: str | None = None,
    num_nodes: int = 1,
    trace_dir: str | None = None,
) -> NcclPlan:
    """The NCCL variables `preset` sets on this machine; variables already in `env` are kept, not overridden.

    Presets:
        none: nothing.
        auto: async error handling (a dead rank ends the job instead of hanging it); with ACTIVE InfiniBand or RoCE
            ports, `NCCL_IB_HCA` lists their devices; with none and several nodes, `NCCL_IB_DISABLE=1` and
            `NCCL_SOCKET_IFNAME` is the default route's interface. NVLink needs nothing: NCCL finds it.
        ib: InfiniBand/RoCE required: `NCCL_IB_DISABLE=0`, `NCCL_IB_HCA` = the ACTIVE devices (error if none).
        socket: TCP sockets: `NCCL_IB_DISABLE=1`, `NCCL_SOCKET_IFNAME` = `socket_ifname` or the default route's one.
        nvls_off: `NCCL_NVLS_ENABLE=0` (NVLink SHARP off: it reserves memory and has hung on some drivers).
        debug: `NCCL_DEBUG=INFO` (`INIT,NET` subsystems) and torch's flight recorder, dumped on a collective
            timeout into `trace_dir`.

    Raises:
        ValueError: for an unknown preset, or `ib` on a machine without an ACTIVE RDMA port.
    """
    if preset not in NCCL_PRESETS:
        raise ConfigError(
            f"`preset={preset!r}` is not an NCCL preset; use one of {', '.join(NCCL_PRESETS)}.", setting="preset"
        )
    env = os.environ if env is None else env
    wanted: dict[str, str] = {}
    notes: list[str] = []
    if preset in ("auto", "ib", "socket", "debug"):
        wanted["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    if preset in ("auto", "ib"):
        preset_socket = False
        ports = read_infiniband(root)
        hcas = _active_hcas(ports)
        if hcas:
            layers = sorted({p.link_layer or "?" for p in ports if p.active})
            wanted.update({"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": ",".join(hcas)})
            notes.append(f"ACTIVE RDMA ports on {', '.join(hcas)} ({'/'.join(layers)})")
        elif preset == "ib":
            states = ", ".join(f"{p.device}:{p.port} {p.state}" for p in ports) or "no device"
            raise ConfigError(
                f"`preset='ib'` needs an ACTIVE InfiniBand/RoCE port under /sys/class/infiniband, found: {states}; "
                "use `preset='socket'` or `preset='auto'`.",
                setting="preset",
            )
        elif num_nodes > 1:
            preset_socket = True
            notes.append("no ACTIVE InfiniBand/RoCE port: NCCL uses TCP sockets between nodes")
        else:
            notes.append("no InfiniBand/RoCE port; one node: NCCL uses NVLink/PCIe, nothing to set")
        if preset_socket:
            wanted.update(_socket_vars(root, socket_ifname, notes))
    if preset == "socket":
        wanted.update(_socket_vars(root, socket_ifname, notes))
    if preset == "nvls_off":
        wanted["NCCL_NVLS_ENABLE"] = "0"
    if preset == "debug":
        wanted.update(
            {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,NET",
                "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            }
        )
        if trace_dir:
            wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(trace_dir, "nccl_trace_rank_"))
    to_set = {k: v for k, v in wanted.items() if k not in env}
    kept = {k: env[k] for k in wanted if k in env}
    return NcclPlan(preset=preset, set=to_set, kept=kept, notes=notes)


def _socket_vars(root: str | os.PathLike[str], socket_ifname: str | None, notes: list[str]) -> dict[str, str]:
    found = socket_ifname or default_route_interface(root)
    variables = {"NCCL_IB_DISABLE": "1"}
    if found:
        variables["NCCL_SOCKET_IFNAME"] = found
        notes.append(f"sockets over {found}" + ("" if socket_ifname else " (the default route's interface)"))
    else:
        variables["NCCL_SOCKET_IFNAME"] = "^lo,docker"
        notes.append("no default route found: any interface but loopback and docker")
    return variables
