"""The team told: webhooks for idle-held cards, jobs that went stale or failed, and card-health events.

A routing file (YAML) says where each user's alerts go::

    default: {url: https://hooks.slack.com/services/T0/B0/team-secret, format: slack}
    users:
      ada: {url: https://hooks.slack.com/services/T0/B1/ada-secret, format: slack, mention: "<@U024BE7LH>"}
      bob: {url: http://alerts.internal:8080/gpu, format: json}

`format: slack` posts Slack's incoming-webhook JSON (`{"text": ...}`, which Mattermost and Rocket.Chat take too);
`format: json` posts the alert itself (`kind`, `key`, `user`, `host`, `message`, `since`, `repeat`). A user without a
route of their own gets `default`'s (none: not sent).

Each alert is an episode, keyed by what it is about (a card and its holder, a job's file): it is sent once it has
lasted `grace_s`, again every `repeat_s` while it lasts, and armed again once it is gone. Sending never blocks the
caller: posts go through a bounded queue to one thread, each with a timeout and a bounded number of retries; a
receiver that is down or slow costs that thread, never the page or a training job. `accel-dash snooze` writes a file
that silences matching alerts for a while; the page itself stays read-only.
"""

from __future__ import annotations

import fnmatch
import json
import math
import queue
import re
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lightning_accel.errors import ConfigError, LightningAccelWarning

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_REPEAT_S",
    "Alert",
    "Notifier",
    "Route",
    "load_routes",
    "page_alerts",
    "read_snoozes",
    "snooze",
]

DEFAULT_GRACE_S = 60.0
"""An alert is sent once it has lasted this long (a card flagged idle-held has been idle for `--idle-after` already)."""
DEFAULT_REPEAT_S = 4 * 3600.0
"""...and again every this long while it lasts."""
_FORMATS = ("slack", "json")


@dataclass(frozen=True)
class Route:
    """Where one user's alerts go."""

    url: str
    format: str = "slack"
    mention: str = ""


@dataclass(frozen=True)
class Alert:
    """One alert as the page sees it now: `key` names the episode (the same key on the next build: the same one)."""

    kind: str
    key: str
    user: str
    host: str
    message: str


def _route(value: Any, where: str, path: Path) -> Route:
    if not isinstance(value, Mapping) or not isinstance(value.get("url"), str):
        raise ConfigError(f"{path}: `{where}` must be a mapping with a `url`, e.g. {{url: https://..., format: slack}}")
    url, kind = value["url"], value.get("format", "slack")
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise ConfigError(f"{path}: `{where}.url` is {url!r}: a webhook URL must be http:// or https:// with a host")
    if kind not in _FORMATS:
        raise ConfigError(f"{path}: `{where}.format` is {kind!r}: use one of {', '.join(_FORMATS)}")
    return Route(url=url, format=kind, mention=str(value.get("mention", "")))


def page_alerts(state: Mapping[str, Any]) -> list[Alert]:
    """The alerts of one page (`DashState.build`): each idle-held card, each job that is stale or failed, and each
    card of a running job whose health has problems (an XID, a lost card, uncorrected ECC errors, a pending repair)."""
    alerts = []
    for card in state.get("idle_held", []):
        hours = card["idle_gpu_hours"]
        alerts.append(
            Alert(
                "idle_held",
                f"idle_held/{card['host']}/{card['uuid']}/{card['holder']}",
                card["owner"].split(", ")[0],
                card["host"],
                f"GPU {card['index']} ({card['name']}) on {card['host']} is held by {card['holder']} ({card['owner']}) "
                f"and {card['activity_pct']:.0f}% active for {card['for_s'] / 60:.0f} min: {hours:.2f} idle GPU-hours",
            )
        )
    for host in state["hosts"]:
        for job in host["jobs"]:
            beat = job.heartbeat
            where = f"job {beat['name']} ({beat['run_id']}) of {beat['user']} on {host['host']}"
            if job.status in ("stale", "failed"):
                why = f": {beat['reason']}" if beat["reason"] else ""
                alerts.append(
                    Alert(  # its own key per kind: a stale job that then fails is told again, at once
                        f"job_{job.status}",
                        f"job_{job.status}/{job.file}",
                        beat["user"],
                        host["host"],
                        f"{where} is {job.status}{why}",
                    )
                )
            if job.status != "running":
                continue
            for gpu in beat["gpus"]:
                for problem in gpu.get("health", {}).get("problems", []):
                    if problem.startswith(_READING_FAILED):
                        continue  # the monitoring's trouble, not the card's: shown on the page, never posted
                    alerts.append(
                        Alert(  # one episode per problem: a new XID on a card that has one already is told
                            "health",
                            f"health/{host['host']}/{gpu['uuid']}/{_problem_key(problem)}",
                            beat["user"],
                            host["host"],
                            f"GPU {gpu['index']} ({gpu['name']}) of {where}: {problem}",
                        )
                    )
    return alerts


_READING_FAILED = "a health reading failed"


def _problem_key(problem: str) -> str:
    """A health problem's key, stable while it lasts: its words before the first `:` or `,` (`XID 79 (GPU has
    fallen off the bus)`, `lost`, `2 uncorrected ECC error(s) since the driver loaded`: a count that grows is a new
    episode), without the age."""
    return re.split(r"[:,]", problem, maxsplit=1)[0].strip()


def load_routes(path: Path) -> dict[str | None, Route]:
    """The routing file: user -> Route, None -> the default route (when given).

    Raises:
        ConfigError: the file cannot be read, is not YAML, or a route is wrong; named with the file and the key.
    """
    import yaml  # type: ignore[import-untyped]  # PyYAML, which hydra-core depends on

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"the routing file {path} cannot be read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"the routing file {path} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, Mapping) or set(data) - {"default", "users"}:
        raise ConfigError(f"{path}: expected a mapping with `default` and/or `users`, got {str(data)[:80]!r}")
    routes: dict[str | None, Route] = {}
    if data.get("default") is not None:
        routes[None] = _route(data["default"], "default", path)
    users = data.get("users") or {}
    if not isinstance(users, Mapping):
        raise ConfigError(f"{path}: `users` must map user names to routes")
    for user, value in users.items():
        routes[str(user)] = _route(value, f"users.{user}", path)
    return routes


def read_snoozes(path: Path, now: float) -> list[str]:
    """The key patterns (fnmatch) snoozed at `now` in the snooze file; a missing or broken file snoozes nothing."""
    return [str(entry["pattern"]) for entry in _snooze_entries(path) if entry["until"] > now]


def _snooze_entries(path: Path) -> list[dict[str, Any]]:
    """The snooze file's well-formed entries (`{"pattern": str, "until": finite number}`), each checked on its own:
    a missing or broken file gives none, a broken entry is left out and the others kept."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(entries, list):
        return []
    kept = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("pattern"), str):
            continue
        until = entry.get("until")
        if isinstance(until, (int, float)) and not isinstance(until, bool) and math.isfinite(until):
            kept.append({"pattern": entry["pattern"], "until": float(until)})
    return kept


def snooze(path: Path, pattern: str, for_s: float, now: float | None = None) -> None:
    """Add `pattern` to the snooze file for `for_s` seconds (expired entries are dropped); written atomically."""
    from lightning_accel.files import atomic_write

    now = time.time() if now is None else now
    entries = [entry for entry in _snooze_entries(path) if entry["until"] > now]
    entries.append({"pattern": pattern, "until": now + for_s})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(entries, indent=1) + "\n")


@dataclass
class _Episode:
    since: float
    sent: float | None = None
    repeat: int = 0


@dataclass
class Notifier:
    """Sends each alert episode once past `grace_s`, again every `repeat_s`, through a thread of its own.

    Args:
        routes: `load_routes`'s result.
        grace_s, repeat_s: see the module's docstring; `immediate` kinds skip the grace period.
        snooze_file: the file `accel-dash snooze` writes; None: no snoozing.
        timeout_s: each post's timeout; retries: posts after the first that failed (bounded); backoff_s: the wait
            before the first retry, doubled each time.
        max_queued: posts waiting at most; a post past it is dropped, with one warning.
        post: sends (url, body, timeout); the default is urllib's POST (tests pass their own).
    """

    routes: Mapping[str | None, Route]
    grace_s: float = DEFAULT_GRACE_S
    immediate: tuple[str, ...] = ("health", "job_failed")
    """Kinds sent at once, without the grace period (a card's health event, a job that failed)."""
    repeat_s: float = DEFAULT_REPEAT_S
    snooze_file: Path | None = None
    timeout_s: float = 5.0
    retries: int = 2
    backoff_s: float = 1.0
    max_queued: int = 100
    post: Callable[[str, bytes, float], None] | None = None
    sent: list[dict[str, Any]] = field(default_factory=list)
    """What was delivered (the newest 100), for tests and the page's notes."""
    failures: int = 0

    def __post_init__(self) -> None:
        self._episodes: dict[str, _Episode] = {}
        self._queue: queue.Queue[tuple[str, bytes, dict[str, Any]]] = queue.Queue(self.max_queued)
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="accel-dash-notify", daemon=True)
        self._thread.start()

    def observe(self, now: float, alerts: Iterable[Alert]) -> None:
        """One build's alerts: start, send, repeat or end each episode; returns at once."""
        snoozed = read_snoozes(self.snooze_file, now) if self.snooze_file is not None else []
        seen: set[str] = set()
        for alert in alerts:
            seen.add(alert.key)
            episode = self._episodes.setdefault(alert.key, _Episode(since=now))
            grace = 0.0 if alert.kind in self.immediate else self.grace_s
            due = episode.sent is None and now - episode.since >= grace
            again = episode.sent is not None and now - episode.sent >= self.repeat_s
            if not (due or again) or any(fnmatch.fnmatchcase(alert.key, p) for p in snoozed):
                continue
            episode.repeat += int(again)
            episode.sent = now
            self._send(alert, episode)
        for key in set(self._episodes) - seen:
            del self._episodes[key]  # over: the next one is a new episode

    def _send(self, alert: Alert, episode: _Episode) -> None:
        route = self.routes.get(alert.user) or self.routes.get(None)
        if route is None:
            return
        record = {
            "kind": alert.kind,
            "key": alert.key,
            "user": alert.user,
            "host": alert.host,
            "message": alert.message,
            "since": episode.since,
            "repeat": episode.repeat,
        }
        if route.format == "slack":
            who = f"{route.mention} " if route.mention else ""
            again = " (still)" if episode.repeat else ""
            body: dict[str, Any] = {"text": f"{who}accel-dash{again}: {alert.message}"}
        else:
            body = record
        try:
            self._queue.put_nowait((route.url, json.dumps(body).encode(), record))
        except queue.Full:
            self._warn("queue", f"{self.max_queued} posts are waiting: this one is dropped (the receiver is slow)")

    def _run(self) -> None:
        while True:
            url, body, record = self._queue.get()
            try:
                self._deliver(url, body, record)
            finally:
                self._queue.task_done()

    def _deliver(self, url: str, body: bytes, record: dict[str, Any]) -> None:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                (self.post or _post)(url, body, self.timeout_s)
            except Exception as err:  # down, slow, refused: retried, then given up
                if attempt == self.retries:
                    self.failures += 1
                    self._warn(url, f"the webhook {url} failed {self.retries + 1} times ({err}); given up")
                else:
                    time.sleep(delay)
                    delay *= 2
                continue
            self.sent = [*self.sent[-99:], record]
            return

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Whether every queued post was tried within `timeout_s` (for tests and a clean exit)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"accel-dash: {message}", LightningAccelWarning, stacklevel=2)


def _post(url: str, body: bytes, timeout_s: float) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - http(s) checked at load
        response.read(1024)
