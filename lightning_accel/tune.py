"""accel-tune: the fastest configuration of your run that keeps quality, found by experiment, written as a preset."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_accel.errors import ConfigError, describe_os_error

if TYPE_CHECKING:
    from lightning_accel.autotune.search import Space

__all__ = ["build_parser", "detect_space", "main", "print_space"]


def build_parser() -> argparse.ArgumentParser:
    """The command line of `accel-tune`; argparse exits 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="accel-tune",
        description="Search the configuration of an accel-train run (precision, torch.compile, DataLoader workers, "
        "micro-batch, DDP, model parallel, pipeline, checkpointing, accumulation) for the fastest one that keeps "
        "quality. From the baseline, each incumbent's measured bottleneck picks the next moves; candidates are "
        "measured beside the baseline with accel-bench's rounds, intervals and interference checks, and win only "
        "when they pass the quality gate and their throughput interval clears the incumbent's. The pick is "
        "confirmed by a longer run and written as <config-dir>/preset/tuned_<name>.yaml, with tune.md, tune.json "
        "and tune.png in --out. Exit code: 0 with a pick, 1 when even the baseline failed or a file could not be "
        "written (named: the file, the errno in words), 2 for a usage error (an --out or --config-dir that cannot be "
        "written is refused before the search), 130 after Ctrl-C (the best so far is written).",
        epilog="Trailing Hydra overrides are the run to tune: accel-tune --time-budget 600 model=classifier",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides of the run to tune")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds for the whole search, the confirmation included: a generation starts only "
        "when it and the confirmation, estimated from the runs so far, end inside it; the baseline's "
        "runs always happen (default 600)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="optimizer steps of the baseline's runs; every candidate trains the same samples "
        "(default 40, --profile gpu 64)",
    )
    parser.add_argument("--repeats", type=int, default=2, metavar="N", help="rounds per generation (default 2)")
    parser.add_argument(
        "--per-generation", type=int, default=2, metavar="N", help="new candidates measured per generation (default 2)"
    )
    parser.add_argument(
        "--confirm-steps",
        type=int,
        default=None,
        metavar="N",
        help="steps of the confirmation run of the pick (default 3 x --steps; 0: none)",
    )
    parser.add_argument("--metric", default="val/loss", help="the quality metric (default val/loss)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="a candidate's metric may be this much (relative) worse than the baseline's (default 0.02)",
    )
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=Path("conf"),
        help="where the preset goes: <dir>/preset/tuned_<name>.yaml (default ./conf)",
    )
    parser.add_argument("--name", default=None, help="the preset's name (default: the model config's target)")
    parser.add_argument("--out", type=Path, default=None, help="the run directory (default outputs/tune/<time>)")
    parser.add_argument(
        "--profile",
        choices=("quick", "gpu"),
        default=None,
        help="size the runs as accel-bench's --profile does: quick, the smaller GPT example on a CPU; "
        "gpu, model=gpt2_small (unless you select a model) on one CUDA GPU, 10 warm-up batches",
    )
    parser.add_argument("--quick", action="store_const", const="quick", dest="profile", help="`--profile quick`")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the run and print what this machine and model allow and the moves the search may "
        "try, then exit: nothing trains and nothing is written",
    )
    parser.add_argument(
        "--stage-timeout",
        type=float,
        default=None,
        metavar="S",
        help="a run that takes longer is ended and counts as failed (default 300, --profile gpu 420)",
    )
    return parser


def detect_space(overrides: Sequence[str], run_dir: Path) -> tuple[Space, str]:
    """What this machine and the user's model allow (`search.Space`), and the model's name for the preset."""
    from omegaconf import OmegaConf

    from lightning_accel.autotune.search import Space
    from lightning_accel.benchmark.stage_config import compose_user_config
    from lightning_accel.checks import check_run
    from lightning_accel.precision import resolve_precision
    from lightning_accel.system.software import compile_problem
    from lightning_accel.tuning.dataloader.loader_settings import LOADER_KEYS

    cfg = compose_user_config(list(overrides), str(run_dir / "check"))
    shape = check_run(cfg).shape  # the shape, with the precision this machine resolves checked too
    devices = shape.visible_cuda if shape.on_cuda else min(2, shape.cpus)
    accelerator = "cuda" if shape.on_cuda else "cpu"
    bf16 = resolve_precision("amp", accelerator).value.startswith("bf16")
    blocks = bool(OmegaConf.select(cfg, "parallel_plan.block_classes"))
    global_batch = OmegaConf.select(cfg, "callbacks.accumulation.global_batch_size")
    data = cfg.get("data")
    loader_keys = frozenset(k for k in LOADER_KEYS if data is not None and k in data)
    space = Space(
        devices=max(1, int(devices or 1)),
        on_cuda=shape.on_cuda,
        bf16=bf16,
        compile=compile_problem(on_cuda=shape.on_cuda) is None,
        block_classes=blocks,
        global_batch=global_batch if isinstance(global_batch, int) else None,
        loader_keys=loader_keys,
        thread_plan=OmegaConf.select(cfg, "threads.mode", default="auto") != "torch",
    )
    name = str(cfg.model.get("_target_", "model")).rsplit(".", 1)[-1]
    return space, "".join(ch if ch.isalnum() else "_" for ch in name).lower()


def print_space(space: Space, name: str, config_dir: Path) -> None:
    """`--dry-run`: what this machine and model allow, every move and whether the search may try it, and where the
    preset would go."""
    from lightning_accel.autotune.search import moves_here

    print(f"accel-tune --dry-run: nothing ran. The space here: {space}")
    for move, applies in moves_here(space):
        sets = ", ".join(f"{k}={v.format(devices=space.devices)}" for k, v in move.sets)
        bound = ", ".join(a for a in move.addresses if a) + (
            " (or an unknown bottleneck)" if "" in move.addresses else ""
        )
        print(
            f"  {'may try' if applies else 'not here':9} {move.name} ({sets}) for {bound}"
            + ("" if applies else f"; needs {', '.join(move.needs) or 'a different start'}")
        )
    print(f"The pick would be written as {config_dir / 'preset' / f'tuned_{name}.yaml'}.")


def _check_writable(flag: str, path: Path, problem: OSError | None, fix: str = "pass a writable directory") -> None:
    """Refuse, before the search, a `--out` or `--config-dir` the result could not be written to: a search that
    could not write its result would be lost.

    Raises:
        ConfigError: naming the flag, the path and what the OS said.
    """
    if problem is not None:
        raise ConfigError(f"`{flag}={path}` cannot be written: {problem}; {fix}.")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `accel-tune` (also `python -m lightning_accel.tune`); returns the exit code."""
    from lightning_accel.autotune.autopilot import TuneSettings, tune
    from lightning_accel.autotune.preset_file import check_preset_name, preset_write_error
    from lightning_accel.bench import check_profile
    from lightning_accel.benchmark import BenchSettings
    from lightning_accel.benchmark.process import terminate_as_interrupt
    from lightning_accel.benchmark.stage_plan import PROFILES, profile_overrides
    from lightning_accel.files import directory_write_error
    from lightning_accel.launch import log_root, unique_stamp

    started = time.monotonic()
    args = build_parser().parse_args(argv)
    profile = PROFILES.get(args.profile or "")
    steps = args.steps if args.steps is not None else (profile.steps if profile else 40)
    timeout = args.stage_timeout if args.stage_timeout is not None else (profile.stage_timeout_s if profile else 300.0)
    try:
        check_profile(args.profile)
        if not 0 < timeout < math.inf:
            raise ConfigError(f"`--stage-timeout={timeout}` must be a finite number of seconds > 0.")
        for flag, value in (("--steps", steps), ("--repeats", args.repeats), ("--per-generation", args.per_generation)):
            if value < 1:
                raise ConfigError(f"`{flag}={value}` must be >= 1.")
        if not 0 < args.time_budget < math.inf:  # nan would never end the search
            raise ConfigError(f"`--time-budget={args.time_budget}` must be a finite number of seconds > 0.")
        if not 0 <= args.tolerance < 1:  # nan would switch the quality gate off
            raise ConfigError(f"`--tolerance={args.tolerance}` must be a fraction within [0, 1), e.g. 0.02 for 2%.")
        if args.confirm_steps is not None and args.confirm_steps < 0:
            raise ConfigError(f"`--confirm-steps={args.confirm_steps}` must be >= 0 (0: no confirmation run).")
        if args.name is not None:
            check_preset_name(args.name)  # before the search, not when its preset is written
        stamp = unique_stamp(dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
        out = (args.out or Path(log_root()) / "tune" / stamp).resolve()
        if args.dry_run:
            import tempfile

            with tempfile.TemporaryDirectory() as scratch:
                space, model_name = detect_space(
                    [*profile_overrides(args.profile, args.overrides), *args.overrides], Path(scratch)
                )
            print_space(space, args.name or model_name, args.config_dir)
            return 0
        _check_writable("--out", out, directory_write_error(out))
        _check_writable("--config-dir", args.config_dir, directory_write_error(args.config_dir / "preset"))
        out.mkdir(parents=True, exist_ok=True)
        space, model_name = detect_space([*profile_overrides(args.profile, args.overrides), *args.overrides], out)
        _check_writable(
            "--config-dir",
            args.config_dir,
            preset_write_error(args.config_dir, args.name or model_name),
            "move what is in the preset's place, or pass another `--config-dir` or `--name`",
        )
        # the same samples for every candidate (a DDP or accumulation candidate runs fewer steps): the quality gate
        # compares runs over the same data, and samples/s is the throughput
        bench = BenchSettings(
            steps=steps,
            match="samples",
            repeats=args.repeats,
            metric=args.metric,
            tolerance=args.tolerance,
            profile=args.profile,
            val_checks=2,
            stage_timeout_s=timeout,
        )
        settings = TuneSettings(
            time_budget_s=args.time_budget,
            per_generation=args.per_generation,
            bench=bench,
            confirm_steps=args.confirm_steps,
            config_dir=args.config_dir.resolve(),
            name=args.name or model_name,
        )
        with terminate_as_interrupt() as received:  # SIGTERM as Ctrl-C: the best so far is written
            result = tune(args.overrides, space, settings, out, started=started)
    except ConfigError as err:
        print(f"accel-tune: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a disk that filled during the search: named, no traceback
        print(f"accel-tune: error: {describe_os_error(err)}", file=sys.stderr)
        return 1
    if result.interrupted:
        return 128 + received[0] if received else 130
    return 0 if result.pick is not None else 1


if __name__ == "__main__":
    sys.exit(main())
