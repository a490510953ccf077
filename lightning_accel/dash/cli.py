"""accel-dash: every job of a runs directory and this host's cards, live on one read-only web page (or once as text
or JSON)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys
import warnings
from collections.abc import Sequence
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Literal

from lightning_accel.dash.notify import DEFAULT_GRACE_S, DEFAULT_REPEAT_S, Notifier, load_routes
from lightning_accel.dash.state import DashState, page_dict, text_report
from lightning_accel.dash.subcommands import add_idle_options, agent_main, seconds, snooze_file, snooze_main
from lightning_accel.dash.usage_schema import default_usage_dir, default_usage_path
from lightning_accel.dash.usage_view import CSV_COLUMNS, UsageReader, usage_databases, write_csv
from lightning_accel.errors import ConfigError
from lightning_accel.telemetry.heartbeat import DEFAULT_KEEP_S, DEFAULT_STALE_AFTER_S, default_runs_dir
from lightning_accel.telemetry.idle_held import IdleHeldTracker

__all__ = ["DEFAULT_PORT", "WATCH_INTERVAL_S", "build_parser", "build_usage_parser", "main"]

DEFAULT_PORT = 8765
WATCH_INTERVAL_S = 2.0
"""Seconds between the page's builds while it records usage or sends alerts, whether a browser looks or not."""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0-65535 (0: a free one), got {value}")
    return value


def _utc_day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        today = datetime.now(timezone.utc).date().isoformat()
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a date; pass a UTC day as YYYY-MM-DD, e.g. {today}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel-dash",
        description="Every running, stale and recently ended job that publishes into the runs directory, grouped by "
        "host, with its cards live, and this host's cards that no job of ours holds; on one read-only web page "
        "served on 127.0.0.1, or once as a text table (--once) or JSON (--json).",
        epilog="`accel-dash usage --help`: the usage kept (GPU-hours held and idle-held, kWh, samples, steps per UTC "
        "day, host, user, job and GPU), as CSV or totals.",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="the runs directory the jobs publish into (default: $ACCEL_RUNS_DIR, else "
        "$XDG_CACHE_HOME/lightning_accel/runs, i.e. ~/.cache/lightning_accel/runs); point "
        "the team's jobs and this at one shared path",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to serve on (default 127.0.0.1: this machine only); anything else, e.g. "
        "0.0.0.0, lets every machine that reaches the port read the page",
    )
    parser.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"the port (default {DEFAULT_PORT}; 0: a free one)"
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--once", action="store_true", help="print the jobs and cards once as tables and exit")
    shown.add_argument("--json", action="store_true", help="print the page data once as JSON and exit")
    parser.add_argument(
        "--stale-after",
        type=seconds,
        default=DEFAULT_STALE_AFTER_S,
        help=f"a running job silent this long reads as stale (default {DEFAULT_STALE_AFTER_S:.0f} s)",
    )
    parser.add_argument(
        "--keep",
        type=seconds,
        default=DEFAULT_KEEP_S,
        help=f"list stale, finished and failed jobs this long after their last heartbeat (default "
        f"{DEFAULT_KEEP_S:.0f} s)",
    )
    add_idle_options(parser)
    parser.add_argument(
        "--no-host-gpus",
        action="store_true",
        help="do not read this host's GPUs through NVML (only the jobs' own heartbeats)",
    )
    parser.add_argument(
        "--usage-db",
        type=Path,
        default=None,
        help="while the page is served, record this host's usage (GPU-hours held and idle-held, kWh, samples, steps) "
        "into this SQLite file, on local disk (SQLite's locks are unsafe on network filesystems); default: "
        "$ACCEL_USAGE_DIR/usage-<host>.sqlite, else $XDG_STATE_HOME/lightning_accel/ (~/.local/state/...)",
    )
    parser.add_argument(
        "--no-usage", action="store_true", help="record no usage (`--once` and `--json` never record it)"
    )
    parser.add_argument(
        "--notify",
        type=Path,
        default=None,
        help="a routing file (YAML: `default:` and `users:` -> {url, format: slack|json, mention}): while the page is "
        "served, idle-held cards, stale and failed jobs and card-health events are posted there, once per episode "
        "(examples/monitoring/README.md)",
    )
    parser.add_argument(
        "--notify-grace",
        type=seconds,
        default=DEFAULT_GRACE_S,
        help=f"an alert is posted once it has lasted this long (default {DEFAULT_GRACE_S:.0f} s; health events and "
        "failed jobs at once)",
    )
    parser.add_argument(
        "--notify-repeat",
        type=seconds,
        default=DEFAULT_REPEAT_S,
        help=f"and again every this long while it lasts (default {DEFAULT_REPEAT_S:.0f} s)",
    )
    parser.add_argument(
        "--snooze-file",
        type=Path,
        default=None,
        help="the snooze file read before each post, as `accel-dash snooze --file` writes it (default: "
        "`$ACCEL_USAGE_DIR/snooze.json`, else `$XDG_STATE_HOME/lightning_accel/snooze.json`: give it where the "
        "page runs as another user or service)",
    )
    return parser


def build_usage_parser() -> argparse.ArgumentParser:
    """`accel-dash usage`: the usage kept, read from one or more machines' databases (read-only)."""
    parser = argparse.ArgumentParser(
        prog="accel-dash usage",
        description="The usage kept per UTC day, host, user, job and GPU (GPU-hours held, of which idle-held, kWh, "
        "samples, optimizer steps), read-only from one or more machines' usage databases: as CSV (--csv), or totals "
        "per user, job or host (--by). A database that is locked or corrupt is left out with a warning.",
    )
    parser.add_argument(
        "--csv",
        action="store_true",
        help=f"print every row as CSV to stdout, columns {','.join(CSV_COLUMNS)} (default: a table of totals)",
    )
    parser.add_argument(
        "--since",
        type=_utc_day,
        default=None,
        metavar="DATE",
        help="the first UTC day, YYYY-MM-DD (default: the first day kept)",
    )
    parser.add_argument(
        "--until",
        type=_utc_day,
        default=None,
        metavar="DATE",
        help="the last UTC day, included (default: the last day kept)",
    )
    parser.add_argument(
        "--db",
        type=Path,
        action="append",
        default=None,
        metavar="PATH",
        help="a usage database, or a directory of usage-<host>.sqlite files (one per machine, copied there with "
        "sqlite3 FILE '.backup COPY'); repeat for more (default: $ACCEL_USAGE_DIR, else "
        "$XDG_STATE_HOME/lightning_accel, i.e. ~/.local/state/lightning_accel)",
    )
    parser.add_argument(
        "--by", choices=("user", "job", "host"), default="user", help="the totals' rows, without --csv (default user)"
    )
    return parser


def _usage_main(argv: Sequence[str]) -> int:
    parser = build_usage_parser()
    args = parser.parse_args(argv)
    if args.since and args.until and args.since > args.until:
        parser.error(
            f"`--since {args.since}` is after `--until {args.until}`; pass a --since on or before --until "
            "(both days are included)."
        )
    for source in args.db or []:
        if not source.exists():
            parser.error(
                f"`--db {source}` does not exist; pass a usage database or a directory of usage-<host>.sqlite files."
            )
    sources = args.db or [default_usage_dir()]
    if not usage_databases(sources):
        where = ", ".join(str(source) for source in sources)
        print(f"accel-dash usage: no usage database in {where}", file=sys.stderr)
    reader = UsageReader(sources)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.csv:
            write_csv(reader.rows(args.since, args.until), sys.stdout)
        else:
            print(_totals_table(reader, args.by, args.since, args.until), end="")
    for warning in caught:
        print(f"accel-dash usage: warning: {warning.message}", file=sys.stderr)
    return 0


def _totals_table(
    reader: UsageReader, by: Literal["user", "job", "host"], since: date | None, until: date | None
) -> str:
    """The totals per user, job or host as aligned text columns, most GPU-hours held first."""
    heads = {"user": ["user"], "job": ["user", "job"], "host": ["host"]}[by]
    lines = [[*heads, "hosts", "GPU-h held", "idle-held", "kWh", "samples", "steps"]]
    for total in reader.totals(by, since, until):
        numbers = [f"{total.held_s / 3600:,.2f}", f"{total.idle_held_s / 3600:,.2f}", f"{total.energy_j / 3.6e6:,.2f}"]
        lines.append([*total.key, ",".join(sorted(total.hosts)), *numbers, f"{total.samples:,}", f"{total.steps:,}"])
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    text = len(heads) + 1
    return "".join(
        "  ".join(
            cell.ljust(w) if i < text else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        + "\n"
        for line in lines
    )


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port.

    Raises:
        OSError: taken, or not an address of this machine.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart right after a stop finds it free
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(args: argparse.Namespace, state: DashState) -> int:
    try:
        import starlette  # noqa: F401 - the app's framework, imported by make_app
        import uvicorn

        from lightning_accel.dash.server import LOOPBACK, make_app
    except ImportError as err:
        print(
            f"accel-dash: error: the web page needs Starlette and uvicorn ({err.name} is missing); install them with "
            "pip install 'lightning_accel[dash]'. `--once` and `--json` work without them.",
            file=sys.stderr,
        )
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            print(
                f"accel-dash: error: port {args.port} on {args.host} is taken (another accel-dash, or another "
                f"server); pass another `--port`, e.g. `--port {args.port + 1}`, or `--port 0` for a free one.",
                file=sys.stderr,
            )
        else:
            print(
                f"accel-dash: error: cannot serve on `--host {args.host}` `--port {args.port}` "
                f"({err.strerror or err}); pass an address of this machine, e.g. `--host 127.0.0.1`.",
                file=sys.stderr,
            )
        return 2
    loopback = args.host in LOOPBACK
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    if not loopback:
        print(
            f"accel-dash: serving on {args.host}, not only this machine: anyone who reaches port {port} reads "
            "every job's host, user, pid, command line, run name and progress, and this host's GPU processes and "
            "their users (read-only, no login). Use --host 127.0.0.1 and an SSH tunnel to keep it private.",
            file=sys.stderr,
        )
    print(f"accel-dash: http://{shown}:{port}/ reading {state.runs_dir} (Ctrl-C stops)", flush=True)
    config = uvicorn.Config(make_app(state, loopback=loopback), log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    # the usage and the alerts must not wait for a browser: the page is built every 2 s whoever looks
    stop_watch = state.watch(WATCH_INTERVAL_S) if state.usage is not None or state.notifier is not None else None
    try:
        server.run(sockets=[sock])
    finally:
        if stop_watch is not None:
            stop_watch()
    # uvicorn takes SIGINT itself and shuts down; some releases re-raise it afterwards, others return (exit 0 when
    # the signal came while the server started): a Ctrl-C it caught is told as one (exit 130) either way.
    if signal.SIGINT in getattr(server, "_captured_signals", ()):
        raise KeyboardInterrupt
    return 0


def _runs_dir_problem(runs_dir: Path, given_by: str | None) -> str | None:
    """Why accel-dash cannot read `runs_dir`, named with the option it came from (`given_by`; None: the default,
    which may not exist before the first job publishes), or None."""
    source = f" ({given_by})" if given_by else ""
    fix = "pass the directory the jobs publish into (their `callbacks.gpu_monitor.runs_dir` or `$ACCEL_RUNS_DIR`)"
    try:
        entries = os.scandir(runs_dir)
    except FileNotFoundError:
        if given_by is None:
            return None  # nothing published yet: the page says so, and shows the jobs once they start
        return f"the runs directory {runs_dir}{source} does not exist; {fix}"
    except NotADirectoryError:
        return f"the runs directory {runs_dir}{source} is not a directory; {fix}"
    except OSError as err:
        return (
            f"the runs directory {runs_dir}{source} cannot be read ({err.strerror or err}); {fix}, or one you can read"
        )
    entries.close()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `accel-dash` (also `python -m lightning_accel.dash`; `accel-dash usage ...`: the usage
    kept); returns the exit code: 0, 2 for a bad option, 130 for Ctrl-C (said in one line, without a traceback)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("accel-dash: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["usage"]:
        return _usage_main(argv[1:])
    if argv[:1] == ["snooze"]:
        return snooze_main(argv[1:])
    if argv[:1] == ["agent"]:
        return agent_main(argv[1:])
    args = build_parser().parse_args(argv)
    runs_dir = (args.runs_dir or default_runs_dir()).expanduser()
    given_by = "`--runs-dir`" if args.runs_dir else "`$ACCEL_RUNS_DIR`" if os.environ.get("ACCEL_RUNS_DIR") else None
    problem = _runs_dir_problem(runs_dir, given_by)
    if problem is not None:
        print(f"accel-dash: error: {problem}.", file=sys.stderr)
        return 2
    cards = None
    if not args.no_host_gpus:
        from lightning_accel.telemetry.host_gpus import HostGPUs

        cards = HostGPUs()
    state = DashState(
        runs_dir,
        host_cards=cards.read if cards else None,
        host_cards_problem=(lambda: cards.problem) if cards else None,
        stale_after_s=args.stale_after,
        keep_s=args.keep,
        idle=IdleHeldTracker(args.idle_pct, args.idle_after),
    )
    store = None
    if not (args.json or args.once or args.no_usage):
        from lightning_accel.dash.usage_feed import UsageFeed
        from lightning_accel.dash.usage_store import UsageStore

        store = UsageStore(args.usage_db.expanduser() if args.usage_db else default_usage_path(state.host))
        state.usage = UsageFeed(store, state.host)
    if args.notify is not None and not (args.json or args.once):
        try:
            routes = load_routes(args.notify.expanduser())
        except ConfigError as err:
            print(f"accel-dash: error: `--notify`: {err}", file=sys.stderr)
            return 2
        state.notifier = Notifier(
            routes,
            grace_s=args.notify_grace,
            repeat_s=args.notify_repeat,
            snooze_file=(args.snooze_file or snooze_file()).expanduser(),
        )
    try:
        if args.json:
            print(json.dumps(page_dict(state.build()), indent=1))
            return 0
        if args.once:
            print(text_report(state.build()), end="")
            return 0
        return _serve(args, state)
    finally:
        if cards is not None:
            cards.close()
        if store is not None:
            store.close()


if __name__ == "__main__":
    sys.exit(main())
