"""accel-tune's search policy as pure functions (made-up outcomes), and its preset file round-trip through Hydra."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lightning_accel.autotune.preset_file import pinned, preset_yaml, settled_of, write_preset
from lightning_accel.autotune.search import (
    MOVES,
    Candidate,
    Outcome,
    Space,
    apply_move,
    baseline,
    clears,
    incumbent,
    next_candidates,
)
from lightning_accel.errors import ConfigError


def ok(candidate: Candidate, rate: float, spread: float = 0.05, bottleneck: str = "", quality: str = "pass") -> Outcome:
    return Outcome(
        candidate,
        samples_per_s=rate,
        low=rate * (1 - spread),
        high=rate * (1 + spread),
        bottleneck=bottleneck,
        quality=quality,
    )  # type: ignore[arg-type]


def move(name: str):
    return next(m for m in MOVES if m.name == name)


def test_the_search_starts_from_the_baseline() -> None:
    first = next_candidates([], Space())
    assert [c.name for c in first.candidates] == ["baseline"] and first.candidates[0].overrides() == []


def test_the_incumbents_bottleneck_picks_the_first_moves() -> None:
    space = Space(devices=4, on_cuda=True, bf16=True, block_classes=True)
    base = baseline()
    picks = {
        "input-bound": "dataloader_tuner",
        "compute-bound": "precision=amp",
        "memory-bound": "micro_batch=auto",
        "communication-bound": "accumulation=fixed",
    }
    for bottleneck, first in picks.items():
        suggestion = next_candidates([ok(base, 100.0, bottleneck=bottleneck)], space)
        assert suggestion.candidates[0].name == first, (bottleneck, suggestion)
        assert bottleneck in suggestion.why
        assert all(c.parent == "baseline" for c in suggestion.candidates)


def test_moves_that_the_machine_cannot_run_are_left_out() -> None:
    cpu_one = Space(devices=1, on_cuda=False, bf16=False, compile=False, block_classes=False)
    names = {
        c.name
        for c in next_candidates(
            [ok(baseline(), 100.0, bottleneck="communication-bound")], cpu_one, limit=20
        ).candidates
    }
    assert not any(
        "strategy=" in n or "compile=" in n or "ddp_grad_compression" in n or "bf16_true" in n for n in names
    ), names
    assert "accumulation=fixed" in names and "precision=amp" in names


def test_a_winner_must_clear_the_incumbents_interval_and_pass_quality() -> None:
    base, amp = baseline(), apply_move(baseline(), move("mixed precision"), Space())
    assert clears(ok(amp, 130.0), ok(base, 100.0))  # 123.5 > 105
    assert not clears(ok(amp, 108.0), ok(base, 100.0))  # 102.6 < 105: inside the noise
    history = [ok(base, 100.0, bottleneck="compute-bound"), ok(amp, 108.0)]
    assert incumbent(history).candidate.name == "baseline"  # type: ignore[union-attr]
    history = [ok(base, 100.0, bottleneck="compute-bound"), ok(amp, 150.0, quality="FAIL")]
    assert incumbent(history).candidate.name == "baseline"  # type: ignore[union-attr]  # faster but worse
    busy = replace(ok(amp, 150.0), interference=True)
    assert incumbent([ok(base, 100.0), busy]).candidate.name == "baseline"  # type: ignore[union-attr]  # busy: no win
    history = [ok(base, 100.0, bottleneck="compute-bound"), ok(amp, 150.0)]
    assert incumbent(history).candidate.name == "precision=amp"  # type: ignore[union-attr]


def test_the_search_builds_on_the_winner_and_never_repeats_or_retries_a_failure() -> None:
    space = Space(devices=2, compile=True, block_classes=True)
    base = baseline()
    amp = apply_move(base, move("mixed precision"), space)
    compiled = apply_move(base, move("torch.compile"), space)
    history = [
        ok(base, 100.0, bottleneck="compute-bound"),
        ok(amp, 150.0, bottleneck="compute-bound"),
        Outcome(compiled, status="failed", reason="no compiler"),
    ]
    following = next_candidates(history, space, limit=10).candidates
    assert following and all(c.parent == "precision=amp" and c.get("precision") == "amp" for c in following)
    assert not any(c.get("compile") == "default" for c in following)  # compile=default failed: ruled out
    assert len({c.choices for c in following}) == len(following)
    assert all(c.choices not in {o.candidate.choices for o in history} for c in following)
    ddp = next(c for c in following if c.get("strategy") == "ddp")
    assert ddp.overrides() == ["precision=amp", "strategy=ddp", "++trainer.devices=2"]


def test_a_failed_baseline_or_an_exhausted_space_says_so() -> None:
    assert next_candidates([Outcome(baseline(), status="failed")], Space()).candidates == []
    space = Space(devices=1, compile=False)
    history = [ok(baseline(), 100.0, bottleneck="compute-bound")]
    while True:
        suggestion = next_candidates(history, space)
        if not suggestion.candidates:
            break
        history += [ok(c, 90.0) for c in suggestion.candidates]  # none wins: the baseline stays
        assert len(history) < 50
    assert "every move that applies was tried" in suggestion.why


def test_the_preset_file_round_trips_through_hydra(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from lightning_accel.launch import register_resolvers

    space = Space(devices=2)
    tuned = apply_move(apply_move(baseline(), move("mixed precision"), space), move("DDP over the devices"), space)
    tuned = apply_move(tuned, move("DataLoader workers by experiment"), space)
    path = write_preset(tmp_path / "conf", "gpt", tuned, comment=["found by accel-tune"])
    assert path.name == "tuned_gpt.yaml" and path.read_text().startswith("# @package _global_\n# found by")
    assert "  - override /precision: amp" in preset_yaml(tuned)
    register_resolvers()
    with initialize_config_module(config_module="lightning_accel.conf", version_base=None):
        search = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "trainer.accelerator=cpu"]
        from_preset = compose("train", overrides=[*search, "preset=tuned_gpt"])
        direct = compose("train", overrides=[*search, *tuned.overrides()])
    for key in ("trainer.precision", "trainer.strategy", "trainer.devices", "callbacks.dataloader_tuner._target_"):
        assert OmegaConf.select(from_preset, key) == OmegaConf.select(direct, key), key
    assert from_preset.trainer.devices == 2 and from_preset.callbacks.dataloader_tuner is not None


def test_what_a_run_settled_is_pinned_in_the_preset_and_composes(tmp_path: Path) -> None:
    """The DataLoaderTuner's decision and MicroBatchFinder's size come back as settings; the preset pins the ones the
    user's data config takes, and they win over the groups' own values when Hydra composes it."""
    from hydra import compose, initialize_config_module

    from lightning_accel.launch import register_resolvers

    space = Space()
    tuned = apply_move(
        apply_move(baseline(), move("DataLoader workers by experiment"), space),
        move("micro-batches sized to memory"),
        space,
    )
    loader = {"num_workers": 3, "prefetch_factor": 4, "pin_memory": False, "persistent_workers": True}
    settled = settled_of(loader, 8, True, tuned.choices)
    assert dict(settled) == {
        "data.num_workers": "3",
        "data.prefetch_factor": "4",
        "data.pin_memory": "false",
        "data.persistent_workers": "true",
        "callbacks.micro_batch.micro_batch_size": "8",
    }
    assert settled_of({"num_workers": 0, "prefetch_factor": None}, 32, False, ()) == (("data.num_workers", "0"),)
    assert settled_of(None, 8, True, ()) == ()  # a size not searched for (the user's own finder) is not pinned
    keys = {"num_workers", "pin_memory", "persistent_workers"}
    chosen, comment = pinned(Outcome(tuned, samples_per_s=1.0, settled=settled), keys)
    assert ("data.prefetch_factor", "4") not in chosen.choices  # the example's data config takes no prefetch_factor
    assert any("DataLoaderTuner's decision" in line and "data.num_workers=3" in line for line in comment)
    assert any("micro_batch_size=8" in line for line in comment)
    write_preset(tmp_path / "conf", "gpt", chosen, comment=comment)
    register_resolvers()
    with initialize_config_module(config_module="lightning_accel.conf", version_base=None):
        search = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "trainer.accelerator=cpu"]
        cfg = compose("train", overrides=[*search, "preset=tuned_gpt"])
    assert cfg.data.num_workers == 3 and cfg.data.persistent_workers is True and cfg.data.pin_memory is False
    assert cfg.callbacks.micro_batch.micro_batch_size == 8 and cfg.callbacks.dataloader_tuner is not None
    plain, none = pinned(Outcome(baseline(), samples_per_s=1.0), {"num_workers"})
    assert plain.choices == () and none == []


def test_a_preset_name_must_be_a_plain_word(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="letters, digits and underscores") as err:
        write_preset(tmp_path, "../evil", baseline())
    assert err.value.setting == "name" and not list(tmp_path.rglob("*.yaml"))


def test_choices_that_do_not_run_together_are_never_proposed() -> None:
    from lightning_accel.autotune.search import compatible

    space = Space(devices=2, block_classes=True)
    sized = apply_move(baseline(), move("micro-batches sized to memory"), space)
    following = next_candidates(
        [ok(baseline(), 100.0, bottleneck="memory-bound"), ok(sized, 200.0, bottleneck="memory-bound")], space, limit=20
    ).candidates
    strategies = {c.get("strategy") for c in following}
    assert "ddp" in strategies and not strategies & {"model_parallel", "pipeline"}  # micro_batch=auto runs with DDP
    assert not compatible(Candidate((("compile", "default"), ("strategy", "pipeline"))))
    assert compatible(Candidate((("compile", "default"), ("strategy", "model_parallel"))))


def test_a_baseline_out_of_memory_tries_the_memory_moves_only() -> None:
    space = Space(devices=2, bf16=True, block_classes=True)
    oom = Outcome(baseline(), status="failed", reason="exit 1: torch.OutOfMemoryError: CUDA out of memory")
    first = next_candidates([oom], space, limit=10)
    assert first.candidates[0].name == "micro_batch=auto"
    assert {c.move for c in first.candidates} <= {m.name for m in MOVES if "memory-bound" in m.addresses}
    sized = first.candidates[0]
    history = [oom, ok(sized, 80.0, bottleneck="compute-bound")]
    assert incumbent(history).candidate == sized  # type: ignore[union-attr]  # the first run that fits
    assert (
        next_candidates([Outcome(baseline(), status="failed", reason="exit 1: KeyError: 'x'")], space).candidates == []
    )


def test_the_thread_plan_is_a_move_on_cpu_runs_whose_config_sets_threads_torch() -> None:
    base = [ok(baseline(), 100.0, bottleneck="compute-bound")]
    torch_threads = Space(devices=1, on_cuda=False, compile=False, thread_plan=False)
    names = [c.name for c in next_candidates(base, torch_threads, limit=20).candidates]
    assert "threads=auto" in names
    assert apply_move(baseline(), move("the thread plan"), torch_threads).overrides() == ["threads=auto"]
    for space in (Space(devices=1, on_cuda=False), Space(devices=1, on_cuda=True, thread_plan=False)):
        assert "threads=auto" not in [c.name for c in next_candidates(base, space, limit=20).candidates]
