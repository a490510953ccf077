"""The usage page's data, read from several machines' usage databases at once (read-only): GPU-hours per user per
day (held and idle-held), the jobs that held GPUs idle longest, totals per user, job or host, and the rows as CSV.

A database that is locked, unreadable or corrupt is left out with a warning (`UsageStoreWarning`,
`UsageCorruptWarning`) and a note in the result; the rest are read."""

from __future__ import annotations

import csv
import heapq
import sqlite3
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import IO, Any, Literal

from lightning_accel.dash.usage_schema import JOB_TABLE, SCHEMA_VERSION, TABLE, classify_error
from lightning_accel.errors import UsageCorruptWarning, UsageStoreWarning

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_TOP_JOBS",
    "UsagePage",
    "UsageReader",
    "UsageRow",
    "UsageTotal",
    "usage_databases",
    "write_csv",
]

CSV_COLUMNS = (
    "day",
    "host",
    "user",
    "job",
    "gpu",
    "gpu_index",
    "gpu_hours",
    "idle_gpu_hours",
    "kwh",
    "samples",
    "steps",
)
"""`accel-dash usage --csv`'s columns: the UTC day, where, who, the job (run id), the GPU (UUID, else index), then
GPU-hours held, of which idle-held, kWh, samples and optimizer steps."""
DEFAULT_TOP_JOBS = 10
"""Idle-held jobs listed on the usage page."""
_SUMS = "sum(held_s), sum(idle_held_s), sum(energy_j), sum(samples), sum(steps)"
_HOUR, _KWH = 3600.0, 3.6e6


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One rollup row: one UTC day of one job on one GPU."""

    day: str
    host: str
    user: str
    job: str
    gpu: str
    gpu_index: int
    held_s: float
    idle_held_s: float
    energy_j: float
    samples: int
    steps: int

    def csv_fields(self) -> list[str]:
        """The row as `CSV_COLUMNS`: hours to 4 decimals (0.36 s), kWh to 6 (3.6 J)."""
        amounts = [f"{self.held_s / _HOUR:.4f}", f"{self.idle_held_s / _HOUR:.4f}", f"{self.energy_j / _KWH:.6f}"]
        names = [self.day, self.host, self.user, self.job, self.gpu, str(self.gpu_index)]
        return [*names, *amounts, str(self.samples), str(self.steps)]


@dataclass(slots=True)
class UsageTotal:
    """Usage added up over a date range for one user, job (`key` is `(user, job)`) or host."""

    key: tuple[str, ...]
    held_s: float = 0.0
    idle_held_s: float = 0.0
    energy_j: float = 0.0
    samples: int = 0
    steps: int = 0
    hosts: set[str] = field(default_factory=set)
    """The hosts it ran on."""

    def as_dict(self) -> dict[str, Any]:
        """Hours and kWh, as the page shows them."""
        return {
            "key": list(self.key),
            "hosts": sorted(self.hosts),
            "gpu_hours": self.held_s / _HOUR,
            "idle_gpu_hours": self.idle_held_s / _HOUR,
            "kwh": self.energy_j / _KWH,
            "samples": self.samples,
            "steps": self.steps,
        }


@dataclass(frozen=True, slots=True)
class UsagePage:
    """The usage page's data over `days` (UTC, oldest first)."""

    days: list[str]
    held_gpu_hours: dict[str, list[float]]
    """User -> GPU-hours held each day (the bar's full height)."""
    idle_gpu_hours: dict[str, list[float]]
    """User -> GPU-hours of them held while idle each day (the upper part of the bar; the lower is the busy rest)."""
    top_idle_jobs: list[UsageTotal]
    """The jobs with the most idle-held GPU-hours over the range, most first (`key` is `(user, job)`)."""
    databases: list[str]
    """The databases read."""
    notes: list[str]
    """The databases left out and why."""

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["top_idle_jobs"] = [job.as_dict() for job in self.top_idle_jobs]
        return data


def usage_databases(sources: Iterable[Path]) -> list[Path]:
    """The database files of `sources`: a file as given, a directory as every `usage-*.sqlite` in it (sorted)."""
    found: list[Path] = []
    for source in sources:
        found.extend(sorted(source.glob("usage-*.sqlite")) if source.is_dir() else [source])
    return list(dict.fromkeys(found))


def _bounds(since: date | None, until: date | None) -> tuple[str, str]:
    return (since.isoformat() if since else "0000-00-00", until.isoformat() if until else "9999-99-99")


class UsageReader:
    """Reads several usage databases read-only (`file:...?mode=ro`) and merges them.

    Args:
        sources: database files, or directories of `usage-*.sqlite` files (one per host).
        busy_timeout_s: how long to wait for a database another process holds locked before leaving it out.
    """

    def __init__(self, sources: Sequence[Path], busy_timeout_s: float = 0.5) -> None:
        self.sources = list(sources)
        self.busy_timeout_s = busy_timeout_s
        self.notes: list[str] = []
        """The databases the last query left out, and why (each also warned)."""
        self.databases: list[Path] = []
        """The databases the last query read."""

    def _each(self, queries: Sequence[str], params: Sequence[object]) -> Iterator[list[list[Any]]]:
        """The results of `queries` (in one read transaction: one snapshot) in each database that can be read; each
        that cannot is warned about and noted."""
        self.notes, self.databases = [], []
        for path in usage_databases(self.sources):
            try:
                uri = f"{path.resolve().as_uri()}?mode=ro"
                connection = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout_s, isolation_level=None)
            except sqlite3.Error as err:
                self._leave_out(path, err)
                continue
            try:
                version = connection.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    self._leave_out(path, f"its schema {version} is newer than this reader's {SCHEMA_VERSION}")
                    continue
                connection.execute("BEGIN")
                results = [connection.execute(sql, params).fetchall() for sql in queries]
            except sqlite3.Error as err:
                self._leave_out(path, err)
                continue
            finally:
                connection.close()
            self.databases.append(path)
            yield results

    def _leave_out(self, path: Path, why: sqlite3.Error | str) -> None:
        if isinstance(why, str):
            kind, text = "other", why
        else:
            kind, text = classify_error(why), str(why)
        words = {
            "locked": f"locked by another process past {self.busy_timeout_s:g} s ({text})",
            "read-only": f"cannot be opened ({text}): it, its directory or its -wal/-shm files are not readable",
            "corrupt": f"corrupt ({text}); move it aside or repair it with `sqlite3 FILE .recover`",
        }.get(kind, text)
        note = f"the usage database {path} is left out: {words}"
        self.notes.append(note)
        warnings.warn(note, UsageCorruptWarning if kind == "corrupt" else UsageStoreWarning, stacklevel=4)

    def rows(self, since: date | None = None, until: date | None = None) -> list[UsageRow]:
        """Every rollup row of the UTC days `since`..`until` (both included; None: unbounded), ordered by day, host,
        user, job and GPU index."""
        sql = (
            "SELECT day, host, user, job, gpu, gpu_index, held_s, idle_held_s, energy_j, samples, steps "
            f"FROM {TABLE} WHERE day BETWEEN ? AND ?"
        )
        found = [UsageRow(*row) for (rows,) in self._each([sql], _bounds(since, until)) for row in rows]
        found.sort(key=lambda row: (row.day, row.host, row.user, row.job, row.gpu_index, row.gpu))
        return found

    def totals(
        self, by: Literal["user", "job", "host"], since: date | None = None, until: date | None = None
    ) -> list[UsageTotal]:
        """Usage added up per user, per job (`(user, job)`, across hosts) or per host over the days
        `since`..`until`, most GPU-hours held first. A job's steps are its own (the most of any host it ran on, as
        each node of a multi-node job takes the same steps); a user's or a host's are the sum of their jobs'."""
        bounds = _bounds(since, until)
        if by == "host":
            merged: dict[tuple[str, ...], list[Any]] = {}
            for (rows,) in self._each([_HOST_SUMS], bounds):
                for host, *amounts in rows:
                    _add(merged, (host,), {host}, amounts)
            return _ordered(merged)
        jobs = _merge_jobs(results[0] for results in self._each([_JOB_SUMS], bounds))
        if by == "job":
            return _ordered(jobs)
        users: dict[tuple[str, ...], list[Any]] = {}
        for (user, _), (*amounts, hosts) in jobs.items():
            _add(users, (user,), hosts, amounts)
        return _ordered(users)

    def page(self, since: date | None = None, until: date | None = None, top: int = DEFAULT_TOP_JOBS) -> UsagePage:
        """The usage page: GPU-hours per user per UTC day, held and idle-held, over `since`..`until` (None: from the
        first / to the last day found), and the `top` jobs by idle-held GPU-hours; one snapshot of each database."""
        per_day: dict[tuple[str, str], list[float]] = {}
        job_sums = []
        for user_days, jobs_rows in self._each([_USER_DAYS, _JOB_SUMS], _bounds(since, until)):
            job_sums.append(jobs_rows)
            for day, user, held_s, idle_s in user_days:
                sums = per_day.setdefault((day, user), [0.0, 0.0])
                sums[0] += held_s
                sums[1] += idle_s
        seen = sorted({day for day, _ in per_day})
        first = since or (date.fromisoformat(seen[0]) if seen else None)
        last = until or (date.fromisoformat(seen[-1]) if seen else None)
        days = [] if first is None or last is None else _days(first, last)
        index = {day: position for position, day in enumerate(days)}
        users = sorted({user for _, user in per_day})
        held = {user: [0.0] * len(days) for user in users}
        idle = {user: [0.0] * len(days) for user in users}
        for (day, user), (held_s, idle_s) in per_day.items():
            held[user][index[day]] = held_s / _HOUR
            idle[user][index[day]] = idle_s / _HOUR
        idle_jobs = [item for item in _merge_jobs(job_sums).items() if item[1][1] > 0]
        chosen = heapq.nsmallest(top, idle_jobs, key=lambda item: (-item[1][1], item[0]))
        top_jobs = [_total(key, entry) for key, entry in chosen]
        return UsagePage(days, held, idle, top_jobs, [str(path) for path in self.databases], list(self.notes))


_USER_DAYS = f"SELECT day, user, sum(held_s), sum(idle_held_s) FROM {JOB_TABLE} WHERE day BETWEEN ? AND ? GROUP BY 1, 2"
_JOB_SUMS = f"SELECT user, job, host, {_SUMS} FROM {JOB_TABLE} WHERE day BETWEEN ? AND ? GROUP BY user, job, host"
_HOST_SUMS = f"SELECT host, {_SUMS} FROM {JOB_TABLE} WHERE day BETWEEN ? AND ? GROUP BY host"


def _add(
    merged: dict[tuple[str, ...], list[Any]], key: tuple[str, ...], hosts: set[str], amounts: Sequence[Any]
) -> None:
    """Adds held, idle-held, energy, samples and steps (all summed) to `merged[key]`: `[..., hosts]`."""
    entry = merged.get(key)
    if entry is None:
        merged[key] = [*amounts, set(hosts)]
        return
    for position in range(5):
        entry[position] += amounts[position]
    entry[5] |= hosts


def _merge_jobs(results: Iterable[list[Any]]) -> dict[tuple[str, ...], list[Any]]:
    """Each database's `(user, job, host, sums...)` rows merged per `(user, job)`: `[held_s, idle_held_s,
    energy_j, samples, steps, hosts]`, the steps the most of any host (each node takes the job's steps)."""
    jobs: dict[tuple[str, ...], list[Any]] = {}
    for rows in results:
        for user, job, host, held_s, idle_s, energy_j, samples, steps in rows:
            entry = jobs.get((user, job))
            if entry is None:
                jobs[(user, job)] = [held_s, idle_s, energy_j, samples, steps, {host}]
                continue
            entry[0] += held_s
            entry[1] += idle_s
            entry[2] += energy_j
            entry[3] += samples
            entry[4] = max(entry[4], steps)
            entry[5].add(host)
    return jobs


def _total(key: tuple[str, ...], entry: list[Any]) -> UsageTotal:
    held_s, idle_held_s, energy_j, samples, steps, hosts = entry
    return UsageTotal(key, held_s, idle_held_s, energy_j, samples, steps, hosts)


def _ordered(merged: dict[tuple[str, ...], list[Any]]) -> list[UsageTotal]:
    totals = [_total(key, entry) for key, entry in merged.items()]
    return sorted(totals, key=lambda total: (-total.held_s, total.key))


def _days(first: date, last: date) -> list[str]:
    return [(first + timedelta(days=offset)).isoformat() for offset in range((last - first).days + 1)]


def write_csv(rows: Iterable[UsageRow], stream: IO[str]) -> int:
    """Writes `CSV_COLUMNS` and then `rows` as CSV to `stream`; returns the number of rows."""
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    count = 0
    for row in rows:
        writer.writerow(row.csv_fields())
        count += 1
    return count
