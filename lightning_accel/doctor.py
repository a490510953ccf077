"""accel-doctor: check this machine for a fast Lightning run and give PASS / WARN / FAIL / SKIP with a fix for each."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_accel.system.doctor_checks import CHECKS, STATUSES, Check, CheckRequest, run_checks
from lightning_accel.system.facts import SystemFacts, collect_facts, facts_to_dict

__all__ = ["JSON_SCHEMA_VERSION", "build_parser", "main", "report"]

JSON_SCHEMA_VERSION = 1
"""`schema_version` of the `--json` output; raised when a key changes meaning or goes away."""
ROOT_ENV = "ACCEL_DOCTOR_ROOT"
_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def _positive_count(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of `accel-doctor`; argparse exits 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="accel-doctor",
        description="Check this machine for a fast PyTorch Lightning run: driver vs CUDA, GPUs, bf16, NCCL, "
        "InfiniBand, cgroup CPU quota and memory limit, /dev/shm, package versions. Exit code: 0 when no check "
        "fails, 1 when one does, 2 for a usage error.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument(
        "--devices",
        type=_count,
        default=None,
        metavar="N",
        help="GPUs the run will use on this node (default: every visible GPU; 0: a CPU run)",
    )
    parser.add_argument(
        "--num-workers",
        type=_count,
        default=None,
        metavar="N",
        help="DataLoader workers per process, to judge /dev/shm, CPUs and memory",
    )
    parser.add_argument(
        "--num-nodes", type=_positive_count, default=1, metavar="N", help="nodes of the run (default: 1)"
    )
    parser.add_argument(
        "--check",
        action="append",
        choices=list(CHECKS),
        dest="checks",
        metavar="NAME",
        help=f"run only this check (repeatable): {', '.join(CHECKS)}",
    )
    parser.add_argument("--root", default=os.environ.get(ROOT_ENV, "/"), help=argparse.SUPPRESS)  # fake trees
    return parser


def report(facts: SystemFacts, checks: Sequence[Check], request: CheckRequest) -> dict[str, Any]:
    """The `--json` document: schema version, verdict, counts, the request, every check and every fact."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "ok": not any(check.status == "FAIL" for check in checks),
        "counts": {status: sum(check.status == status for check in checks) for status in STATUSES},
        "request": {"devices": request.gpus, "num_workers": request.num_workers, "num_nodes": request.num_nodes},
        "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "fix": c.fix} for c in checks],
        "facts": facts_to_dict(facts),
    }


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 2**30:.1f} GiB"


def _facts_rows(facts: SystemFacts) -> list[tuple[str, str]]:
    cpus, torch, nvml = facts.cpus, facts.torch, facts.nvml
    quota = "no quota" if cpus.quota is None else f"quota {cpus.quota:g}"
    rows = [
        ("host", facts.host),
        (
            "CPUs",
            f"effective {cpus.effective} (affinity {cpus.affinity}, cgroup v{cpus.cgroup_version or '?'} "
            f"{quota}{f', PYTHON_CPU_COUNT={cpus.env_count}' if cpus.env_count is not None else ''}); "
            f"{facts.cpu.model_name or 'unknown model'}",
        ),
        (
            "memory",
            f"cgroup limit {_gib(facts.memory.limit_bytes) if facts.memory.limit_bytes else 'none'}, "
            f"host {_gib(facts.memory.host_total_bytes)}",
        ),
        (
            "/dev/shm",
            "none" if facts.shm is None else f"{_gib(facts.shm.size_bytes)} ({_gib(facts.shm.free_bytes)} free)",
        ),
        (
            "torch",
            f"{torch.version or 'missing'}; CUDA {torch.cuda or 'none'}, cuDNN {torch.cudnn_text}, NCCL "
            f"{'.'.join(map(str, torch.nccl)) if torch.nccl else 'none'}",
        ),
    ]
    if not nvml.available:
        rows.append(("driver", nvml.why))
    else:
        cuda = ".".join(map(str, nvml.cuda_driver_version)) if nvml.cuda_driver_version else "?"
        rows.append(("driver", f"{nvml.driver_version or '?'} (CUDA {cuda}); {len(nvml.visible)} device(s) visible"))
        for gpu in nvml.gpus:
            capability = ".".join(map(str, gpu.capability)) if gpu.capability else "?"
            extra = f", MIG {gpu.mig_devices} device(s)" if gpu.mig_enabled else ""
            extra += f", {gpu.nvlinks} NVLink(s)" if gpu.nvlinks else ""
            rows.append((f"GPU {gpu.index}", f"{gpu.name}, cc {capability}, {_gib(gpu.memory_total_bytes)}{extra}"))
        if nvml.topology:
            rows.append(("topology", ", ".join(f"{link.a}-{link.b} {link.kind}" for link in nvml.topology)))
    ports = ", ".join(f"{p.device}:{p.port} {p.state} {p.link_layer}" for p in facts.infiniband)
    rows.append(("InfiniBand", ports or "none"))
    rows.append(("NCCL env", " ".join(f"{k}={v}" for k, v in facts.nccl_env.items()) or "none set"))
    rows += [("unreadable", problem) for problem in facts.unreadable]
    return rows


def _print_tables(facts: SystemFacts, checks: Sequence[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    facts_table = Table(title="accel-doctor: facts", show_header=False, title_justify="left")
    facts_table.add_column(style="bold")
    facts_table.add_column(overflow="fold")
    for key, value in _facts_rows(facts):
        facts_table.add_row(key, value)
    console.print(facts_table)
    table = Table(title="accel-doctor: checks", title_justify="left")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        table.add_row(check.name, f"[{_STYLE[check.status]}]{check.status}[/]", check.detail, check.fix)
    console.print(table)
    counts = {status: sum(check.status == status for check in checks) for status in STATUSES}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()) + (" -> exit 1" if counts["FAIL"] else " -> exit 0"))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Console entry point of `accel-doctor` (also `python -m lightning_accel.doctor`); returns the exit code.

    Args:
        argv: the arguments (None: `sys.argv[1:]`).
        env: the environment to read `PYTHON_CPU_COUNT`, `CUDA_VISIBLE_DEVICES` and `NCCL_*` from (None: `os.environ`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        parser.error(
            f"`{ROOT_ENV}={args.root}` (the root the machine's facts are read under) is not a directory; "
            f"unset it to read this machine's /proc and /sys."
        )
    request = CheckRequest(gpus=args.devices, num_workers=args.num_workers, num_nodes=args.num_nodes)
    facts = collect_facts(args.root, env, interference_s=0.5 if os.path.realpath(args.root) == "/" else 0.0)
    checks = run_checks(facts, request, args.checks)
    if args.json:
        print(json.dumps(report(facts, checks, request), indent=2))
    else:
        _print_tables(facts, checks)
    return 1 if any(check.status == "FAIL" for check in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
