"""Run the machine checks of `accel-doctor` on every rank at setup and stop the fit on a failure, naming the node."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.errors import ConfigError, LightningAccelWarning, PreflightError
from lightning_accel.system.doctor_checks import CHECKS, STATUSES, CheckRequest, run_checks
from lightning_accel.system.facts import collect_facts
from lightning_accel.system.host import hostname

__all__ = ["Preflight"]

Row = dict[str, Any]  # one rank's results: rank, node, host, checks (each a dict of Check's fields)


class Preflight(Callback):
    """Check the machine on every rank before the first training step: driver vs CUDA, GPUs, NCCL, cgroups, shm, ...

    At `setup` of a fit each rank reads its own facts (NVML, cgroup CPU quota and memory limit, `/dev/shm`,
    InfiniBand ports, `NCCL_*` variables, installed versions) and runs the checks `accel-doctor` prints. The results
    are gathered on every rank, so rank zero can name a bad node and every rank reaches the same decision: a FAIL
    anywhere raises `PreflightError` on all ranks (none is left waiting in a collective) with the node, rank, check
    and fix, before any training step; WARN results are warned once, on rank zero.

    Keeps identical: the whole fit, on a machine whose checks pass or only warn (the zoo).
    Changes on purpose: nothing in training.
    Cannot serve: a machine with a FAIL check: `PreflightError` on every rank before the first step, naming the check
        and the fix.

    Logs:
        nothing; its checks are reported at INFO and as warnings.

    Args:
        fail_on: "FAIL" stops on failures only; "WARN" stops on warnings too.
        checks: names of the checks to run (see `lightning_accel.system.CHECKS`); None runs them all.
        num_workers: DataLoader workers per process, to judge `/dev/shm`, CPUs and memory; None judges against the
            workers the CPU budget suggests and never fails on `/dev/shm` alone.
        root: the file-system root facts are read under; tests pass a fake tree.
        interference_s: how long each rank watches other processes' CPU use on its CPUs (the `threads` check);
            0 skips it. Not measured under a fake `root`.

    Raises:
        ValueError: for an unknown check name, a bad `fail_on` or a negative `num_workers`.
        PreflightError: at setup, when a check fails on any rank.

    Example::

        trainer = Trainer(callbacks=[Preflight(num_workers=8)])
    """

    def __init__(
        self,
        fail_on: Literal["FAIL", "WARN"] = "FAIL",
        checks: Sequence[str] | None = None,
        num_workers: int | None = None,
        root: str | os.PathLike[str] = "/",
        interference_s: float = 0.5,
    ) -> None:
        if fail_on not in ("FAIL", "WARN"):
            raise ConfigError(f"`fail_on={fail_on!r}` is not supported; use 'FAIL' or 'WARN'.")
        if isinstance(checks, str):
            checks = [checks]
        unknown = [name for name in checks or () if name not in CHECKS]
        if unknown:
            raise ConfigError(f"`checks` names unknown check(s) {unknown}; choose from {list(CHECKS)}.")
        if num_workers is not None and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
        ):
            raise ConfigError(f"`num_workers={num_workers!r}` must be an integer >= 0 or None.")
        if not isinstance(interference_s, (int, float)) or not interference_s >= 0:  # NaN too
            raise ConfigError(f"`interference_s={interference_s!r}` must be a number of seconds >= 0.")
        self.fail_on = fail_on
        self.checks = None if checks is None else list(checks)
        self.num_workers = num_workers
        self.root = str(root)
        self.interference_s = float(interference_s)
        self.results: list[Row] = []
        """Every rank's results of the last setup, in rank order."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        cuda = isinstance(trainer.accelerator, CUDAAccelerator)
        request = CheckRequest(
            gpus=trainer.num_devices if cuda else 0,
            processes=trainer.num_devices,
            num_workers=self.num_workers,
            num_nodes=trainer.num_nodes,
            intra_op_threads=torch.get_num_threads(),
        )
        watch = self.interference_s if os.path.realpath(self.root) == "/" else 0.0
        try:
            checks = [
                dataclasses.asdict(check)
                for check in run_checks(collect_facts(self.root, interference_s=watch), request, self.checks)
            ]
        except Exception as err:  # a bug here must not leave the other ranks waiting in the gather below
            checks = [
                {
                    "name": "preflight",
                    "status": "WARN",
                    "detail": f"the checks crashed ({type(err).__name__}: {err})",
                    "fix": "run `accel-doctor` on this node and report the traceback",
                }
            ]
        local: Row = {"rank": trainer.global_rank, "node": trainer.node_rank, "host": hostname(), "checks": checks}
        self.results = _gather(local)
        stop = ("FAIL", "WARN") if self.fail_on == "WARN" else ("FAIL",)
        counts = ", ".join(f"{n} {s}" for s, n in _counts(self.results).items())
        rank_zero_info(f"Preflight on {len(self.results)} rank(s): {counts}")
        warned = _grouped(self.results, ("WARN",) if self.fail_on == "FAIL" else ())
        if warned:
            rank_zero_warn(f"Preflight warnings:\n{warned}", category=LightningAccelWarning)
        failed = _grouped(self.results, stop)
        if failed:
            raise PreflightError(
                f"Preflight stopped the fit before its first step:\n{failed}\n"
                "Fix these (run `accel-doctor` on the node for the full report), or drop the check with "
                "`Preflight(checks=[...])`."
            )


def _gather(local: Row) -> list[Row]:
    """Every rank's row, on every rank (the world's ranks in order); just `[local]` outside a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [local]
    rows: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, local)
    return rows


def _where(rows: Sequence[Row]) -> str:
    """`rank 1 (node 0, host gpu-a)`, or `ranks 0, 1 (node 0, host gpu-a); rank 8 (node 1, host gpu-b)`."""
    by_node: dict[tuple[int, str], list[int]] = {}
    for row in rows:
        by_node.setdefault((int(row["node"]), str(row["host"])), []).append(int(row["rank"]))
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (node {node}, host {host})"
        for (node, host), ranks in by_node.items()
    )


def _grouped(rows: Sequence[Row], statuses: Sequence[str]) -> str:
    """One entry per distinct result with a status in `statuses`, naming the ranks that gave it; empty if none."""
    found: dict[tuple[str, str, str, str], list[Row]] = {}
    for row in rows:
        for check in row["checks"]:
            if check["status"] in statuses:
                found.setdefault((check["name"], check["status"], check["detail"], check["fix"]), []).append(row)
    lines = []
    for (name, status, detail, fix), where in found.items():
        lines.append(f"  {status} {name} on {_where(where)}: {detail}" + (f"\n    fix: {fix}" if fix else ""))
    return "\n".join(lines)


def _counts(results: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Counts of each status over every rank's results."""
    return {s: sum(c["status"] == s for row in results for c in row["checks"]) for s in STATUSES}
