"""accel-tune's loop: measure the baseline, let each incumbent's bottleneck pick the next candidates, measure them
beside the baseline and the incumbent with accel-bench's method, keep a winner only when it passes quality and
clears the incumbent's interval, confirm the final pick with a longer run, and write it as a preset.

Every generation is one `run_bench` over a ladder of candidate presets written into the run directory (`baseline`
first: speedups and quality verdicts are against it), so each candidate runs in its own `accel-train` process
session with a timeout, round by round, under the interference probe. A failed candidate is recorded and the search
goes on; Ctrl-C stops it and the best result so far is still written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_accel.autotune.preset_file import pinned, preset_yaml, settled_of, write_preset
from lightning_accel.autotune.search import Candidate, Outcome, Space, baseline, clears, incumbent, next_candidates
from lightning_accel.benchmark.process import Launcher, launch
from lightning_accel.benchmark.results import StageResult
from lightning_accel.benchmark.run import run_bench
from lightning_accel.benchmark.stage_plan import BenchSettings
from lightning_accel.files import atomic_path, atomic_write

__all__ = ["TuneResult", "TuneSettings", "outcome_of", "tune"]


@dataclass(kw_only=True)
class TuneSettings:
    """How accel-tune searches (its command line)."""

    time_budget_s: float = 600.0
    """Wall-clock budget of the search, the confirmation run included: a generation starts only when it and the
    confirmation, estimated from the seconds per run so far, end inside it (the baseline's generation always runs)."""
    per_generation: int = 2
    """New candidates measured per generation."""
    bench: BenchSettings = field(default_factory=lambda: BenchSettings(steps=40, repeats=2, match="samples"))
    """How each generation measures (the baseline's steps, rounds, metric, tolerance); `match="samples"`: every
    candidate trains the same samples, so the quality gate compares runs over the same data."""
    confirm_steps: int | None = None
    """Steps of the confirmation run of the final pick against the baseline; None: 3x `bench.steps`; 0: none."""
    config_dir: Path = Path("conf")
    """Where the preset goes: `<config_dir>/preset/tuned_<name>.yaml`."""
    name: str = "model"


@dataclass(kw_only=True)
class TuneResult:
    """The search's outcome: every candidate measured, the pick, and what was written."""

    history: list[Outcome]
    pick: Outcome | None
    confirmed: bool | None
    """Whether the confirmation run upheld the pick (None: not run)."""
    preset: Path | None
    files: list[Path]
    generations: int
    interrupted: bool
    stop_reason: str
    trace: list[dict[str, Any]] = field(default_factory=list)


def outcome_of(candidate: Candidate, result: StageResult) -> Outcome:
    """A candidate's outcome from its accel-bench row (the baseline, the reference, passes quality by definition)."""
    if result.status != "ok":
        return Outcome(candidate, status="failed", reason=result.reason or result.status)
    interval = result.samples_interval or {}
    quality = result.quality if result.quality in ("pass", "FAIL") else ("pass" if not candidate.choices else "n/a")
    settled = settled_of(result.loader, result.micro_batch, result.micro_batch_auto, candidate.choices)
    return Outcome(
        candidate,
        samples_per_s=result.samples_per_s,
        low=interval.get("low"),
        high=interval.get("high"),
        bottleneck=result.bottleneck or "",
        quality=quality,
        reason=result.bottleneck_why,
        interference=result.interference,
        settled=settled,
    )


def _stage_name(candidate: Candidate, index: int) -> str:
    """The stage's preset name: `as_is` for the baseline (the user's config unchanged, not the packaged `baseline`
    preset, which would set fp32, one device and no workers), `cand<i>` for the others."""
    return "as_is" if not candidate.choices else f"cand{index}"


def _measure(
    ladder: list[Candidate],
    overrides: Sequence[str],
    bench: BenchSettings,
    out_dir: Path,
    launcher: Launcher,
    echo: Callable[[str], None],
) -> tuple[dict[Candidate, Outcome], bool, Path, float | None]:
    """One accel-bench run over `ladder` (presets written under `out_dir/conf`): the outcomes by candidate, whether
    it was interrupted, its table, and the share of a run's process time that training took (None: none ran)."""
    conf = out_dir / "conf"
    names = []
    for index, candidate in enumerate(ladder):
        name = _stage_name(candidate, index)
        (conf / "preset").mkdir(parents=True, exist_ok=True)  # the stage's name; its choices come after the user's
        (conf / "preset" / f"{name}.yaml").write_text(preset_yaml(Candidate(), [candidate.name]))
        names.append(name)
    search = [f"hydra.searchpath=[file://{conf.resolve()}]"]
    extra = {name: c.overrides() for name, c in zip(names, ladder, strict=True)}
    run = run_bench(names, [*search, *overrides], bench, out_dir, launcher=launcher, echo=echo, stage_extra=extra)
    outcomes = {candidate: outcome_of(candidate, result) for candidate, result in zip(ladder, run.results, strict=True)}
    shares = [r.time_s / r.process_s for r in run.results if r.status == "ok" and r.time_s and r.process_s]
    share = max(shares) if shares else None
    return outcomes, run.interrupted, out_dir / "bench.md", share


def tune(
    overrides: Sequence[str],
    space: Space,
    settings: TuneSettings,
    out_dir: Path,
    *,
    launcher: Launcher = launch,
    echo: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    started: float | None = None,
) -> TuneResult:
    """Search for the fastest configuration of the user's run (`overrides`) that keeps quality, within the budget.

    Raises:
        ConfigError: when the user's overrides do not compose (before anything runs).
    """
    started = clock() if started is None else started  # the command line's start: its config check counts too
    out_dir.mkdir(parents=True, exist_ok=True)
    history: list[Outcome] = []
    trace: list[dict[str, Any]] = []
    generation, interrupted, stop = 0, False, ""
    run_s = 0.0  # the most seconds per run of a generation so far (its wall time over its runs)
    train_share = 1.0  # of a run, the share that training takes (the rest, start-up, does not grow with the steps)
    try:
        while True:
            suggestion = next_candidates(history, space, limit=settings.per_generation)
            if not suggestion.candidates:
                stop = suggestion.why or "nothing left to try"
                break
            best = incumbent(history)
            ladder = [baseline()]
            if best is not None and best.candidate.choices:
                ladder.append(best.candidate)
            ladder += [c for c in suggestion.candidates if c.choices]
            if generation:
                # a winner of this generation would be confirmed beside its parent, the incumbent, and the baseline
                stop = _over_budget(
                    clock() - started,
                    len(ladder),
                    run_s,
                    train_share,
                    settings,
                    confirm_stages=3 if best is not None and best.candidate.choices else 2,
                )
                if stop:
                    break
            echo(
                f"accel-tune: generation {generation}: {suggestion.why}; measuring {', '.join(c.name for c in ladder)}"
            )
            began = clock()
            outcomes, interrupted, table, share = _measure(
                ladder, overrides, settings.bench, out_dir / f"gen{generation}", launcher, echo
            )
            run_s = max(run_s, (clock() - began) / (len(ladder) * settings.bench.repeats))
            train_share = share if share is not None else train_share
            history = _merge(history, outcomes)
            trace.append(
                {
                    "generation": generation,
                    "why": suggestion.why,
                    "table": str(table),
                    "measured": [_describe(o) for o in outcomes.values()],
                    "incumbent": (incumbent(history) or Outcome(baseline())).candidate.name,
                }
            )
            generation += 1
            if interrupted:
                stop = "interrupted (Ctrl-C)"
                break
    except KeyboardInterrupt:
        interrupted, stop = True, "interrupted (Ctrl-C)"
    pick = incumbent(history)
    confirmed, reference = None, _baseline_of(history)
    demoted: dict[Candidate, str] = {}  # the search's pick, when the confirmation did not uphold it: why
    if pick is not None and pick.candidate.choices and not interrupted and settings.confirm_steps != 0:
        searched = pick
        try:
            confirmed, pick, reference, interrupted, lost = _confirm(
                pick, history, overrides, settings, out_dir, launcher, echo, trace
            )
        except KeyboardInterrupt:
            interrupted, lost = True, ""
        if interrupted:  # a confirmation cut short decides nothing: the search's pick stays, unconfirmed
            confirmed, pick, lost, stop = None, searched, "", f"{stop}; the confirmation was interrupted (Ctrl-C)"
            reference = _baseline_of(history)
        if lost:
            demoted[searched.candidate] = lost
    summary = _summary(pick, reference, confirmed) if pick is not None else []
    files = _write_report(history, pick, confirmed, trace, stop, settings, out_dir, clock() - started, summary, demoted)
    preset = None
    if pick is not None:
        chosen, pins = pinned(pick, space.loader_keys)
        comment = [f"accel-tune: {pick.candidate.name}", *summary, *pins]
        preset = write_preset(settings.config_dir, settings.name, chosen, comment=comment)
        files.append(preset)
    echo(
        f"accel-tune: {stop}; pick: {pick.candidate.name if pick else 'none'}" + (f"; wrote {preset}" if preset else "")
    )
    if any(o.interference for o in history):
        echo(
            "accel-tune: note: some candidates were measured under interference (see tune.md); their figures did "
            "not decide: run again when the machine is quiet"
        )
    return TuneResult(
        history=history,
        pick=pick,
        confirmed=confirmed,
        preset=preset,
        files=files,
        generations=generation,
        interrupted=interrupted,
        stop_reason=stop,
        trace=trace,
    )


def _confirm_runs(settings: TuneSettings, train_share: float, stages: int = 2) -> float:
    """The confirmation's cost in baseline-length runs: `stages` stages (the baseline, the pick, its parent when that
    is not the baseline), every round, `confirm_steps` long, where only the training part of a run (`train_share` of
    it) grows with the steps (0 without one)."""
    if settings.confirm_steps == 0:
        return 0.0
    steps = settings.confirm_steps or 3 * settings.bench.steps
    share = min(1.0, max(0.0, train_share))
    return stages * settings.bench.repeats * ((1 - share) + share * steps / settings.bench.steps)


def _over_budget(
    spent: float, stages: int, run_s: float, train_share: float, settings: TuneSettings, confirm_stages: int = 2
) -> str:
    """Why the next generation of `stages` stages must not start (empty when it may): it and the confirmation
    (`confirm_stages` stages), at `run_s` seconds per baseline-length run, would end past the time budget."""
    budget = settings.time_budget_s
    if spent >= budget:
        return f"the time budget of {budget:.0f} s is spent"
    generation_s = stages * settings.bench.repeats * run_s
    confirm_s = _confirm_runs(settings, train_share, confirm_stages) * run_s
    if spent + generation_s + confirm_s > budget:
        return (
            f"the next generation (~{generation_s:.0f} s) and the confirmation (~{confirm_s:.0f} s) would end "
            f"past the time budget of {budget:.0f} s ({budget - spent:.0f} s left)"
        )
    return ""


def _baseline_of(history: Sequence[Outcome], ok: bool = False) -> Outcome | None:
    """The baseline's outcome in `history` (None when it is not there, or with `ok`, when it did not run)."""
    return next((o for o in history if not o.candidate.choices and (o.status == "ok" or not ok)), None)


def _merge(history: list[Outcome], outcomes: dict[Candidate, Outcome]) -> list[Outcome]:
    """The history with this generation's measurements: a candidate measured again (the baseline, the incumbent)
    takes its new figures in place, side by side with the newcomers they are compared with."""
    merged = [outcomes.get(o.candidate, o) for o in history]
    known = {o.candidate for o in history}
    merged += [o for c, o in outcomes.items() if c not in known]
    return merged


def _confirm(
    pick: Outcome,
    history: Sequence[Outcome],
    overrides: Sequence[str],
    settings: TuneSettings,
    out_dir: Path,
    launcher: Launcher,
    echo: Callable[[str], None],
    trace: list[dict[str, Any]],
) -> tuple[bool, Outcome, Outcome, bool, str]:
    """A longer run of the pick beside the baseline and the incumbent it replaced (its parent): it must still pass
    quality and clear the baseline, and clear its parent, else the parent is the pick when it holds up against the
    baseline, else the baseline (never slower than where the user started). A win that was noise in the search's
    shorter runs does not ride on a real one.

    Returns whether a pick other than the baseline was upheld, the pick, the baseline it was measured beside, whether
    Ctrl-C cut it short, and why the search's pick lost (empty when it was upheld)."""
    steps = settings.confirm_steps or 3 * settings.bench.steps
    bench = replace(settings.bench, steps=steps)
    parent = next(
        (o.candidate for o in history if o.candidate.choices and o.candidate.name == pick.candidate.parent), None
    )
    ladder = [baseline(), *([parent] if parent is not None else []), pick.candidate]
    echo(
        f"accel-tune: confirming {pick.candidate.name} against "
        f"{', '.join(c.name for c in ladder[:-1])} over {steps} steps"
    )
    outcomes, interrupted, table, _ = _measure(ladder, overrides, bench, out_dir / "confirm", launcher, echo)
    base, again = outcomes[baseline()], outcomes[pick.candidate]
    before = outcomes.get(parent) if parent is not None else None

    def holds(o: Outcome) -> bool:  # against the baseline; when the baseline does not run (OOM), running is enough
        if base.status != "ok":
            return o.status == "ok"
        return o.status == "ok" and o.quality == "pass" and not o.interference and clears(o, base)

    if holds(again) and (before is None or not holds(before) or clears(again, before)):
        chosen, lost = again, ""
    elif before is not None and holds(before):
        chosen = before
        lost = f"not faster than {before.candidate.name} beyond the noise in the confirmation run"
    else:
        chosen = base
        lost = (
            f"{again.quality} quality in the confirmation run"
            if again.quality == "FAIL"
            else "not faster than the baseline beyond the noise in the confirmation run"
        )
    trace.append(
        {
            "generation": "confirm",
            "table": str(table),
            "measured": [_describe(o) for o in outcomes.values()],
            "upheld": not lost,
            "pick": chosen.candidate.name,
        }
    )
    if lost:
        echo(
            f"accel-tune: the confirmation did not uphold {pick.candidate.name} ({lost}: {_rate(again)}): "
            f"{chosen.candidate.name} is the pick"
        )
    return chosen is not base, chosen, base, interrupted, lost


def _rate(o: Outcome) -> str:
    if o.samples_per_s is None:
        return o.status
    return f"{o.samples_per_s:,.0f} samples/s [{o.low or o.samples_per_s:,.0f}, {o.high or o.samples_per_s:,.0f}]"


def _describe(o: Outcome) -> dict[str, Any]:
    return {
        "candidate": o.candidate.name,
        "overrides": o.candidate.overrides(),
        "parent": o.candidate.parent,
        "move": o.candidate.move,
        **{k: v for k, v in asdict(o).items() if k != "candidate"},
    }


def _summary(pick: Outcome, base: Outcome | None, confirmed: bool | None) -> list[str]:
    """The preset's speedup line: the pick against the baseline measured beside it (in the confirmation, if run)."""
    if not pick.candidate.choices or base is None or base.samples_per_s is None or pick.samples_per_s is None:
        return []  # the baseline itself, or nothing to compare
    where = " in the confirmation run" if confirmed else ""
    return [
        f"{pick.samples_per_s / base.samples_per_s:.2f}x the baseline's samples/s{where} ({_rate(pick)} vs "
        f"{_rate(base)}), quality {pick.quality}"
    ]


def _verdict(o: Outcome, pick: Outcome | None, base: Outcome | None, demoted: dict[Candidate, str]) -> str:
    if o.status != "ok":
        return f"failed: {o.reason}"
    if pick is not None and o.candidate == pick.candidate:
        return "pick"
    if o.candidate in demoted:
        return f"lost: {demoted[o.candidate]}"
    if not o.candidate.choices:
        return "reference"
    if o.quality == "FAIL":
        return "lost: quality"
    if o.interference:
        return "lost: measured under interference (its figures do not decide)"
    if base is not None and clears(base, o):
        return "lost: slower than the baseline"
    if base is not None and not clears(o, base):
        return "lost: not faster than the baseline beyond the noise"
    if pick is not None and clears(pick, o):
        return "lost: the pick is faster"
    return "lost: not faster than the incumbent of its generation beyond the noise"


def _write_report(
    history: Sequence[Outcome],
    pick: Outcome | None,
    confirmed: bool | None,
    trace: list[dict[str, Any]],
    stop: str,
    settings: TuneSettings,
    out_dir: Path,
    total_s: float,
    summary: Sequence[str] = (),
    demoted: dict[Candidate, str] | None = None,
) -> list[Path]:
    """tune.md (every candidate: samples/s with interval, speedup, quality, bottleneck, verdict), tune.json (the
    trace) and tune.png (samples/s with intervals; needs matplotlib), written atomically."""
    base = _baseline_of(history, ok=True)
    busy = [o.candidate.name for o in history if o.interference]
    rows = [
        "| candidate | move | samples/s [interval] | vs baseline | quality | bottleneck | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in history:
        speed = "-"
        if base is not None and base.samples_per_s and o.samples_per_s:
            speed = f"{o.samples_per_s / base.samples_per_s:.2f}x"
        rows.append(
            f"| `{o.candidate.name}` | {o.candidate.move or '-'} | {_rate(o)} | {speed} | {o.quality} | "
            f"{o.bottleneck or '-'} | {_verdict(o, pick, base, demoted or {})} |"
        )
    confirm = "not run" if confirmed is None else "upheld"
    if demoted:
        confirm = f"the search's pick did not hold up, {pick.candidate.name if pick else 'the baseline'} stays"
    elif confirmed is False:
        confirm = "not upheld: the baseline stays"
    text = "\n".join(
        [
            f"# accel-tune: {pick.candidate.name if pick else 'no pick'}",
            "",
            f"Stopped: {stop}. {len(history)} candidate(s) in {total_s:.0f} s; confirmation: {confirm}.",
            "",
            *(f"The pick: {line}." for line in summary),
            *([""] if summary else []),
            *(
                [
                    "Measured under interference (other processes took the CPUs or GPUs; reruns did not get a quiet "
                    f"run): {', '.join(f'`{n}`' for n in busy)}. Their figures do not decide: no candidate wins on "
                    "them. Run accel-tune again on a quiet machine.",
                    "",
                ]
                if busy
                else []
            ),
            *rows,
            "",
            f"Preset: `preset=tuned_{settings.name}` (with `'hydra.searchpath=[file://{settings.config_dir}]'`).",
            "",
        ]
    )
    files = [
        atomic_write(out_dir / "tune.md", text),
        atomic_write(
            out_dir / "tune.json",
            json.dumps(
                {
                    "stop": stop,
                    "total_s": total_s,
                    "confirmed": confirmed,
                    "pick": pick.candidate.name if pick else None,
                    "trace": trace,
                },
                indent=2,
                default=str,
            )
            + "\n",
        ),
    ]
    plot = _plot(history, out_dir / "tune.png")
    if plot is not None:
        files.append(plot)
    return files


def _plot(history: Sequence[Outcome], path: Path) -> Path | None:
    measured = [o for o in history if o.samples_per_s is not None]
    if not measured:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(measured) + 1.5))
    values = [o.samples_per_s or 0.0 for o in measured]
    errors = [
        [v - (o.low or v) for o, v in zip(measured, values, strict=True)],
        [(o.high or v) - v for o, v in zip(measured, values, strict=True)],
    ]
    ax.barh([o.candidate.name for o in measured], values, xerr=errors, capsize=3)
    ax.set_xlabel("samples/s (median, interval)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path
