"""The usage database's facts: its table, the observation a writer adds (`UsageObservation`), how an interval is split
over UTC days, where this machine's database lives, and what a SQLite error says about a database."""

from __future__ import annotations

import math
import os
import re
import socket
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from lightning_accel.errors import ConfigError

__all__ = [
    "NETWORK_FILESYSTEMS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "JOB_TABLE",
    "TABLE",
    "UsageObservation",
    "classify_error",
    "day_of",
    "default_usage_dir",
    "default_usage_path",
    "filesystem_type",
    "job_rows",
    "rollup_rows",
]

SCHEMA_VERSION = 1
"""`PRAGMA user_version` of a usage database."""
TABLE = "usage_daily"
"""The rollup table: one row per UTC day, host, user, job and GPU (the CSV's rows)."""
JOB_TABLE = "usage_jobs"
"""The same rollup summed over each job's GPUs: one row per UTC day, host, user and job (the page and the totals read
it: 8 GPUs a job make it 8 times smaller). Its `steps` are the job's, not summed over its GPUs."""
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "fuse.sshfs", "9p", "beegfs")
"""Filesystem types (mountinfo's) on which SQLite's locks are unsafe."""
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    day TEXT NOT NULL,            -- UTC, YYYY-MM-DD
    host TEXT NOT NULL,
    user TEXT NOT NULL,
    job TEXT NOT NULL,            -- the run id
    gpu TEXT NOT NULL,            -- the GPU's UUID, else its index as text
    gpu_index INTEGER NOT NULL,
    held_s REAL NOT NULL,         -- seconds the job held the GPU
    idle_held_s REAL NOT NULL,    -- of which held while idle
    energy_j REAL NOT NULL,
    samples INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    updated REAL NOT NULL,        -- Unix time of the last interval added
    PRIMARY KEY (day, host, user, job, gpu)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS {JOB_TABLE} (
    day TEXT NOT NULL,
    host TEXT NOT NULL,
    user TEXT NOT NULL,
    job TEXT NOT NULL,
    held_s REAL NOT NULL,         -- GPU-seconds: summed over the job's GPUs
    idle_held_s REAL NOT NULL,
    energy_j REAL NOT NULL,
    samples INTEGER NOT NULL,
    steps INTEGER NOT NULL,       -- the job's optimizer steps: each interval's most over its GPUs
    PRIMARY KEY (day, host, user, job)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""
"""The tables of a usage database (created when missing)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageObservation:
    """What one job did with one GPU during one interval that ends at the `now` passed to `UsageStore.record`.

    Raises:
        ConfigError: for a negative or non-finite amount, `interval_s <= 0`, or `held_s > interval_s`.
    """

    host: str
    """The machine the GPU is in."""
    user: str
    """The job's user (its login name)."""
    job: str
    """The job's run id."""
    gpu_index: int
    """The GPU's index on its host (NVML's)."""
    gpu_uuid: str = ""
    """The GPU's UUID, the GPU's key when given (indices change with `CUDA_VISIBLE_DEVICES` and reboots)."""
    interval_s: float
    """The interval's length in seconds: it spans `[now - interval_s, now]`, split over UTC days where it crosses
    midnight."""
    held_s: float
    """Seconds of the interval the job held the GPU (at most `interval_s`)."""
    idle: bool = False
    """The GPU sat idle while held (the idle-held tracker's verdict for this interval): all of `held_s` is idle-held."""
    energy_j: float = 0.0
    """Energy the GPU drew in the interval, in joules (NVML's total energy counter's difference)."""
    samples: int = 0
    """Training samples the job processed on this GPU in the interval."""
    steps: int = 0
    """Optimizer steps the job took in the interval, as each of its GPUs saw them (the GPUs of a data-parallel job
    report the same steps: the job's steps are the most any of its GPUs reports, not their sum)."""

    def __post_init__(self) -> None:
        for name in ("interval_s", "held_s", "energy_j"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"`{name}={value!r}` must be a finite number >= 0.", setting=name)
        for name in ("samples", "steps", "gpu_index"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}={getattr(self, name)!r}` must be >= 0.", setting=name)
        if self.interval_s <= 0:
            raise ConfigError(f"`interval_s={self.interval_s!r}` must be > 0 (the interval's length).")
        if self.held_s > self.interval_s * (1 + 1e-9):
            raise ConfigError(
                f"`held_s={self.held_s!r}` exceeds `interval_s={self.interval_s!r}`: a GPU is held at most the whole "
                "interval.",
                setting="held_s",
            )

    @property
    def gpu(self) -> str:
        """The GPU's key in the rollup: its UUID, else its index."""
        return self.gpu_uuid or str(self.gpu_index)


def day_of(timestamp: float) -> str:
    """The UTC day of a Unix time, `YYYY-MM-DD`."""
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d")


def _day_shares(start: float, end: float) -> list[tuple[str, float]]:
    """The UTC days `[start, end]` covers and the share of it in each (the shares add up to 1)."""
    shares = []
    cursor = start
    while True:
        day = datetime.fromtimestamp(cursor, timezone.utc).date()
        midnight = datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1)
        stop = min(end, midnight.timestamp())
        shares.append((day.isoformat(), (stop - cursor) / (end - start)))
        if stop >= end:
            return shares
        cursor = stop


def _split_count(total: int, shares: list[float]) -> list[int]:
    """`total` split by `shares` in whole numbers that add up to it (the last share takes the rounding)."""
    parts = [int(round(total * share)) for share in shares[:-1]]
    return [*parts, total - sum(parts)]


def rollup_rows(interval: tuple[float, tuple[UsageObservation, ...]]) -> dict[tuple[str, ...], list[float]]:
    """One interval's observations as rollup rows per (day, host, user, job, gpu): [gpu_index, held_s, idle_held_s,
    energy_j, samples, steps, updated], split over the UTC days the interval covers in proportion to its time there."""
    now, observations = interval
    rows: dict[tuple[str, ...], list[float]] = {}
    for obs in observations:
        shares = _day_shares(now - obs.interval_s, now)
        weights = [share for _, share in shares]
        samples, steps = _split_count(obs.samples, weights), _split_count(obs.steps, weights)
        for part, (day, share) in enumerate(shares):
            held = obs.held_s * share
            row = rows.setdefault((day, obs.host, obs.user, obs.job, obs.gpu), [obs.gpu_index, 0, 0, 0, 0, 0, now])
            row[1] += held
            row[2] += held if obs.idle else 0.0
            row[3] += obs.energy_j * share
            row[4] += samples[part]
            row[5] += steps[part]
    return rows


def job_rows(rows: dict[tuple[str, ...], list[float]]) -> dict[tuple[str, ...], list[float]]:
    """One interval's `rollup_rows` summed over each job's GPUs, per (day, host, user, job): [held_s, idle_held_s,
    energy_j, samples, steps], the steps the most any GPU of the job took (they all take the same)."""
    jobs: dict[tuple[str, ...], list[float]] = {}
    for key, (_, held, idle, energy, samples, steps, _) in rows.items():
        job = jobs.setdefault(key[:4], [0.0, 0.0, 0.0, 0, 0])
        job[0] += held
        job[1] += idle
        job[2] += energy
        job[3] += samples
        job[4] = max(job[4], steps)
    return jobs


def classify_error(err: sqlite3.Error) -> str:
    """`locked`, `read-only`, `corrupt` or `other`: what a SQLite error says about the database."""
    name = getattr(err, "sqlite_errorname", "")  # Python 3.11+
    text = str(err).lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return "locked"
    if (
        name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM"))
        or "readonly" in text
        or ("unable to open" in text)
    ):
        return "read-only"
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text or "not a database" in text:
        return "corrupt"
    return "other"


def default_usage_dir(env: Mapping[str, str] | None = None) -> Path:
    """`$ACCEL_USAGE_DIR`, else `$XDG_STATE_HOME/lightning_accel`, else `~/.local/state/lightning_accel`: local disk
    (state, not cache: usage is not something to rebuild)."""
    env = os.environ if env is None else env
    if env.get("ACCEL_USAGE_DIR"):
        return Path(env["ACCEL_USAGE_DIR"]).expanduser()
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "lightning_accel"


def default_usage_path(host: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """This machine's database: `default_usage_dir() / "usage-<host>.sqlite"` (the host name made safe for a file)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname()) or "host"
    return default_usage_dir(env) / f"usage-{name}.sqlite"


def filesystem_type(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The filesystem type of the mount holding `path` (the longest mount point above it), or None unknown."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target, best, found = str(path.resolve()), -1, None
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, found = len(point), tail.split()[0]
    return found
