"""accel-bench: the article's staged speedup table, measured on your model and machine, with the quality it kept."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_accel.errors import ConfigError, describe_os_error

if TYPE_CHECKING:
    from lightning_accel.benchmark.stage_plan import BenchSettings

__all__ = ["build_parser", "check_profile", "main", "print_plan"]


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} > 0, got {text!r}") from None
        if not value > 0 or value == float("inf"):  # nan and inf too: a budget or a peak that never means anything
            raise argparse.ArgumentTypeError(f"expected a finite {kind.__name__} > 0, got {value}")
        return value

    return parse


def _ladder(text: str) -> list[str]:
    """`--ladder A,B,...`: the stages in order, each named once (a stage twice would be run and reported twice)."""
    stages = [stage.strip() for stage in text.split(",") if stage.strip()]
    if not stages:
        raise argparse.ArgumentTypeError(f"{text!r} names no stage; e.g. `--ladder baseline,amp`")
    repeated = sorted({stage for stage in stages if stages.count(stage) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{text!r} names {', '.join(repeated)} more than once; name each stage once (rounds: `--repeats N`)"
        )
    return stages


def build_parser() -> argparse.ArgumentParser:
    """The command line of `accel-bench`; argparse exits 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="accel-bench",
        description="Run a ladder of presets (default baseline -> amp -> ddp -> model parallel) on a model and data "
        "config, each stage in a fresh accel-train process with the same seed and budget, and print the staged "
        "speedup table with throughput, time to target, peak memory, energy, MFU, GPU utilisation, the validation "
        "metric, a quality verdict and a bottleneck verdict per stage. Stages run round by round (--repeats), each "
        "run under an interference check; every figure is a median with its interval, a speedup whose interval "
        "holds 1.0 reads 'no clear difference', and a stage measured while other processes took the CPUs is "
        "flagged. Writes bench.md, bench.csv, bench.json and "
        "bench.png into --out. Exit code: 0 when every stage that ran kept quality, 1 when one failed quality "
        "or crashed or a file could not be written (named: the file, the errno in words), 2 for a usage error (an "
        "--out that cannot be written is refused before any stage), 130 after Ctrl-C (the outputs then hold the runs "
        "that finished).",
        epilog="Trailing Hydra overrides apply to every stage: accel-bench --quick model=classifier "
        "trainer.accelerator=cpu",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="Hydra overrides for every stage (model=..., data=..., trainer.x=...)",
    )
    parser.add_argument(
        "--profile",
        choices=("quick", "gpu"),
        default=None,
        help="size every stage for a kind of machine. quick: a few minutes on a CPU, 40 optimizer steps per stage "
        "(`--match steps`), 2 rounds, 2 validations, a smaller GPT example. gpu: one CUDA GPU in a few minutes, "
        "`model=gpt2_small` (unless you select a model), 64 baseline steps with every stage on the same samples, 2 "
        "rounds, 10 warm-up batches (a compiled stage's compilation stays out of its rates), one batch in ten "
        "synchronised for the split, the ladder baseline,amp,amp_compile,ddp,model_parallel (the last two: 2+ GPUs)",
    )
    parser.add_argument("--quick", action="store_const", const="quick", dest="profile", help="`--profile quick`")
    parser.add_argument(
        "--repeats",
        type=_positive(int),
        default=None,
        metavar="N",
        help="rounds: every stage runs once per round, round by round, from seed + round; figures are medians with "
        "an interval (min-max up to 5 runs, a 95%% bootstrap from 6) (default 3, a --profile 2; a --profile needs 2 "
        "or more)",
    )
    parser.add_argument(
        "--max-reruns",
        type=int,
        default=2,
        metavar="N",
        help="runs measured under interference are run again, at most N times per stage (default 2; 0: never)",
    )
    parser.add_argument(
        "--interference-threshold",
        type=float,
        default=0.10,
        metavar="FRACTION",
        help="flag a run when other processes took more than this share of the CPUs it may use (default 0.10)",
    )
    parser.add_argument(
        "--ladder",
        type=_ladder,
        default=None,
        metavar="A,B,...",
        help="comma-separated presets (or built-in stages) to run in order; default: baseline,amp,"
        "ddp and the best model-parallel preset available (built-in `model_parallel`: ddp + "
        "strategy=model_parallel + accumulation=fixed + scheduler=onecycle)",
    )
    parser.add_argument(
        "--steps",
        type=_positive(int),
        default=None,
        metavar="N",
        help="optimizer steps of the first stage (default 300, --profile quick 40, --profile gpu 64)",
    )
    parser.add_argument(
        "--match",
        choices=("samples", "steps"),
        default=None,
        help="samples (default): every stage trains on as many samples as the first stage's N steps, "
        "so a DDP stage with 2x the global batch runs N/2 steps, and the speedup is the time ratio; steps (--quick's "
        "default): every stage runs N optimizer steps, and the speedup is the ratio of samples/s",
    )
    parser.add_argument(
        "--time-budget",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="train each stage this long instead of a step count (Lightning's max_time)",
    )
    parser.add_argument("--metric", default="val/loss", help="validation metric for quality (default val/loss)")
    parser.add_argument(
        "--mode",
        choices=("min", "max"),
        default=None,
        help="min: lower is better; max: higher is better (default: from the metric's name)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="VALUE",
        help="the metric value to reach: the table shows each stage's time to it",
    )
    parser.add_argument("--until-target", action="store_true", help="stop each stage when it reaches --target")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        metavar="FRACTION",
        help="a stage whose metric is worse than the baseline's by more than this fraction, and by more than the "
        "baseline's own seed-to-seed spread, fails quality (default 0.02 = 2%%)",
    )
    parser.add_argument(
        "--val-checks",
        type=_positive(int),
        default=None,
        metavar="N",
        help="validation passes per stage (default 4, a --profile 2)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=_positive(float),
        default=None,
        metavar="TFLOPS",
        help="peak dense TFLOP/s of one device for MFU, overriding the table (needed on CPUs)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of every stage (default: the config's seed)")
    parser.add_argument(
        "--stage-timeout",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="a stage running longer is stopped and shown as failed (default none, --profile quick 300, gpu 420)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="run directory (default $ACCEL_LOG_DIR or outputs, then bench/<time>); one that holds files is refused "
        "unless --overwrite",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="compose and check every stage, print what each would run (or why it is skipped), and exit: nothing "
        "trains and nothing is written",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out (its earlier results are replaced, never read)",
    )
    return parser


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.tolerance < 1:
        raise ConfigError(f"`--tolerance={args.tolerance}` must be a fraction within [0, 1), e.g. 0.02 for 2%.")
    if args.profile and args.repeats is not None and args.repeats < 2:
        raise ConfigError(
            f"`--repeats={args.repeats}` with `--profile {args.profile}`: a profile's table needs 2 "
            f"rounds or more for an interval; pass `--repeats 2` or drop `--profile`."
        )
    if args.max_reruns < 0:
        raise ConfigError(f"`--max-reruns={args.max_reruns}` must be >= 0 (0: never run a flagged stage again).")
    if not 0 < args.interference_threshold < 1:
        raise ConfigError(
            f"`--interference-threshold={args.interference_threshold}` must be a fraction within (0, 1), "
            "e.g. 0.10 for 10% of the CPUs."
        )
    if args.target is not None and not math.isfinite(args.target):
        raise ConfigError(f"`--target={args.target}` must be a finite value of the metric, e.g. `--target 2.2`.")
    if args.until_target and args.target is None:
        raise ConfigError("`--until-target` needs `--target VALUE`, the metric value to stop at.")
    if args.time_budget is not None and args.steps is not None:
        raise ConfigError("`--time-budget` and `--steps` both set the budget; pass one of them.")
    if not re.fullmatch(r"[\w./\-]+", args.metric):
        raise ConfigError(
            f"`--metric={args.metric!r}` must be one metric key as logged, e.g. `val/loss` (no commas "
            "or spaces); the table follows one metric."
        )
    if not args.metric.startswith("val"):
        raise ConfigError(f"`--metric={args.metric}` should be a validation metric (`val/...`), e.g. `val/loss`.")
    for override in args.overrides:
        if "=" not in override:
            raise ConfigError(f"`{override}` is not a Hydra override; write KEY=VALUE (e.g. `model=classifier`).")
        if override.split("=", 1)[0].lstrip("+~") in ("preset", "hydra.run.dir", "trainer.max_steps"):
            raise ConfigError(
                f"`{override}` is set by accel-bench for each stage; use `--ladder`, `--out` or `--steps` instead."
            )


def check_profile(profile: str | None, flag: str = "--profile") -> None:
    """A profile that needs a CUDA GPU is refused on a machine without one, before anything runs.

    Raises:
        ConfigError: naming the profile, what torch sees, and the fix.
    """
    from lightning_accel.benchmark.stage_plan import PROFILES

    chosen = PROFILES.get(profile or "")
    if chosen is None or not chosen.needs_cuda:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"`{flag} {profile}` needs a CUDA GPU, and torch sees none here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); use `{flag} quick` on a CPU."
        )


def _check_writable(out: Path) -> None:
    """`--out` can be created and written, before any stage runs.

    Raises:
        ConfigError: naming `--out`, the path in the way and what the OS said.
    """
    from lightning_accel.files import directory_write_error

    problem = directory_write_error(out)
    if problem is not None:
        raise ConfigError(f"`--out={out}` cannot be written: {problem}; pass a writable directory.")


def print_plan(ladder: Sequence[str], overrides: Sequence[str], settings: BenchSettings, out: Path) -> None:
    """`--dry-run`: every stage composed and checked, as a table: what it changes, its processes and steps, or why
    it would be skipped.

    Raises:
        ConfigError: for an unknown stage or overrides that do not compose, as a real run would.
    """
    from rich.console import Console
    from rich.table import Table

    from lightning_accel.benchmark.stage_plan import describe_changes, plan_stages

    plans, seed = plan_stages(ladder, overrides, settings, out)
    changes = describe_changes(plans)
    table = Table(title=f"accel-bench --dry-run: {len(plans)} stage(s), first seed {seed}; nothing ran")
    for column in ("stage", "status", "what it changes", "processes", "optimizer steps", "reason"):
        table.add_column(column)
    for plan in plans:
        table.add_row(
            plan.name,
            plan.status,
            changes[plan.name],
            str(plan.world_size),
            "-" if plan.steps is None else str(plan.steps),
            plan.reason,
        )
    Console(width=160).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `accel-bench` (also `python -m lightning_accel.bench`); returns the exit code."""
    from lightning_accel.benchmark import BenchSettings, default_ladder, higher_is_better, run_bench
    from lightning_accel.benchmark.process import terminate_as_interrupt
    from lightning_accel.benchmark.stage_plan import PROFILES
    from lightning_accel.launch import log_root, unique_stamp

    parser = build_parser()
    args = parser.parse_args(argv)
    profile = PROFILES.get(args.profile or "")
    try:
        _check(args)
        check_profile(args.profile)
        ladder = args.ladder
        if ladder is None:
            ladder = list(profile.ladder) if profile and profile.ladder else default_ladder()
        settings = BenchSettings(
            steps=args.steps or (profile.steps if profile else 300),
            match=args.match or (profile.match if profile else "samples"),
            time_budget_s=args.time_budget,
            metric=args.metric,
            mode=args.mode or ("max" if higher_is_better(args.metric) else "min"),
            target=args.target,
            until_target=args.until_target,
            tolerance=args.tolerance,
            val_checks=args.val_checks or (profile.val_checks if profile else 4),
            seed=args.seed,
            profile=args.profile,
            stage_timeout_s=args.stage_timeout or (profile.stage_timeout_s if profile else None),
            repeats=args.repeats or (profile.repeats if profile else 3),
            max_reruns=args.max_reruns,
            interference_threshold=args.interference_threshold,
        )
        stamp = unique_stamp(dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        out = args.out or Path(log_root()) / "bench" / stamp
        if args.dry_run:
            print_plan(ladder, args.overrides, settings, out.resolve())
            return 0
        _check_writable(out)
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            raise ConfigError(
                f"`--out={out}` already holds files (an earlier bench?); pass another `--out`, or "
                "`--overwrite` to replace them."
            )
        with terminate_as_interrupt() as received:  # SIGTERM as Ctrl-C: the stage ended, the finished runs written
            run = run_bench(
                ladder,
                args.overrides,
                settings,
                out.resolve(),
                peak_tflops=args.peak_tflops,
                argv=sys.argv if argv is None else ["accel-bench", *argv],
            )
    except ConfigError as err:
        print(f"accel-bench: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a disk that filled between stages: named, no traceback
        print(f"accel-bench: error: {describe_os_error(err)}", file=sys.stderr)
        return 1
    if run.interrupted:
        return 128 + received[0] if received else 130
    bad = [r for r in run.results if r.status == "failed" or r.quality == "FAIL"]
    return 1 if bad or run.write_error else 0


if __name__ == "__main__":
    sys.exit(main())
