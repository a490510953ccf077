"""`accel-dash agent`: one small process per machine that publishes every card of its host, with the processes and
users on it (notebooks and jobs that are not Lightning's included), into the shared runs directory, so one page shows
every host; and, as the machine's one writer, records its usage.

Each agent writes `<runs dir>/agents/<host>.json` atomically every `interval_s` (`lightning_accel.agent/1`: the host,
the time, the interval and its cards as `telemetry.host_gpus.HostGPUs.read` gives them). accel-dash reads every agent
file whose file changed within the stale timeout (by the file's time on the reader's clock, as for heartbeats), and
lists each host's cards: free, held by a job of ours, or held by someone else. Without an agent, a page shows its own
host's cards as before. Readers trust no file: a symlink, a file that is not regular, over `MAX_BYTES`, not JSON or of
another shape is skipped with a note.
"""

from __future__ import annotations

import json
import os
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_accel.errors import AgentWarning
from lightning_accel.telemetry.heartbeat import safe_component, write_json_atomic

__all__ = [
    "AGENT_DIR",
    "AGENT_SCHEMA",
    "MAX_BYTES",
    "agent_file",
    "check_agent",
    "publish_agent",
    "read_agents",
    "run_agent",
]

AGENT_SCHEMA = "lightning_accel.agent/1"
AGENT_DIR = "agents"
"""The agents' files live in this directory of the runs directory (heartbeat readers never open them)."""
MAX_BYTES = 2**20
"""An agent file larger than this is skipped (64 cards with their processes take about 40 KiB)."""
_MAX_TEXT = 200


def agent_file(runs_dir: Path, host: str) -> Path:
    return runs_dir / AGENT_DIR / f"{safe_component(host)}.json"


def publish_agent(
    runs_dir: Path, host: str, cards: list[dict[str, Any]], interval_s: float, problem: str | None
) -> Path:
    """Write this host's agent file (atomically); returns its path."""
    path = agent_file(runs_dir, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "schema": AGENT_SCHEMA,
        "host": host,
        "updated": time.time(),
        "interval_s": interval_s,
        "cards": cards,
        "problem": problem,
    }
    write_json_atomic(path, data)
    return path


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"`{where}` is not a string")
    return value[:_MAX_TEXT]


def _number(value: Any, where: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) > 2**63:
        raise ValueError(f"`{where}` is not a finite number")
    return value


def check_agent(data: Any) -> dict[str, Any]:
    """`data` if it is an agent file of this schema, with its cards' fields checked (unknown keys dropped).

    Raises:
        ValueError: naming the first field of the wrong shape.
    """
    if not isinstance(data, dict) or data.get("schema") != AGENT_SCHEMA:
        raise ValueError(f"is not an agent file of schema {AGENT_SCHEMA!r}")
    if not isinstance(data.get("cards"), list) or len(data["cards"]) > 256:
        raise ValueError("`cards` is not a list of at most 256 cards")
    cards = []
    for i, card in enumerate(data["cards"]):
        if not isinstance(card, dict) or not isinstance(card.get("latest"), dict):
            raise ValueError(f"`cards[{i}]` is not a card")
        processes = card.get("processes")
        if not isinstance(processes, list) or len(processes) > 256:
            raise ValueError(f"`cards[{i}].processes` is not a list")
        cards.append(
            {
                "index": int(_number(card.get("index"), f"cards[{i}].index")),
                "uuid": _text(card.get("uuid"), f"cards[{i}].uuid"),
                "name": _text(card.get("name"), f"cards[{i}].name"),
                "mig": bool(card.get("mig", False)),
                "latest": {
                    _text(k, f"cards[{i}].latest"): _number(v, f"cards[{i}].latest.{k}", optional=True)
                    for k, v in list(card["latest"].items())[:64]
                },
                "processes": [
                    {
                        "pid": int(_number(p.get("pid"), f"cards[{i}].processes[{j}].pid")),
                        "user": _text(p.get("user"), f"cards[{i}].processes[{j}].user"),
                        "name": _text(p.get("name"), f"cards[{i}].processes[{j}].name"),
                        "memory_mib": _number(p.get("memory_mib"), f"cards[{i}].processes[{j}].memory_mib", True),
                    }
                    for j, p in enumerate(processes)
                    if isinstance(p, dict)
                ],
            }
        )
    problem = data.get("problem")
    return {
        "host": _text(data.get("host"), "host"),
        "interval_s": float(_number(data.get("interval_s"), "interval_s")),
        "cards": cards,
        "problem": None if problem is None else _text(problem, "problem"),
    }


def read_agents(runs_dir: Path, now: float, stale_after_s: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """host -> its agent's checked file, for the agents whose file changed within `stale_after_s` (and three of
    their intervals); and notes on the files skipped and the agents gone silent."""
    agents: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    try:
        entries = sorted(os.scandir(runs_dir / AGENT_DIR), key=lambda e: e.name)
    except OSError:
        return agents, notes  # no agent publishes here: the page is as it was without one
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
                raise ValueError(f"is not a regular file of at most {MAX_BYTES // 1024} KiB")
            with open(entry.path, "rb") as handle:
                raw = handle.read(MAX_BYTES + 1)
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError) as err:  # RecursionError: nested past the parser's depth
                raise ValueError(f"is not valid JSON ({str(err)[:120]})") from None
            agent = check_agent(data)
        except (OSError, ValueError) as err:
            notes.append(f"skipped agent file {entry.name}: {err}")
            continue
        age = max(0.0, now - info.st_mtime)
        if age > max(stale_after_s, 3 * agent["interval_s"]):
            notes.append(f"the agent of {agent['host']} has been silent for {age:.0f} s: its cards are not shown")
            continue
        agents[agent["host"]] = agent
    return agents, notes


def _warn_once(warned: set[str], message: str) -> None:
    kind = message.split("(")[0]
    if kind not in warned:
        warned.add(kind)
        warnings.warn(f"accel-dash agent: {message}", AgentWarning, stacklevel=3)


def run_agent(
    runs_dir: Path,
    host: str,
    read_cards: Callable[[], list[dict[str, Any]]],
    problem: Callable[[], str | None],
    interval_s: float,
    on_round: Callable[[list[dict[str, Any]]], None] | None = None,
    rounds: int | None = None,
) -> None:
    """Publish this host's cards every `interval_s` (`rounds` times; None: until interrupted), calling `on_round`
    with each round's cards (the usage record).

    The first round's write raises `OSError` (a runs directory that cannot be written is the caller's error to
    report); after it, a write that fails (a network filesystem's passing error) or an `on_round` that raises is
    warned once per kind of error (`AgentWarning`) and the agent goes on with the next round."""
    done = 0
    warned: set[str] = set()
    while rounds is None or done < rounds:
        started = time.monotonic()
        cards = read_cards()
        try:
            publish_agent(runs_dir, host, cards, interval_s, problem())
        except OSError as err:
            if done == 0:
                raise
            _warn_once(warned, f"the agent file cannot be written ({err.strerror or err}); trying again next round")
        if on_round is not None:
            try:
                on_round(cards)
            except Exception as err:  # the usage record: a failure there never stops the publishing
                _warn_once(warned, f"the round's usage record failed ({type(err).__name__}: {err})")
        done += 1
        if rounds is None or done < rounds:
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
