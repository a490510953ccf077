"""What accel-dash shows: the jobs of a runs directory grouped by host, this host's cards that no job of ours holds,
and the notes on skipped files; as JSON for the page and `--json`, and as text tables for `--once`."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_accel.dash.agent import read_agents
from lightning_accel.dash.notify import Notifier, page_alerts
from lightning_accel.dash.usage_feed import UsageFeed
from lightning_accel.telemetry.heartbeat import (
    DEFAULT_KEEP_S,
    DEFAULT_STALE_AFTER_S,
    STATUSES,
    Job,
    ReadCache,
    lead_signal,
    read_heartbeats,
)
from lightning_accel.telemetry.idle_held import (
    CardSeen,
    IdleHeldTracker,
    holding_processes,
    job_holder,
    processes_holder,
)

__all__ = [
    "MAX_JOBS",
    "MAX_PAGE_BYTES",
    "SCHEMA",
    "DashState",
    "card_line",
    "cards_seen",
    "page_dict",
    "page_json",
    "text_report",
]

SCHEMA = "lightning_accel.dash/1"
"""`schema` of the page data (`/api/state`, `--json`)."""
MAX_JOBS = 256
"""Jobs on one page at most: running first, then stale, finished and failed; the rest are counted in a note."""
MAX_PAGE_BYTES = 16 * 2**20
"""Heartbeat text on one page at most (64 jobs x 8 GPUs with ten minutes of history take about 1.6 MiB)."""
_ORDER = {status: position for position, status in enumerate(STATUSES)}


class DashState:
    """Builds the page data; one instance serves every request (the result is reused for `min_age_s`).

    Args:
        runs_dir: the runs directory the jobs publish into.
        host_cards: returns this machine's cards (`HostGPUs.read`); None: not shown.
        host_cards_problem: returns why there are no cards (`HostGPUs.problem`), or None.
        stale_after_s: a running job silent this long reads as stale.
        keep_s: stale, finished and failed jobs are listed this long after their last heartbeat.
        min_age_s: requests closer together than this get the same data (several open pages cost one read).
        host: this machine's name, as jobs write it.
        max_jobs: jobs shown at most; the rest are counted in a note.
        max_bytes: heartbeat text shown at most; the jobs past it are counted in the same note.
        idle: flags idle-held cards (`telemetry.idle_held`); None: the tracker's defaults (5% for 300 s).
        usage: records this host's usage at each build (`dash.usage_feed.UsageFeed`); None: nothing recorded.
        notifier: sends the page's alerts to webhooks (`dash.notify.Notifier`, never blocking); None: none sent.
    """

    def __init__(
        self,
        runs_dir: Path,
        host_cards: Callable[[], list[dict[str, Any]]] | None = None,
        host_cards_problem: Callable[[], str | None] | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        keep_s: float = DEFAULT_KEEP_S,
        min_age_s: float = 1.0,
        host: str | None = None,
        max_jobs: int = MAX_JOBS,
        max_bytes: int = MAX_PAGE_BYTES,
        idle: IdleHeldTracker | None = None,
        usage: UsageFeed | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.runs_dir, self.stale_after_s, self.keep_s, self.min_age_s = runs_dir, stale_after_s, keep_s, min_age_s
        self.max_jobs, self.max_bytes = max_jobs, max_bytes
        self.host = host or socket.gethostname()
        self._host_cards, self._host_cards_problem = host_cards, host_cards_problem
        self._cache: ReadCache = {}
        self._lock = threading.Lock()
        self._last: tuple[float, str] | None = None
        self.idle = idle if idle is not None else IdleHeldTracker()
        self.usage = usage
        self.notifier = notifier
        self.usage_sources: list[Path] | None = None
        """The usage databases (or directories of them) the usage page merges; None: the usage directory."""

    def get(self, now: float | None = None) -> str:
        """The page data as JSON (`page_json(self.build())`), at most `min_age_s` old."""
        with self._lock:
            clock = time.monotonic()
            if self._last is not None and clock - self._last[0] < self.min_age_s:
                return self._last[1]
            text = page_json(self.build(now))
            self._last = (clock, text)
            return text

    def watch(self, interval_s: float = 2.0) -> Callable[[], None]:
        """Build the page every `interval_s` on a daemon thread of its own, whether a browser asks or not, so the
        usage is recorded, the idle-held episodes followed and the alerts sent with no page open (a hidden browser
        tab asks about once a minute). Returns the function that stops it and waits for a build under way to end,
        so that the caller may close the usage store and the card reader after it. A build that raises is skipped:
        the next one tries again."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.get()
                except Exception:  # a failure in monitoring never stops it; the page shows what the build noted
                    continue

        thread = threading.Thread(target=loop, name="accel-dash-watch", daemon=True)
        thread.start()

        def stop_watch() -> None:
            stop.set()
            thread.join(timeout=30.0)  # a build reads files and NVML: seconds at most

        return stop_watch

    def usage_json(self, days: int = 30, now: float | None = None) -> str:
        """The usage page's data (`dash.usage_view.UsagePage.as_dict`) over the last `days` UTC days, merged from
        `usage_sources` (default: every `usage-<host>.sqlite` of the usage directory), as JSON."""
        from datetime import datetime, timedelta, timezone

        from lightning_accel.dash.usage_schema import default_usage_dir
        from lightning_accel.dash.usage_view import UsageReader, usage_databases

        today = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).date()
        sources = self.usage_sources if self.usage_sources is not None else [default_usage_dir()]
        page = UsageReader(usage_databases(sources)).page(since=today - timedelta(days=days - 1), until=today)
        return json.dumps(page.as_dict(), allow_nan=False)

    def build(self, now: float | None = None) -> dict[str, Any]:
        """`{"schema", "generated", "host", "runs_dir", "stale_after_s", "hosts": [{"host", "jobs", "cards"}],
        "notes", "cards_problem", "idle_held", "idle_threshold_pct", "idle_after_s"}`: `jobs` are
        `telemetry.heartbeat.Job`s (a heartbeat, its status now and its file), running jobs first, at most `max_jobs`
        of them and `max_bytes` of heartbeats; `cards` (this host's only) are the cards no running or stale job of ours
        holds, with their processes; `idle_held` the cards held and idle past the tracker's threshold
        (`telemetry.idle_held.IdleHeld.as_dict`), longest first. `page_json` and `page_dict` turn it into the page's
        JSON.
        """
        now = time.time() if now is None else now
        jobs, notes = read_heartbeats(self.runs_dir, now, self.stale_after_s, self.keep_s, self._cache)
        jobs.sort(key=lambda job: (_ORDER[job.status], -job.heartbeat["started"], job.file))
        size = 0
        for shown, job in enumerate(jobs):
            size += len(job.text)
            if shown == self.max_jobs or size > self.max_bytes:
                notes.append(
                    f"{len(jobs) - shown:,} more jobs are not shown: a page holds at most {self.max_jobs} jobs and "
                    f"{self.max_bytes / 2**20:.0f} MiB of heartbeats (running jobs come first)"
                )
                del jobs[shown:]
                break
        hosts: dict[str, dict[str, Any]] = {self.host: {"host": self.host, "jobs": [], "cards": []}}
        for job in jobs:
            host = job.heartbeat["host"]
            hosts.setdefault(host, {"host": host, "jobs": [], "cards": []})["jobs"].append(job)
        cards_problem = None
        agents, agent_notes = read_agents(self.runs_dir, now, self.stale_after_s)
        notes.extend(agent_notes)
        for name, agent in agents.items():
            if name == self.host and self._host_cards is not None:
                continue  # this host's own reading is fresher than its agent's file
            entry = hosts.setdefault(name, {"host": name, "jobs": [], "cards": []})
            entry["cards"] = _not_ours(agent["cards"], entry["jobs"])
            if agent["problem"]:
                notes.append(f"the agent of {name} reads no cards: {agent['problem']}")
        if self._host_cards is not None:
            hosts[self.host]["cards"] = _not_ours(self._host_cards(), hosts[self.host]["jobs"])
            cards_problem = self._host_cards_problem() if self._host_cards_problem is not None else None
        ordered = [hosts.pop(self.host), *(hosts[name] for name in sorted(hosts))]
        idle_held = self.idle.update(now, cards_seen(ordered, now))
        if self.usage is not None and (self.host not in agents or self.usage.agent):
            try:  # one writer per machine: where this host's agent runs, it records the usage
                self.usage.observe(now, ordered, [card.as_dict() for card in idle_held])
            except Exception as err:  # the usage kept must never cost the live view
                notes.append(f"usage not recorded this time ({type(err).__name__}: {err})")
        page = {
            "schema": SCHEMA,
            "generated": now,
            "host": self.host,
            "runs_dir": str(self.runs_dir),
            "stale_after_s": self.stale_after_s,
            "hosts": ordered,
            "notes": notes,
            "cards_problem": cards_problem,
            "idle_held": [card.as_dict() for card in idle_held],
            "idle_threshold_pct": self.idle.threshold_pct,
            "idle_after_s": self.idle.after_s,
        }
        if self.notifier is not None:
            try:
                self.notifier.observe(now, page_alerts(page))
            except Exception as err:  # telling the team must never cost the live view
                notes.append(f"alerts not sent this time ({type(err).__name__}: {err})")
        return page


def _not_ours(cards: list[dict[str, Any]], jobs: list[Job]) -> list[dict[str, Any]]:
    """The cards that no running or stale job of ours on that host holds."""
    held = {gpu["uuid"] for job in jobs if job.status in ("running", "stale") for gpu in job.heartbeat["gpus"]}
    return [card for card in cards if card["uuid"] not in held]


def _lead_history(gpu: Mapping[str, Any], label: str, times: list[float], shift: float) -> list[tuple[float, Any]]:
    """A job's card's history of its lead signal, on the reader's clock (`shift` added to the writer's times)."""
    series = gpu["history"].get("sm_activity_pct" if label == "SM active" else "utilization_pct") or []
    return [(t + shift, value) for t, value in zip(times, series, strict=False)]


def cards_seen(hosts: list[dict[str, Any]], now: float) -> list[CardSeen]:
    """Every held card of the page, for the idle-held tracker: the cards of each running job (held by the job; its
    history dated on this reader's clock by the heartbeat's age), and the cards no job of ours holds that processes
    hold memory on."""
    seen: list[CardSeen] = []
    for host in hosts:
        job: Job
        for job in host["jobs"]:
            if job.status != "running":
                continue
            beat = job.heartbeat
            shift = (now - job.age_s) - beat["updated"]  # the writer's clock to the reader's
            for gpu in beat["gpus"]:
                label, value = lead_signal(gpu["latest"])
                used = gpu["latest"].get("memory_used_mib")
                seen.append(
                    CardSeen(
                        host=host["host"],
                        uuid=gpu["uuid"],
                        index=gpu["index"],
                        name=gpu["name"],
                        owner=beat["user"],
                        holder=job_holder(beat),
                        job=beat["run_id"],
                        activity_pct=value,
                        signal=label,
                        held=used is None or used > 0,
                        history=_lead_history(gpu, label, beat["history"]["t"], shift),
                        at=now - job.age_s,
                    )
                )
        for card in host["cards"]:
            holding = holding_processes(card.get("processes"))
            if not holding:
                continue
            label, value = lead_signal(card["latest"])
            seen.append(
                CardSeen(
                    host=host["host"],
                    uuid=card["uuid"],
                    index=card["index"],
                    name=card["name"],
                    owner=", ".join(sorted({str(p["user"]) for p in holding})),
                    holder=processes_holder(holding),
                    job=None,
                    activity_pct=value,
                    signal=label,
                    held=True,
                )
            )
    return seen


def page_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` (`DashState.build`) as plain data: each job `{"file", "status", "heartbeat"}`."""
    hosts = [{**host, "jobs": [job.as_dict() for job in host["jobs"]]} for host in state["hosts"]]
    return {**state, "hosts": hosts}


def page_json(state: Mapping[str, Any]) -> str:
    """`page_dict(state)` as JSON, each job's heartbeat passed on as the text it was read as (not parsed into floats
    and printed again: most of a page is heartbeats)."""
    hosts = []
    for host in state["hosts"]:
        jobs = ",".join(job.as_json() for job in host["jobs"])
        rest = json.dumps({key: value for key, value in host.items() if key != "jobs"}, allow_nan=False)
        hosts.append(f'{rest[:-1]},"jobs":[{jobs}]}}')
    rest = json.dumps({key: value for key, value in state.items() if key != "hosts"}, allow_nan=False)
    return f'{rest[:-1]},"hosts":[{",".join(hosts)}]}}'


def _plain(text: Any, limit: int = 80) -> str:
    """`text` for a terminal: control characters (escape sequences) shown as `?`, cut to `limit`."""
    shown = "".join(c if c.isprintable() else "?" for c in str(text))
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def _number(value: Any, digits: int = 0, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def card_line(latest: Mapping[str, Any]) -> str:
    """One card's signals in a line: the lead activity, tensor activity, power against its limit, temperature,
    memory, throttling."""
    label, value = lead_signal(latest)
    parts = [f"{label} {_number(value, 0, '%')}"]
    if latest.get("tensor_activity_pct") is not None:
        parts.append(f"tensor {latest['tensor_activity_pct']:.0f}%")
    if latest.get("power_w") is not None:
        parts.append(f"{latest['power_w']:.0f}/{_number(latest.get('power_limit_w'), 0)} W")
    if latest.get("temperature_c") is not None:
        parts.append(f"{latest['temperature_c']:.0f} C")
    if latest.get("memory_used_mib") is not None:
        parts.append(f"{latest['memory_used_mib'] / 1024:.1f}/{_number(_gib(latest.get('memory_total_mib')), 1)} GiB")
    throttled = [
        name
        for name, key in (
            ("thermal", "throttle_thermal_frac"),
            ("power", "throttle_power_frac"),
            ("hw slowdown", "throttle_hw_slowdown_frac"),
        )
        if (latest.get(key) or 0) > 0
    ]
    if throttled:
        parts.append("throttled: " + ", ".join(throttled))
    return ", ".join(parts)


def _gib(mib: float | None) -> float | None:
    return None if mib is None else mib / 1024


def text_report(state: Mapping[str, Any], width: int | None = None) -> str:
    """`accel-dash --once`: a table per host of its jobs and cards, then this host's free cards and the notes."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=io.StringIO(), width=width or 160, record=True, force_terminal=False, color_system=None)
    console.print(Text(f"accel-dash: {_plain(state['runs_dir'], 200)} at {time.strftime('%H:%M:%S')}"))
    for host in state["hosts"]:
        table = Table(title=Text(f"host {_plain(host['host'])}"), title_justify="left", header_style="bold")
        for column in ("status", "run", "user", "ranks", "step", "samples/s", "ETA", "cards"):
            table.add_column(column, overflow="fold")
        for entry in host["jobs"]:
            job = {**entry.heartbeat, "status": entry.status}
            step = f"{job['step']:,}" + (f"/{job['max_steps']:,}" if job["max_steps"] else "")
            ranks = ", ".join(f"{r['rank']}:{_plain(r['device'], 12)}" for r in job["ranks"]) or "-"
            cards = "\n".join(
                f"gpu {g['index']} {_plain(g['name'], 30)}: {card_line(g['latest'])}"
                + "".join(f"\n  health: {_plain(problem, 120)}" for problem in g.get("health", {}).get("problems", []))
                for g in job["gpus"]
            )
            notes = [f"{a['name']} (step {a['step']})" for a in job["alerts"]]
            if job["reason"]:
                notes.append(job["reason"])
            run = f"{_plain(job['name'])}\n{_plain(job['run_id'])}" + ("".join(f"\n! {_plain(n, 120)}" for n in notes))
            table.add_row(
                Text(job["status"]),
                Text(run),
                Text(f"{_plain(job['user'], 32)}\npid {job['pid']}"),
                Text(ranks),
                Text(step),
                Text(_number(job["samples_per_s"], 1)),
                Text(_duration(job["eta_s"])),
                Text(cards or "no GPU"),
            )
        if not host["jobs"]:
            table.add_row(Text("-"), Text("no job of ours"), *[Text("") for _ in range(6)])
        console.print(table)
        if host["cards"]:
            free = Table(title=Text(f"cards on {_plain(host['host'])} that no job of ours holds"), title_justify="left")
            for column in ("gpu", "name", "signals", "processes"):
                free.add_column(column, overflow="fold")
            for card in host["cards"]:
                processes = (
                    ", ".join(f"{p['pid']} {_plain(p['user'], 32)} {_plain(p['name'], 32)}" for p in card["processes"])
                    or "idle"
                )
                free.add_row(
                    Text(str(card["index"])),
                    Text(_plain(card["name"], 40)),
                    Text(card_line(card["latest"])),
                    Text(processes),
                )
            console.print(free)
    if state.get("idle_held"):
        idle = Table(
            title=Text(
                f"idle-held cards: held, {state['idle_threshold_pct']:g}% or less active for "
                f"{_duration(state['idle_after_s'])} or more"
            ),
            title_justify="left",
        )
        for column in ("host", "gpu", "owner", "held by", "idle for", "idle GPU-h", "now"):
            idle.add_column(column, overflow="fold")
        for card in state["idle_held"]:
            idle.add_row(
                Text(_plain(card["host"])),
                Text(f"{card['index']} {_plain(card['name'], 30)}"),
                Text(_plain(card["owner"], 32)),
                Text(_plain(card["holder"], 60)),
                Text(_duration(card["for_s"])),
                Text(f"{card['idle_gpu_hours']:.2f}"),
                Text(f"{card['signal']} {card['activity_pct']:.0f}%"),
            )
        console.print(idle)
    if state.get("cards_problem"):
        console.print(Text(f"this host's cards are not shown: {_plain(state['cards_problem'], 300)}"))
    for note in state["notes"]:
        console.print(Text(f"note: {_plain(note, 300)}"))
    return console.export_text()
