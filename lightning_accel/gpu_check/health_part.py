"""`health`: card health through NVML (`telemetry.health.HealthReader`) and `accel-dash agent` on the real cards.

The reader polls every visible card three times: each poll answers for every card, none is lost, no reading fails
for a reason other than "not supported" (the figures say which readings the card gives), and a poll's time is
reported. Then `accel-dash agent` publishes two rounds into a scratch runs directory while this process holds
256 MiB on `cuda:0`: its file lists every card, and says whether NVML showed this process on the card (inside a
container NVML often shows no process of another PID namespace: reported, not failed). A problem of the card itself
(an XID, uncorrected ECC, a pending remap) is reported in the figures; it fails the part only when the card is lost.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, Skip, need_cuda

__all__ = ["check_health"]

_POLLS = 3


def check_health(ctx: CheckContext) -> Part:
    need_cuda()
    from lightning_accel.telemetry import nvml

    why = nvml.init_nvml()
    if why is not None:
        raise Skip(why)
    figures: dict[str, str] = {}
    try:
        uuids = _cuda_uuids()
        devices = nvml.resolve_devices(list(range(len(uuids))), os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
        problems = _read_health(devices, figures)
    finally:
        nvml.shutdown_nvml()
    with _holding_memory():
        problems += _agent_round(ctx, len(uuids), figures)
    return Part(name="health", status="FAIL" if problems else "PASS", detail="; ".join(problems), figures=figures)


def _cuda_uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def _holding_memory() -> Iterator[None]:
    """256 MiB held on `cuda:0`, so that NVML shows this process on the card."""
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda:0")
    try:
        yield
    finally:
        del held
        torch.cuda.empty_cache()


def _read_health(devices: Sequence[Any], figures: dict[str, str]) -> list[str]:
    """Three polls of every card; the figures of the last, and the problems of the reader (not of the cards)."""
    from lightning_accel.telemetry.health import HealthReader

    reader = HealthReader(devices)
    try:
        seconds = []
        for _ in range(_POLLS):
            started = time.perf_counter()
            cards = reader.poll()
            seconds.append(time.perf_counter() - started)
    finally:
        reader.close()
    figures["poll (ms, each of 3)"] = " ".join(f"{1e3 * s:.2f}" for s in seconds)
    problems = [] if len(cards) == len(devices) else [f"{len(cards)} health reading(s) for {len(devices)} card(s)"]
    for card in cards:
        readings = card.to_json()
        given = sorted(k for k, v in readings.items() if v is not None and k not in ("index", "uuid", "problems"))
        figures[f"cuda:{card.index} health"] = card.summary()
        figures[f"cuda:{card.index} readings given"] = ", ".join(given)
        if card.lost:
            problems.append(f"cuda:{card.index} is lost (GPU_IS_LOST)")
        elif card.error:
            problems.append(f"cuda:{card.index}: a health reading failed: {card.error}")
    return problems


def _agent_round(ctx: CheckContext, count: int, figures: dict[str, str]) -> list[str]:
    """Two rounds of `accel-dash agent` (in this process, which holds memory on a card); the problems found."""
    from lightning_accel.dash.subcommands import agent_main  # not the command line's main: a Ctrl-C stops the check

    runs_dir = ctx.out_dir / "health" / "runs"
    argv = ["--runs-dir", str(runs_dir), "--hostname", "gpu-check", "--interval", "0.5", "--rounds", "2"]
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        code = agent_main([*argv, "--no-usage"])
    if code != 0:
        return [f"`accel-dash agent` exited {code}: {' / '.join(output.getvalue().strip().splitlines()[-3:])}"]
    path = runs_dir / "agents" / "gpu-check.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return [f"the agent file {path} cannot be read: {err}"]
    cards = data.get("cards", [])
    processes = [p for card in cards for p in card.get("processes", [])]
    figures["agent cards"] = str(len(cards))
    listed = [f"{p.get('pid')} {p.get('name')} {p.get('memory_mib')} MiB" for p in processes]
    figures["agent processes"] = ", ".join(listed)
    seen = any(p.get("pid") == os.getpid() for p in processes)
    figures["this process seen"] = "yes" if seen else "no (NVML shows no process of this PID namespace)"
    if data.get("problem"):
        figures["agent problem"] = str(data["problem"])
    if len(cards) < count:
        return [f"the agent published {len(cards)} card(s) of the {count} visible"]
    return []
