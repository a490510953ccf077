"""accel-dash's subcommands beside the page: `accel-dash agent` (this machine's cards into the shared runs
directory, and its usage) and `accel-dash snooze` (silence alerts for a while)."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_accel.dash.notify import snooze
from lightning_accel.dash.state import DashState
from lightning_accel.dash.usage_schema import default_usage_dir, default_usage_path
from lightning_accel.telemetry.heartbeat import default_runs_dir
from lightning_accel.telemetry.idle_held import DEFAULT_IDLE_AFTER_S, DEFAULT_IDLE_PCT, IdleHeldTracker

__all__ = ["add_idle_options", "agent_main", "percent", "seconds", "snooze_file", "snooze_main"]


def percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in (0, 100], e.g. 5, got {text}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def add_idle_options(parser: argparse.ArgumentParser) -> None:
    """`--idle-pct` and `--idle-after`, the idle-held threshold of accel-dash's page and of its agent."""
    parser.add_argument(
        "--idle-pct",
        type=percent,
        default=DEFAULT_IDLE_PCT,
        help=f"a held card whose SM activity (utilisation where the card has no GPM) stays below this is idle "
        f"(default {DEFAULT_IDLE_PCT:g}%%)",
    )
    parser.add_argument(
        "--idle-after",
        type=seconds,
        default=DEFAULT_IDLE_AFTER_S,
        help=f"a card held and idle this long is flagged idle-held, with its owner and the idle GPU-hours "
        f"(default {DEFAULT_IDLE_AFTER_S:.0f} s)",
    )


def snooze_file() -> Path:
    return default_usage_dir() / "snooze.json"


def snooze_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="accel-dash snooze",
        description="Silence the alerts whose key matches PATTERN (fnmatch: `idle_held/gpu-node-3/*`, "
        "`job_stale/*`, `health/*/GPU-1234*`) for a while: writes the snooze file accel-dash reads before each post.",
    )
    parser.add_argument("pattern", help="the alert keys to silence (as the posts' `key` shows them)")
    parser.add_argument("--for", dest="for_s", type=seconds, default=3600.0, help="seconds (default 3600)")
    parser.add_argument(
        "--file",
        type=Path,
        default=None,
        help=f"the snooze file (default {snooze_file()}); the page reads it where its `--snooze-file` says",
    )
    args = parser.parse_args(argv)
    path = args.file or snooze_file()
    try:
        snooze(path, args.pattern, args.for_s)
    except OSError as err:
        print(f"accel-dash snooze: error: `--file {path}` cannot be written ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"accel-dash snooze: {args.pattern!r} silenced for {args.for_s:.0f} s ({path})")
    return 0


def agent_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="accel-dash agent",
        description="Publish this machine's cards, with the processes and users on them (any process, not only "
        "Lightning jobs), into the shared runs directory every --interval seconds, so one accel-dash page lists "
        "every host; and record this machine's usage (its one writer). A systemd unit: "
        "examples/monitoring/accel-dash-agent.service.",
    )
    parser.add_argument("--runs-dir", type=Path, default=None, help="the shared runs directory (as accel-dash's)")
    parser.add_argument("--hostname", default=None, help="the host name to publish as (default: this machine's)")
    parser.add_argument("--interval", type=seconds, default=2.0, help="seconds between readings (default 2)")
    parser.add_argument("--usage-db", type=Path, default=None, help="as accel-dash's `--usage-db`")
    parser.add_argument("--no-usage", action="store_true", help="publish the cards only; record no usage")
    add_idle_options(parser)  # as accel-dash's: the idle-held usage it records
    parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)  # tests and benchmarks
    args = parser.parse_args(argv)
    runs_dir = (args.runs_dir or default_runs_dir()).expanduser()
    host = args.hostname or socket.gethostname()
    from lightning_accel.dash.agent import run_agent
    from lightning_accel.telemetry.host_gpus import HostGPUs

    cards = HostGPUs()
    store = None
    last: list[list[dict[str, Any]]] = [[]]  # the round's reading: read once, published and recorded
    idle = IdleHeldTracker(args.idle_pct, args.idle_after)
    state = DashState(runs_dir, host_cards=lambda: last[0], host=host, idle=idle)
    if not args.no_usage:
        from lightning_accel.dash.usage_feed import UsageFeed
        from lightning_accel.dash.usage_store import UsageStore

        store = UsageStore(args.usage_db.expanduser() if args.usage_db else default_usage_path(host))
        state.usage = UsageFeed(store, host, agent=True)

    def read() -> list[dict[str, Any]]:
        last[0] = cards.read()
        return last[0]

    def record(_: list[dict[str, Any]]) -> None:
        state.build()  # the usage of this host's jobs and cards since the last round

    print(f"accel-dash agent: publishing {host}'s cards into {runs_dir} every {args.interval:g} s", flush=True)
    try:
        run_agent(
            runs_dir,
            host,
            read,
            lambda: cards.problem,
            args.interval,
            on_round=record if store is not None else None,
            rounds=args.rounds,
        )
    except OSError as err:
        print(
            f"accel-dash agent: error: `--runs-dir {runs_dir}` cannot be written ({err.strerror or err})",
            file=sys.stderr,
        )
        return 2
    finally:
        cards.close()
        if store is not None:
            store.close()
    return 0
