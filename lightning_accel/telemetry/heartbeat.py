"""Heartbeats: the small JSON file each node of a running job publishes into a runs directory, and how it is read
back (validated, with its status); no Lightning imports.

One file per (run, host, node): `<run id>.<host>.<node rank>.json`, holding `"schema": "lightning_accel.heartbeat/1"`,
replaced atomically every few seconds while the job trains and marked `finished` or `failed` when it ends. A job that
stops writing (SIGKILL, a dead node) reads as `stale` once its file has not changed for the stale timeout, by the
file's modification time as the reader sees it (never by the clock of the host that wrote it). Readers never trust a
file: one named like a heartbeat that is a symlink, not regular, over `MAX_BYTES`, not JSON, of another schema or with
a field of the wrong type is skipped with a note (the first `MAX_NOTES`, then a count), other `.json` files are
counted in one note, and the rest are still read. Pruning removes only this user's regular files that carry both the
name and the schema (and the temporaries of their atomic writes): a `results.json` beside them is never touched.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_accel.files import atomic_write, owned_by_me, temporary_target

__all__ = [
    "DEFAULT_KEEP_S",
    "DEFAULT_STALE_AFTER_S",
    "HISTORY_METRICS",
    "HISTORY_S",
    "HISTORY_STEP_S",
    "MAX_BYTES",
    "MAX_NOTES",
    "SCHEMA",
    "STATUSES",
    "HeartbeatError",
    "History",
    "Job",
    "ReadCache",
    "check_heartbeat",
    "current_user",
    "default_runs_dir",
    "heartbeat_path",
    "is_heartbeat_name",
    "lead_signal",
    "load_heartbeat",
    "prune_heartbeats",
    "read_heartbeat",
    "read_heartbeats",
    "safe_component",
    "status_of",
    "write_json_atomic",
]

SCHEMA = "lightning_accel.heartbeat/1"
STATUSES = ("running", "stale", "finished", "failed")
"""A job's status as readers show it; files hold the first, third and fourth, `stale` is the readers' verdict."""
MAX_BYTES = 2 * 2**20
"""A heartbeat file larger than this is skipped (64 GPUs of history take about 0.5 MiB)."""
HISTORY_S = 600.0
"""The span of the history a heartbeat carries (s)."""
HISTORY_STEP_S = 10.0
"""Its resolution: one point per this many seconds, the mean of the windows that fell into it."""
HISTORY_METRICS = (
    "sm_activity_pct",
    "tensor_activity_pct",
    "utilization_pct",
    "power_w",
    "temperature_c",
    "memory_used_mib",
)
"""Per-GPU metrics kept in the history (names of `telemetry.readings.METRICS`)."""
DEFAULT_STALE_AFTER_S = 30.0
"""A running job whose heartbeat is older than this (and than 3 of its own intervals) reads as stale."""
DEFAULT_KEEP_S = 3600.0
"""Finished, failed and stale jobs are listed for this long after their last heartbeat."""
MAX_NOTES = 20
"""Files skipped with a note of their own per read; the rest are counted in one more note."""
_MAX_TEXT = 2000  # characters of any one string shown (a command line may be long)
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\.[A-Za-z0-9_-][A-Za-z0-9._-]*\.[0-9]+\.json")
"""A heartbeat's file name: `heartbeat_path`'s `<run id>.<host>.<node rank>.json`, each part as `safe_component` makes
it (no leading dot)."""


class HeartbeatError(ValueError):
    """A heartbeat file that cannot be used; the message says why."""


def default_runs_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$ACCEL_RUNS_DIR`, else `$XDG_CACHE_HOME/lightning_accel/runs`, else `~/.cache/lightning_accel/runs`."""
    env = os.environ if env is None else env
    if env.get("ACCEL_RUNS_DIR"):
        return Path(env["ACCEL_RUNS_DIR"]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lightning_accel" / "runs"


def current_user() -> str:
    """The login name, or `uid<n>` where the user database has none (containers)."""
    try:
        return getpass.getuser()
    except Exception:  # no USER/LOGNAME and no passwd entry
        return f"uid{os.getuid()}"


def safe_component(text: str, limit: int = 80) -> str:
    """`text` as one file-name component: characters other than letters, digits, `.`, `_`, `-` become `_`, a leading
    dot becomes `_` (no hidden files, no `..`), cut to `limit` characters; never empty."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(text))[:limit]
    safe = re.sub(r"^\.", "_", safe)
    return safe or "_"


def heartbeat_path(runs_dir: str | os.PathLike[str], run_id: str, host: str, node_rank: int) -> Path:
    """`<runs_dir>/<run id>.<host>.<node rank>.json`, each part made safe: whatever the run id holds (`../../x`,
    `/etc/passwd`), the file is a direct child of `runs_dir`."""
    directory = Path(runs_dir)
    name = f"{safe_component(run_id, 120)}.{safe_component(host)}.{int(node_rank)}.json"
    path = directory / name
    assert path.parent == directory and os.sep not in name, name  # safe_component leaves no separator
    return path


def is_heartbeat_name(name: str) -> bool:
    """`name` is a file name `heartbeat_path` can give (`<run id>.<host>.<node rank>.json`)."""
    return _NAME.fullmatch(name) is not None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON next to `path` and rename it over `path`: a reader sees the old file or the new one, never
    a torn one. A symlink at `path` is replaced, not followed. NaN and infinities are refused (not JSON).

    Raises:
        OSError: the directory cannot be written.
    """
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
    atomic_write(path, text, mode=0o644)  # teammates' accel-dash reads it from a shared runs directory


def _no_constants(name: str) -> float:
    raise HeartbeatError(f"holds {name}, which is not JSON")


def read_heartbeat(path: Path, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """One heartbeat file, parsed and checked (`check_heartbeat`).

    Raises:
        HeartbeatError: a symlink or other non-regular file, over `max_bytes`, unreadable, not JSON, wrong schema or
            a field of the wrong type; the message says which.
    """
    return load_heartbeat(path, max_bytes)[0]


def load_heartbeat(path: Path, max_bytes: int = MAX_BYTES) -> tuple[dict[str, Any], str]:
    """`read_heartbeat`, and the checked heartbeat as JSON text: the file's own text when it holds exactly that (the
    usual case: no page re-serializes what it only passes on), else a fresh serialization.

    Raises:
        HeartbeatError: as `read_heartbeat`.
    """
    data, text = _read_json(path, max_bytes)
    checked = check_heartbeat(data)
    if checked != data:  # keys dropped or strings cut: pass on only what was checked
        text = json.dumps(checked, allow_nan=False, separators=(",", ":"))
    return checked, text


def _read_json(path: Path, max_bytes: int) -> tuple[Any, str]:
    """The JSON value a regular file of at most `max_bytes` holds, and its text; a symlink is not followed.

    Raises:
        HeartbeatError: a symlink or other non-regular file, over `max_bytes`, unreadable or not JSON.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        if os.path.islink(path):
            raise HeartbeatError("is a symlink; heartbeats are regular files written by the job itself") from None
        raise HeartbeatError(f"cannot be read ({err.strerror or err})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HeartbeatError("is not a regular file")
        raise HeartbeatError(f"is {info.st_size} bytes, over the limit of {max_bytes}")
    with os.fdopen(fd, "rb") as file:
        raw = file.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise HeartbeatError(f"is over the limit of {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
        return json.loads(text, parse_constant=_no_constants), text
    except HeartbeatError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise HeartbeatError(f"is not valid JSON (truncated or corrupt: {str(err)[:120]})") from None


@dataclass(frozen=True, slots=True)
class Job:
    """One heartbeat file as a reader shows it."""

    file: str
    """The file's name in the runs directory."""
    status: str
    """Its status now: `running`, `stale`, `finished` or `failed`."""
    heartbeat: dict[str, Any]
    """The checked heartbeat (`status` as the job wrote it)."""
    text: str
    """`heartbeat` as JSON."""
    age_s: float = 0.0
    """Seconds since the file last changed, by the reader's clock (what `status` was judged by; the heartbeat's own
    `updated` is the writer's clock, which may be off)."""

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "status": self.status, "age_s": round(self.age_s, 1), "heartbeat": self.heartbeat}

    def as_json(self) -> str:
        """`as_dict()` as JSON, reusing `text` (a page of 64 jobs x 8 GPUs is mostly their heartbeats)."""
        return (
            f'{{"file":{json.dumps(self.file)},"status":{json.dumps(self.status)},'
            f'"age_s":{json.dumps(round(self.age_s, 1))},"heartbeat":{self.text}}}'
        )


# The shape of a heartbeat: a key -> a spec. A spec is a type (or a tuple of types), `_opt(spec)` (that or null),
# `_list(spec)`, `_map(spec)` (str -> spec), or a dict of required keys.
_NUM, _INT = (int, float), (int,)


def _opt(spec: Any) -> tuple[str, Any]:
    return ("optional", spec)


def _list(spec: Any) -> tuple[str, Any]:
    return ("list", spec)


def _map(spec: Any) -> tuple[str, Any]:
    return ("map", spec)


_OPT_NUM = _opt(_NUM)
_GPU = {
    "index": _INT,
    "uuid": str,
    "name": str,
    "latest": _map(_OPT_NUM),
    "energy_j": _opt(_NUM),
    "history": _map(_list(_OPT_NUM)),
}
_SHAPE = {
    "schema": str,
    "run_id": str,
    "name": str,
    "host": str,
    "user": str,
    "pid": _INT,
    "command": str,
    "node_rank": _INT,
    "num_nodes": _INT,
    "rank": _INT,
    "started": _NUM,
    "updated": _NUM,
    "interval_s": _NUM,
    "status": str,
    "reason": str,
    "slurm_job_id": _opt(str),
    "metrics_url": _opt(str),
    "ranks": _list({"rank": _INT, "local_rank": _INT, "device": str, "uuid": _opt(str)}),
    "gpus": _list(_GPU),
    "step": _INT,
    "max_steps": _opt(_INT),
    "samples": _INT,
    "samples_per_s": _opt(_NUM),
    "eta_s": _opt(_NUM),
    "alerts": _list({"name": str, "step": _INT, "message": str}),
    "history": {"t": _list(_NUM), "samples_per_s": _list(_OPT_NUM)},
}


def _kind(spec: Any) -> str:
    """What `spec` asks for, in words: "a number", "a list", "a string or null"."""
    if isinstance(spec, dict):
        return "an object"
    if isinstance(spec, tuple) and spec and isinstance(spec[0], str):
        return {"optional": f"{_kind(spec[1])} or null", "list": "a list", "map": "an object"}[spec[0]]
    return {_NUM: "a number", _INT: "an integer", str: "a string"}[spec]


def _structured(spec: Any) -> bool:
    """An object, list, map or optional spec (not a scalar type)."""
    return isinstance(spec, dict) or (isinstance(spec, tuple) and bool(spec) and isinstance(spec[0], str))


def _finite_series(values: list[Any], nulls: bool) -> bool:
    """Every item a finite int or float (or None, with `nulls`), checked at C speed: True, or False to look closer."""
    if not set(map(type, values)) <= ({int, float, type(None)} if nulls else {int, float}):
        return False
    try:
        return math.isfinite(math.fsum(filter(None, values)))  # None and 0 left out; inf, nan and huge ints are not
    except OverflowError:  # an int too large for a float
        return False


def _fits(value: Any, spec: Any) -> bool:
    """`value` is of the scalar `spec` (a type or a tuple of types; a bool is not a number)."""
    return isinstance(value, spec) and not isinstance(value, bool)


def _check(value: Any, spec: Any, where: str) -> Any:
    """`value` if it has the shape `spec` (strings cut to a readable length), else HeartbeatError naming `where`."""
    if _structured(spec) and not isinstance(spec, dict):
        how, inner = spec
        if how == "optional":
            if value is None:
                return None
            if _structured(inner) or _fits(value, inner):
                return _check(value, inner, where)  # else: named below as "a number or null"
        if how == "list" and isinstance(value, list):
            if inner in (_NUM, _OPT_NUM) and _finite_series(value, inner == _OPT_NUM):  # series: the fast way
                return value
            return [_check(item, inner, f"{where}[{i}]") for i, item in enumerate(value)]
        if how == "map" and isinstance(value, dict):
            if (
                inner == _OPT_NUM
                and _finite_series(list(value.values()), True)
                and all(len(k) <= _MAX_TEXT for k in value)
            ):
                return value  # a GPU's readings: the fast way
            return {str(k)[:_MAX_TEXT]: _check(v, inner, f"{where}.{k}") for k, v in value.items()}
    elif isinstance(spec, dict):
        if isinstance(value, dict):
            prefix = f"{where}." if where else ""
            missing = [key for key in spec if key not in value]
            if missing:
                raise HeartbeatError(f"lacks `{prefix}{missing[0]}`")
            return {key: _check(value[key], inner, f"{prefix}{key}") for key, inner in spec.items()}
    elif _fits(value, spec):
        if isinstance(value, (int, float)) and not (math.isfinite(value) and abs(value) < 2**63):
            raise HeartbeatError(f"has `{where}` = {str(value)[:40]}, not a finite number")
        return value[:_MAX_TEXT] if isinstance(value, str) else value
    raise HeartbeatError(f"has `{where}` of type {type(value).__name__}, where {_kind(spec)} belongs")


def _health(value: Any, where: str) -> dict[str, Any]:
    """A GPU's `health` entry (`telemetry.health.CardHealth.to_json`), an optional key: names to numbers, booleans,
    strings or null, and `problems`, a list of strings."""
    if not isinstance(value, dict) or len(value) > 64:
        raise HeartbeatError(f"has `{where}` that is not an object of at most 64 readings")
    checked: dict[str, Any] = {}
    for key, item in value.items():
        name = str(key)[:64]
        if key == "problems":
            checked[name] = [_check(p, str, f"{where}.problems") for p in _check(item, _list(str), where)][:16]
        elif item is None or isinstance(item, (bool, str)):
            checked[name] = item[:_MAX_TEXT] if isinstance(item, str) else item
        else:
            checked[name] = _check(item, _NUM, f"{where}.{name}")
    return checked


def check_heartbeat(data: Any) -> dict[str, Any]:
    """`data` if it is a heartbeat of this schema with every field of the right type (unknown keys dropped, strings
    cut to 2000 characters; a GPU's optional `health` entry kept, checked).

    Raises:
        HeartbeatError: naming the first field that is missing or of the wrong type.
    """
    if not isinstance(data, dict):
        raise HeartbeatError(f"holds a JSON {type(data).__name__}, not an object")
    if data.get("schema") != SCHEMA:
        raise HeartbeatError(f"has schema {str(data.get('schema'))[:80]!r}, not {SCHEMA!r}")
    checked = _check(data, _SHAPE, "")
    for index, gpu in enumerate(data["gpus"]):
        if isinstance(gpu, dict) and "health" in gpu:
            checked["gpus"][index]["health"] = _health(gpu["health"], f"gpus[{index}].health")
    if checked["status"] not in ("running", "finished", "failed"):
        raise HeartbeatError(f"has `status` {checked['status'][:40]!r}, not running, finished or failed")
    return checked


def status_of(heartbeat: Mapping[str, Any], age_s: float, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> str:
    """`stale` for a running job whose file has not changed for `age_s` seconds, more than `stale_after_s` and than
    three of its own intervals; else the status it wrote. `age_s` is the reader's (`read_heartbeats`: by the file's
    modification time), never `now - heartbeat["updated"]`: the writer's clock may be off by any amount."""
    status = str(heartbeat["status"])
    timeout = max(stale_after_s, 3.0 * float(heartbeat.get("interval_s", 0.0)))
    if status == "running" and age_s > timeout:
        return "stale"
    return status


ReadCache = dict[str, tuple[tuple[int, int, int], dict[str, Any] | None, str, float]]
"""What `read_heartbeats` keeps between calls: file -> (its inode, size and mtime, the heartbeat or None where it was
skipped, its text or why it was skipped, when the reader first saw this version of it)."""


def read_heartbeats(
    runs_dir: str | os.PathLike[str],
    now: float | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    keep_s: float = DEFAULT_KEEP_S,
    cache: ReadCache | None = None,
) -> tuple[list[Job], list[str]]:
    """The heartbeats of `runs_dir` worth showing, each with its status now, and notes on the files skipped.

    Only files named like heartbeats (`is_heartbeat_name`) are opened; other `.json` files are counted in one note.
    A heartbeat's age is taken from its file's modification time (a time in the future counts from when this reader
    first saw that version of the file), never from the `updated` its writer stamped. Running jobs are always shown;
    stale, finished and failed ones for `keep_s` after their file last changed (files last changed before that are
    not even opened). The first `MAX_NOTES` files skipped get a note each, the rest one note with their count.
    `cache` (kept by the caller between calls) saves reading files that did not change since the last call.
    """
    now = time.time() if now is None else now
    directory = Path(runs_dir)
    jobs: list[Job] = []
    notes: list[str] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return [], [f"the runs directory {directory} does not exist (yet): no job has published into it"]
    except OSError as err:
        return [], [f"the runs directory {directory} cannot be read ({err.strerror or err})"]
    seen = set()
    others: list[str] = []
    skipped = 0
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        if not is_heartbeat_name(entry.name):
            others.append(entry.name)
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed since the listing
        if not stat.S_ISLNK(info.st_mode) and now - info.st_mtime > keep_s + stale_after_s:
            continue  # ended (or went stale) long ago
        key = (info.st_ino, info.st_size, info.st_mtime_ns)
        seen.add(entry.path)
        cached = cache.get(entry.path) if cache is not None else None
        if cached is not None and cached[0] == key:
            heartbeat, text, first_seen = cached[1], cached[2], cached[3]
        else:
            first_seen = now
            try:
                heartbeat, text = load_heartbeat(Path(entry.path))
            except HeartbeatError as err:
                heartbeat, text = None, str(err)
            if cache is not None:
                cache[entry.path] = (key, heartbeat, text, first_seen)
        if heartbeat is None:
            skipped += 1
            if skipped <= MAX_NOTES:
                notes.append(f"skipped {entry.name}: it {text}")
            continue
        age_s = max(0.0, now - min(info.st_mtime, first_seen))
        status = status_of(heartbeat, age_s, stale_after_s)
        if status != "running" and age_s > keep_s:
            continue
        jobs.append(Job(entry.name, status, heartbeat, text, age_s))
    if skipped > MAX_NOTES:
        notes.append(f"skipped {skipped - MAX_NOTES:,} more files named like heartbeats (not shown one by one)")
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        notes.append(
            f"ignored {len(others):,} .json file{'s' if len(others) > 1 else ''} not named like a heartbeat "
            f"(<run id>.<host>.<node rank>.json): {shown}"
        )
    if cache is not None:
        for path in set(cache) - seen:
            del cache[path]
    return jobs, notes


def prune_heartbeats(runs_dir: str | os.PathLike[str], older_than_s: float, now: float | None = None) -> int:
    """Remove this user's heartbeats last changed more than `older_than_s` ago, and the temporaries their atomic
    writes left; returns how many files were removed; never raises.

    A file is removed only when it is a regular file of this user, named like a heartbeat, and holds this schema with
    the run id, host and node rank its name was made from; or when it is a temporary of `atomic_path` (its exact hidden
    name) for such a name. Anything else is left alone, whatever its suffix, age or owner: another user's files,
    symlinks, a `results.json` or a `draft.tmp`.
    """
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(runs_dir))
    except OSError:
        return 0
    for entry in entries:
        target = temporary_target(entry.name)
        if not is_heartbeat_name(entry.name if target is None else target):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not owned_by_me(info) or now - info.st_mtime <= older_than_s:
                continue
            if target is None and not _holds_own_name(Path(entry.path)):
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:
            continue
    return removed


def _holds_own_name(path: Path) -> bool:
    """The file holds a heartbeat of this schema whose run id, host and node rank give its name (what any version of
    this package wrote; the other fields are not checked, so old heartbeats are recognised too)."""
    try:
        data = _read_json(path, MAX_BYTES)[0]
    except HeartbeatError:
        return False
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return False
    run_id, host, node_rank = data.get("run_id"), data.get("host"), data.get("node_rank")
    if not (isinstance(run_id, str) and isinstance(host, str) and isinstance(node_rank, int)):
        return False
    return heartbeat_path(path.parent, run_id, host, node_rank).name == path.name


def lead_signal(latest: Mapping[str, float | None]) -> tuple[str, float | None]:
    """The signal to lead with for a card: SM activity (NVML GPM, Hopper or newer) where the card gives it, else
    utilisation, labelled as the fallback; (label, value in %)."""
    if latest.get("sm_activity_pct") is not None:
        return "SM active", latest["sm_activity_pct"]
    return "util (fallback)", latest.get("utilization_pct")


class History:
    """The last `span_s` seconds of a few series, one point per `step_s`: each point is the mean of the values added
    in its step, stamped with the time of the latest one (so the newest point moves as windows arrive)."""

    def __init__(self, span_s: float = HISTORY_S, step_s: float = HISTORY_STEP_S) -> None:
        self.span_s, self.step_s = span_s, step_s
        self.t: list[float] = []
        self._bucket: list[int] = []
        self._sums: dict[str, list[float]] = {}
        self._counts: dict[str, list[int]] = {}

    def add(self, t: float, values: Mapping[str, float | None]) -> None:
        bucket = int(t // self.step_s)
        if not self._bucket or self._bucket[-1] != bucket:
            self.t.append(t)
            self._bucket.append(bucket)
            for key in self._sums:
                self._sums[key].append(0.0)
                self._counts[key].append(0)
        else:
            self.t[-1] = t
        for key, value in values.items():
            if value is None or not math.isfinite(value):
                continue
            if key not in self._sums:
                self._sums[key], self._counts[key] = [0.0] * len(self.t), [0] * len(self.t)
            self._sums[key][-1] += value
            self._counts[key][-1] += 1
        while self.t and self.t[0] < t - self.span_s:
            columns: tuple[list[Any], ...] = (self.t, self._bucket, *self._sums.values(), *self._counts.values())
            for series in columns:
                del series[0]

    def series(self, key: str, digits: int = 2) -> list[float | None]:
        """The points of `key`, aligned with `t` (None where it had no value)."""
        sums, counts = self._sums.get(key), self._counts.get(key)
        if sums is None or counts is None:
            return [None] * len(self.t)
        return [round(s / c, digits) if c else None for s, c in zip(sums, counts, strict=True)]

    def keys(self) -> Iterable[str]:
        return self._sums.keys()
