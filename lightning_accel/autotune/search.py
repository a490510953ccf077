"""accel-tune's search policy, as pure functions: from what was measured, the next configurations to try.

The search is guided, as a profiler-guided engineer works: it starts from the baseline, reads the incumbent's
bottleneck (BenchMonitor's split through `results.bottleneck`: input-, compute-, communication- or memory-bound)
and tries the moves that address it, one change at a time on top of the incumbent. A candidate replaces the
incumbent only when it passed the quality gate and its throughput interval clears the incumbent's (its low end
above the incumbent's high end): a difference inside the noise is no win.

Nothing here runs anything: `next_candidates(history, space)` takes the outcomes so far and the machine's
possibilities and returns what to measure next, so the policy is tested on made-up outcomes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from lightning_accel.benchmark.moves import MOVES, Bottleneck, Move
from lightning_accel.tuning.dataloader.loader_settings import LOADER_KEYS

__all__ = [
    "MOVES",
    "GROUPS",
    "Candidate",
    "Move",
    "Outcome",
    "Space",
    "Suggestion",
    "apply_move",
    "baseline",
    "clears",
    "compatible",
    "incumbent",
    "moves_here",
    "next_candidates",
]

GROUPS = frozenset(
    {"precision", "compile", "micro_batch", "strategy", "accumulation", "scheduler", "nccl", "lr_scaling", "threads"}
)
"""Choice keys that are config groups (`precision=amp`); any other key is a setting (`++trainer.devices=2`)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration: Hydra choices over the user's own config, and how the search got there."""

    choices: tuple[tuple[str, str], ...] = ()
    """`(key, value)` pairs, sorted by key: config groups (`precision`, `compile`, `micro_batch`, `strategy`,
    `accumulation`) and settings (`trainer.devices`, `callbacks.parallelize.activation_checkpointing`)."""
    parent: str | None = None
    """The name of the candidate it was derived from (None for the baseline)."""
    move: str = ""
    """The move that made it from its parent, in words."""

    @property
    def name(self) -> str:
        """A stable, readable name from the choices: `baseline`, `compile=default+precision=amp`; a callback added by
        its `_target_` reads as the callback (`dataloader_tuner`), a flag set true as the flag
        (`activation_checkpointing`), any other setting as its last key (`devices=2`)."""
        return "+".join(_short(k, v) for k, v in self.choices) or "baseline"

    def overrides(self) -> list[str]:
        """The Hydra command-line overrides of this candidate (on top of the user's): `group=option` for a config
        group, `++key=value` (set or add) for a setting."""
        return [f"{key}={value}" if key in GROUPS else f"++{key}={value}" for key, value in self.choices]

    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.choices).get(key, default)


@dataclass(frozen=True)
class Outcome:
    """What measuring a candidate gave (medians and intervals over rounds, as accel-bench reports them)."""

    candidate: Candidate
    status: Literal["ok", "failed"] = "ok"
    samples_per_s: float | None = None
    low: float | None = None
    """The low end of the samples/s interval."""
    high: float | None = None
    bottleneck: Bottleneck = ""
    quality: Literal["pass", "FAIL", "n/a"] = "n/a"
    reason: str = ""
    """Why it failed, or a note."""
    interference: bool = False
    """Its figures (or the baseline's it is compared with) come only from runs measured under interference: it
    cannot win, whatever they say."""
    settled: tuple[tuple[str, str], ...] = ()
    """What the run decided for itself, as `(key, value)` settings the preset can pin: the DataLoaderTuner's
    `data.num_workers` (and pinning, persistence, prefetch), MicroBatchFinder's
    `callbacks.micro_batch.micro_batch_size`."""


@dataclass(frozen=True)
class Space:
    """What this machine and model allow."""

    devices: int = 1
    """Devices of one kind the run may use (GPUs, or CPU processes)."""
    on_cuda: bool = False
    bf16: bool = False
    """Native bf16 (a CUDA GPU of compute capability 8.0+, or a CPU with bf16 instructions)."""
    compile: bool = True
    """torch.compile can run (a compiler for inductor; `system.software.compile_problem`)."""
    block_classes: bool = False
    """The model config names its blocks (`parallel_plan.block_classes`): model parallel, pipeline, checkpointing."""
    global_batch: int | None = None
    """The global batch to keep (samples per optimizer step), when the user set one."""
    loader_keys: frozenset[str] = frozenset(LOADER_KEYS) - {"prefetch_factor"}
    """The DataLoader settings the user's data config takes (`data.<key>`): the ones a preset may pin. By default
    the example data configs' keys (they set no `prefetch_factor`); accel-tune reads them from the config."""
    thread_plan: bool = True
    """The user's config applies the thread plan (`threads=auto`, accel-train's default, or no `threads` group);
    False for `threads=torch`, where the plan is a move on CPU runs."""


def _short(key: str, value: str) -> str:
    if key in GROUPS:
        return f"{key}={value}"
    parts = key.split(".")
    if parts[-1] == "_target_" and len(parts) > 1:
        return parts[-2]
    return parts[-1] if value == "true" else f"{parts[-1]}={value}"


def baseline() -> Candidate:
    """Where the search starts: the user's config as it is."""
    return Candidate()


def _applies(move: Move, candidate: Candidate, space: Space) -> bool:
    if any(candidate.get(key) is not None for key in move.excludes):
        return False
    if all(candidate.get(key) == value.format(devices=space.devices) for key, value in move.sets):
        return False  # the candidate has it already
    checks = {
        "multi": space.devices > 1,
        "cuda": space.on_cuda,
        "cpu": not space.on_cuda,
        "no_thread_plan": not space.thread_plan,
        "bf16": space.bf16,
        "compile": space.compile,
        "blocks": space.block_classes,
        "model_parallel": candidate.get("strategy") == "model_parallel",
    }
    if not all(checks.get(need, True) for need in move.needs):  # `ddp`, `workers`: conditions of advice only
        return False
    if move.sets[0] == ("precision", "amp") and candidate.get("precision") == "bf16_true":
        return False
    return compatible(apply_move(candidate, move, space))


def moves_here(space: Space) -> list[tuple[Move, bool]]:
    """Every move, and whether it applies on top of the baseline here (what `accel-tune --dry-run` prints)."""
    return [(move, _applies(move, baseline(), space)) for move in MOVES if move.searched]


def _out_of_memory(reason: str) -> bool:
    return any(text in reason for text in ("out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED"))


def compatible(candidate: Candidate) -> bool:
    """Whether the candidate's choices run together (what `checks.check_combinations` would refuse is never
    proposed): micro_batch=auto and compile need one device or DDP (compile also model_parallel)."""
    strategy = candidate.get("strategy")
    if candidate.get("micro_batch") == "auto" and strategy in ("model_parallel", "pipeline"):
        return False
    return not (candidate.get("compile") not in (None, "none") and strategy == "pipeline")


def apply_move(candidate: Candidate, move: Move, space: Space, parent: str | None = None) -> Candidate:
    """`candidate` with `move`'s choices set (replacing the same keys)."""
    choices = dict(candidate.choices)
    choices.update({key: value.format(devices=space.devices) for key, value in move.sets})
    return Candidate(tuple(sorted(choices.items())), parent=parent or candidate.name, move=move.name)


def clears(candidate: Outcome, incumbent: Outcome) -> bool:
    """Whether `candidate` is faster beyond the noise: its samples/s interval lies above the incumbent's (low end
    over high end); a candidate without an interval clears only by its median over the incumbent's high end."""
    if candidate.status != "ok" or candidate.samples_per_s is None or incumbent.samples_per_s is None:
        return False
    low = candidate.low if candidate.low is not None else candidate.samples_per_s
    high = incumbent.high if incumbent.high is not None else incumbent.samples_per_s
    return low > high


def incumbent(history: Sequence[Outcome]) -> Outcome | None:
    """The best outcome so far, by the search's rule: the first ok outcome (the baseline), replaced by each later one
    that passed the quality gate, was measured without interference, and clears it."""
    best: Outcome | None = None
    for outcome in history:
        if outcome.status != "ok":
            continue
        if best is None:
            best = outcome
        elif outcome.quality == "pass" and not outcome.interference and clears(outcome, best):
            best = outcome
    return best


@dataclass(frozen=True)
class Suggestion:
    """What to try next and why."""

    candidates: list[Candidate] = field(default_factory=list)
    why: str = ""


def next_candidates(history: Sequence[Outcome], space: Space, limit: int = 3) -> Suggestion:
    """Up to `limit` untried candidates, each one move on top of the incumbent, the moves for its bottleneck first
    (then the others that apply, so a search whose guess was wrong still explores); empty when none is left or
    nothing was measured yet (then the baseline comes first).

    A move already tried on this incumbent or an earlier one (the same resulting choices) is not tried again, nor a
    move whose candidate failed (its keys with the same values are ruled out for the rest of the search).
    """
    if not history:
        return Suggestion([baseline()], "start from the baseline")
    best = incumbent(history)
    if best is None:
        first = history[0]
        if not _out_of_memory(first.reason):
            return Suggestion([], f"the baseline failed ({first.reason or 'no reason given'}): nothing to build on")
        # the run as configured does not fit: the memory moves on the baseline, as if it had been memory-bound
        best = Outcome(first.candidate, bottleneck="memory-bound")
        memory_only = True
    else:
        memory_only = False
    tried = {outcome.candidate.choices for outcome in history}
    failed_settings = {pair for o in history if o.status == "failed" for pair in o.candidate.choices}
    base = best.candidate
    ordered = [m for m in MOVES if m.searched and best.bottleneck in m.addresses]
    if not memory_only:  # a run that does not fit gains nothing from moves that do not save memory
        ordered += [m for m in MOVES if m.searched and m not in ordered]
    picked: list[Candidate] = []
    for move in ordered:
        if len(picked) >= limit:
            break
        if not _applies(move, base, space):
            continue
        candidate = apply_move(base, move, space)
        new_pairs = set(candidate.choices) - set(base.choices)
        if candidate.choices in tried or new_pairs & failed_settings:
            continue
        if any(c.choices == candidate.choices for c in picked):
            continue
        picked.append(candidate)
    why = f"incumbent {base.name} is {best.bottleneck or 'of unknown bottleneck'}"
    return Suggestion(picked, why if picked else f"{why}; every move that applies was tried")
