"""The usage kept: one SQLite database per machine, on local disk, of GPU-hours held and idle-held, energy, samples
and optimizer steps rolled up per UTC day, host, user, job and GPU; `UsageStore` writes it, `usage_view` reads several.

SQLite's file locks are unsafe on a network filesystem (NFS, CIFS/SMB, Lustre, GPFS, CephFS, sshfs, 9p): two
machines writing one file over NFS can corrupt it. So each machine writes its own file on its local disk
(`default_usage_path()`: `$ACCEL_USAGE_DIR`, else `$XDG_STATE_HOME/lightning_accel`, else
`~/.local/state/lightning_accel`, as `usage-<host>.sqlite`), and the team's view reads copies of them (made with
`sqlite3 usage-<host>.sqlite ".backup copy.sqlite"`, which is consistent while the writer runs; a plain `cp` or rsync
of a live WAL database may not be). `UsageStore` warns (`UsageStoreWarning`) when its file is on a network filesystem.
"""

from __future__ import annotations

import sqlite3
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from lightning_accel.dash.usage_schema import (
    JOB_TABLE,
    NETWORK_FILESYSTEMS,
    SCHEMA,
    SCHEMA_VERSION,
    TABLE,
    UsageObservation,
    classify_error,
    day_of,
    default_usage_path,
    filesystem_type,
    job_rows,
    rollup_rows,
)
from lightning_accel.errors import ConfigError, UsageCorruptWarning, UsageStoreWarning, describe_os_error

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PENDING",
    "DEFAULT_RETENTION_DAYS",
    "LOW_WATER",
    "PruneReport",
    "UsageStore",
]

DEFAULT_RETENTION_DAYS = 90
"""Days kept before today (UTC): about a quarter, enough for a monthly report and the month before it."""
DEFAULT_MAX_BYTES = 256 * 2**20
"""The size cap of one database: 90 days of 8 GPUs shared by 40 jobs a day (320 GPU rows a day) take about 4 MiB
(tests/benchmarks/bench_usage.py), so only a runaway (thousands of distinct jobs a day) meets it."""
DEFAULT_MAX_PENDING = 720
"""Intervals kept in memory while the database cannot be written (locked, read-only, corrupt): an hour at 5 s."""
LOW_WATER = 0.9
"""Pruning for size goes down to this share of the cap, so that it (and its VACUUM) does not run again each day."""
_UPSERT = f"""
INSERT INTO {TABLE} (day, host, user, job, gpu, gpu_index, held_s, idle_held_s, energy_j, samples, steps, updated)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (day, host, user, job, gpu) DO UPDATE SET
    gpu_index = excluded.gpu_index,
    held_s = held_s + excluded.held_s,
    idle_held_s = idle_held_s + excluded.idle_held_s,
    energy_j = energy_j + excluded.energy_j,
    samples = samples + excluded.samples,
    steps = steps + excluded.steps,
    updated = max(updated, excluded.updated)
"""
_UPSERT_JOB = f"""
INSERT INTO {JOB_TABLE} (day, host, user, job, held_s, idle_held_s, energy_j, samples, steps)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (day, host, user, job) DO UPDATE SET
    held_s = held_s + excluded.held_s,
    idle_held_s = idle_held_s + excluded.idle_held_s,
    energy_j = energy_j + excluded.energy_j,
    samples = samples + excluded.samples,
    steps = steps + excluded.steps
"""


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What `UsageStore.prune` dropped."""

    days_by_age: int
    """Days dropped for being older than the retention."""
    days_by_size: int
    """Oldest days dropped to bring the database under its size cap."""
    vacuumed: bool
    """The file was rewritten (VACUUM) to give the freed pages back to the disk."""
    file_bytes: int
    """The database file's size afterwards."""


class UsageStore:
    """The writer of this machine's usage database: one per machine, on local disk (see the module's docstring).

    Each `record` adds one interval's observations to the daily rollup in one transaction, so a crash (even SIGKILL)
    loses at most the interval being written. The database runs in WAL mode (readers never wait for the writer) with
    `synchronous=NORMAL` (a power cut may lose the last intervals, never the file) and a busy timeout.

    When the database cannot be written (locked past the busy timeout, read-only, corrupt) `record` warns
    (`UsageStoreWarning`, `UsageCorruptWarning` for a corrupt file), skips the interval and keeps its observations for
    the next try, at most `max_pending` intervals (the oldest are dropped past it, with a warning).

    Pruning (`prune`, run by `record` once an hour): days older than `retention_days` are deleted; then, where the
    data is over `max_bytes`, whole oldest days until it is under 90% of it. Deleting frees pages inside the file,
    which the next days reuse, so the file does not grow; only when the file itself is over `max_bytes` is it
    rewritten with VACUUM, which costs a full copy of the database (time in proportion to its size, about a second
    per hundred MiB on a local SSD, up to twice its size on disk meanwhile) and holds the write lock while it runs.

    Args:
        path: the database file (default `default_usage_path()`); its directory is created.
        retention_days: UTC days kept before today (default 90).
        max_bytes: the size cap of the database (default 256 MiB).
        busy_timeout_s: how long a write waits for another connection's lock before the interval is skipped.
        max_pending: intervals kept in memory while the database cannot be written.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        retention_days: int = DEFAULT_RETENTION_DAYS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        busy_timeout_s: float = 5.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if retention_days < 1:
            raise ConfigError(f"`retention_days={retention_days!r}` must be >= 1 (today and that many days before).")
        if max_bytes < 64 * 1024:
            raise ConfigError(f"`max_bytes={max_bytes!r}` must be at least 65536 (64 KiB), e.g. 256 * 2**20.")
        if max_pending < 1:
            raise ConfigError(f"`max_pending={max_pending!r}` must be >= 1.")
        self.path = Path(path) if path is not None else default_usage_path()
        self.retention_days, self.max_bytes, self.max_pending = retention_days, max_bytes, max_pending
        self.busy_timeout_s = busy_timeout_s
        self._pending: list[tuple[float, tuple[UsageObservation, ...]]] = []
        self._connection: sqlite3.Connection | None = None
        self._pruned_at: float | None = None
        fstype = filesystem_type(self.path.parent if self.path.parent.exists() else Path("/"))
        if fstype in NETWORK_FILESYSTEMS:
            warnings.warn(
                f"the usage database {self.path} is on a {fstype} filesystem, where SQLite's locks are unsafe and the "
                "file can be corrupted; pass a path on local disk (`$ACCEL_USAGE_DIR` or `XDG_STATE_HOME`).",
                UsageStoreWarning,
                stacklevel=2,
            )

    @property
    def pending(self) -> int:
        """Intervals waiting to be written (0 after a successful `record`)."""
        return len(self._pending)

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # one writer, but not always one thread (a page's request handlers and its watch thread take turns under
            # DashState's lock): the connection is not tied to the thread that opened it
            connection = sqlite3.connect(
                self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            try:
                connection.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                connection.execute("PRAGMA journal_mode = WAL")
                connection.execute("PRAGMA synchronous = NORMAL")
                connection.executescript(SCHEMA)
                connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except sqlite3.Error:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    def record(self, observations: Iterable[UsageObservation], now: float | None = None) -> bool:
        """Adds one interval, ending at `now` (Unix time; default: the clock), to the rollup, with any intervals kept
        from failed tries, in one transaction. Returns True when written, False when skipped (warned; kept)."""
        now = time.time() if now is None else now
        self._pending.append((now, tuple(observations)))
        try:
            connection = self._connect()
            connection.execute("BEGIN IMMEDIATE")
            try:
                for interval in self._pending:
                    rows = rollup_rows(interval)
                    connection.executemany(_UPSERT, [(*key, *row) for key, row in rows.items()])
                    connection.executemany(_UPSERT_JOB, [(*key, *row) for key, row in job_rows(rows).items()])
                connection.execute("INSERT OR REPLACE INTO meta VALUES ('last_interval_end', ?)", (repr(now),))
                connection.execute("COMMIT")
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
        except sqlite3.Error as err:
            self._warn(err, "keeps this interval for the next try", stacklevel=3)
            self._bound_pending()
            return False
        except OSError as err:  # its directory cannot be made (a path under a file, no permission)
            warnings.warn(
                f"the usage database {self.path} cannot be opened: {describe_os_error(err)}; pass a path on a "
                "writable local disk (`--usage-db`, `$ACCEL_USAGE_DIR`); the writer keeps this interval for the next "
                "try.",
                UsageStoreWarning,
                stacklevel=2,
            )
            self._bound_pending()
            return False
        self._pending.clear()
        if self._pruned_at is None or now - self._pruned_at >= 3600 or day_of(now) != day_of(self._pruned_at):
            self.prune(now)
        return True

    def _bound_pending(self) -> None:
        """Drops the oldest kept intervals past `max_pending`, with a warning that says how much usage they held."""
        if len(self._pending) <= self.max_pending:
            return
        dropped = self._pending[: -self.max_pending]
        del self._pending[: -self.max_pending]
        held_h = sum(obs.held_s for _, batch in dropped for obs in batch) / 3600
        warnings.warn(
            f"the usage database {self.path} has not been writable for {self.max_pending} intervals: the oldest "
            f"{len(dropped)} ({held_h:.2f} GPU-hours held) are dropped.",
            UsageStoreWarning,
            stacklevel=4,
        )

    def _warn(self, err: sqlite3.Error, outcome: str, stacklevel: int) -> None:
        kind = classify_error(err)
        if kind == "corrupt":
            self.close()
            message = (
                f"the usage database {self.path} is corrupt ({err}); the writer {outcome}. Move the file aside (the "
                "next interval starts a new one) or repair it with `sqlite3 FILE .recover`."
            )
            warnings.warn(message, UsageCorruptWarning, stacklevel=stacklevel)
            return
        fix = {
            "locked": f"another process holds its lock past the busy timeout of {self.busy_timeout_s:g} s",
            "read-only": "it cannot be written; make the file and its directory writable or pass another path",
        }.get(kind, "SQLite failed")
        warnings.warn(
            f"the usage database {self.path}: {err} ({fix}); the writer {outcome}.", UsageStoreWarning, stacklevel
        )

    def prune(self, now: float | None = None) -> PruneReport | None:
        """Drops days older than `retention_days`, then the oldest days while the data is over `max_bytes` (down to
        90% of it), then VACUUMs where the file is still over `max_bytes`. None (warned) when the database cannot be
        written."""
        now = time.time() if now is None else now
        try:
            report = self._prune(now)
        except sqlite3.Error as err:
            self._warn(err, "prunes it on a later interval", stacklevel=3)
            return None
        self._pruned_at = now
        return report

    def _prune(self, now: float) -> PruneReport:
        connection = self._connect()
        today = datetime.fromtimestamp(now, timezone.utc).date()
        cutoff = (today - timedelta(days=self.retention_days)).isoformat()
        connection.execute("BEGIN IMMEDIATE")
        try:
            by_age = connection.execute(f"SELECT count(DISTINCT day) FROM {TABLE} WHERE day < ?", (cutoff,)).fetchone()
            for table in (TABLE, JOB_TABLE):
                connection.execute(f"DELETE FROM {table} WHERE day < ?", (cutoff,))
            by_size = self._drop_for_size(connection)
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
        vacuumed = self._file_bytes(connection) > self.max_bytes
        if vacuumed:
            connection.execute("VACUUM")
            connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return PruneReport(by_age[0], by_size, vacuumed, self._file_bytes(connection))

    @staticmethod
    def _file_bytes(connection: sqlite3.Connection) -> int:
        return int(connection.execute("PRAGMA page_count").fetchone()[0] * _page_size(connection))

    def _drop_for_size(self, connection: sqlite3.Connection) -> int:
        """Deletes whole oldest days (never today's) until the data is under `LOW_WATER * max_bytes`; returns how
        many. The bytes per day are estimated from the GPU rows per day and the bytes in use per GPU row (the job
        rollup's share included)."""
        pages, free = (connection.execute(f"PRAGMA {name}").fetchone()[0] for name in ("page_count", "freelist_count"))
        used = (pages - free) * _page_size(connection)
        if used <= self.max_bytes:
            return 0
        days = connection.execute(f"SELECT day, count(*) FROM {TABLE} GROUP BY day ORDER BY day").fetchall()
        rows = sum(count for _, count in days)
        if rows == 0 or len(days) < 2:
            return 0
        per_row, excess, dropped, last = used / rows, used - LOW_WATER * self.max_bytes, 0, None
        for day, count in days[:-1]:
            if excess <= 0:
                break
            excess -= count * per_row
            dropped, last = dropped + 1, day
        for table in (TABLE, JOB_TABLE):
            connection.execute(f"DELETE FROM {table} WHERE day <= ?", (last,))
        return dropped

    def close(self) -> None:
        """Closes the connection (a later `record` opens it again); what is pending stays pending."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> UsageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _page_size(connection: sqlite3.Connection) -> int:
    return int(connection.execute("PRAGMA page_size").fetchone()[0])
