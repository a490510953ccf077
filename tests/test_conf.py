"""Every option of every config group composes, and builds a Trainer (and its parts) on CPU."""

from __future__ import annotations

import warnings
from importlib import resources

import lightning.pytorch as pl
import pytest
import torch
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

from lightning_accel.callbacks import AccumulationScheduler
from lightning_accel.checks import check_config
from lightning_accel.compose import apply_precision, instantiate_named, precision_callbacks
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.system import read_cpu_info

CONF = resources.files("lightning_accel.conf")


def _packaged_options() -> list[tuple[str, str]]:
    """(group, option) pairs as Hydra itself lists them, limited to the configs this package ships."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_accel.conf", version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        pairs = [
            (group, option)
            for group in loader.list_groups("")
            for option in loader.get_group_options(group)
            if CONF.joinpath(group, f"{option}.yaml").is_file()
        ]
    GlobalHydra.instance().clear()
    return pairs


OPTIONS = _packaged_options()
# Options that only make sense together with another choice.
COMPANIONS = {("data", "digits"): ["model=classifier"]}
# What each precision option composes to, and what it resolves to on a CPU Trainer here: a Lightning precision, or the
# error the run stops with. A new option without an entry fails the test (KeyError) rather than being skipped.
_CPU_AMP = "bf16-mixed" if read_cpu_info().has_native_bf16 else "32-true"
PRECISIONS: dict[str, tuple[str, str | type[Exception]]] = {
    "fp32": ("32-true", "32-true"),
    "amp": (_CPU_AMP, _CPU_AMP),  # resolved as the config is read (`${accel_precision:...}`): no call needed
    "bf16_mixed": ("bf16-mixed", "bf16-mixed"),
    "fp16_mixed": ("16-mixed", "bf16-mixed"),  # fp16 autocast does not run on CPU: bf16, with a warning
    "bf16_true": ("bf16-true", "bf16-true"),
    "fp8": ("fp8", ConfigError),  # needs a CUDA GPU of compute capability 8.9+
}


@pytest.fixture(autouse=True)
def _restore_matmul_precision():
    """apply_precision sets torch's float32 matmul precision for the process; put it back after each test."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_listing_covers_the_documented_groups() -> None:
    groups = {group for group, _ in OPTIONS}
    assert groups >= {
        "trainer",
        "precision",
        "strategy",
        "accumulation",
        "scheduler",
        "callbacks",
        "logger",
        "model",
        "data",
        "preset",
        "paths",
        "hydra",
    }
    options = set(OPTIONS)
    assert {option for group, option in OPTIONS if group == "precision"} == set(PRECISIONS)
    for required in [
        ("precision", "fp32"),
        ("precision", "bf16_mixed"),
        ("precision", "fp16_mixed"),
        ("strategy", "auto"),
        ("strategy", "ddp"),
        ("scheduler", "none"),
        ("scheduler", "cosine"),
        ("scheduler", "onecycle"),
        ("accumulation", "none"),
        ("accumulation", "fixed"),
        ("preset", "baseline"),
        ("preset", "amp"),
        ("preset", "ddp"),
        ("logger", "csv"),
        ("logger", "tensorboard"),
    ]:
        assert required in options


CPU_ERRORS = {("strategy", "fsdp"): "`trainer.strategy='lightning.pytorch.strategies.FSDPStrategy'` needs CUDA GPUs"}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_builds_a_cpu_trainer(compose_train, group: str, option: str) -> None:
    overrides = [] if group == "hydra" else [f"{group}={option}", *COMPANIONS.get((group, option), [])]
    cfg = compose_train([*overrides, "trainer.accelerator=cpu"])
    if (group, option) in CPU_ERRORS:  # options that cannot run on a CPU stop before anything is built
        with pytest.raises(ConfigError, match=CPU_ERRORS[(group, option)]):
            check_config(cfg)
        return
    check_config(cfg)
    if group == "precision":
        composed, resolved = PRECISIONS[option]
        assert cfg.trainer.precision == composed
        assert cfg.float32_matmul_precision in ("highest", "high", "medium")
        if isinstance(resolved, type):
            with pytest.raises(resolved):
                apply_precision(cfg)
            return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        needed = precision_callbacks(apply_precision(cfg))
    callbacks = instantiate_named(cfg.callbacks) + needed
    loggers = instantiate_named(cfg.logger)
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    assert isinstance(trainer, pl.Trainer)
    assert trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    model = instantiate(cfg.model)
    datamodule = instantiate(cfg.data)
    assert isinstance(model, pl.LightningModule)
    assert isinstance(datamodule, pl.LightningDataModule)
    # Each option does what its name says.
    if group == "strategy" and option == "ddp":
        assert isinstance(trainer.strategy, DDPStrategy)
    if group == "strategy" and option == "model_parallel":
        from lightning_accel.callbacks import Parallelize
        from lightning_accel.strategies import ModelParallelStrategy

        assert isinstance(trainer.strategy, ModelParallelStrategy)
        assert any(isinstance(cb, Parallelize) for cb in trainer.callbacks)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)]
    if group == "precision":
        assert cfg.trainer.precision == resolved and trainer.precision == resolved
        assert torch.get_float32_matmul_precision() == cfg.float32_matmul_precision
        # One warning when a setting is changed (amp picking a mixed precision is a choice, not a change; amp left at
        # fp32 on a CPU without bf16 warns, although the composed value is already the resolved one).
        warns = resolved == "32-true" if option == "amp" else resolved != composed
        assert len(ours) == int(warns), ours
    if group == "accumulation":
        schedulers = [cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)]
        expected = {"none": (1, 0), "fixed": (4, 0), "schedule": (1, 1), "global_batch": (1, 1)}[option]
        assert (trainer.accumulate_grad_batches, len(schedulers)) == expected
    if group == "micro_batch":
        finders = [cb for cb in trainer.callbacks if type(cb).__name__ == "MicroBatchFinder"]
        assert len(finders) == (option == "auto")
    if group == "scheduler":
        assert (cfg.scheduler is None) == (option == "none")
        assert (model.lr_scheduler is None) == (option == "none")
    if group == "callbacks":
        assert len(callbacks) == len(cfg.callbacks)
    if group == "logger":
        assert len(trainer.loggers) == len(cfg.logger)


def test_presets_set_the_ladder(compose_train) -> None:
    baseline = compose_train(["preset=baseline"])
    assert (baseline.trainer.precision, baseline.data.num_workers, baseline.trainer.devices) == ("32-true", 0, 1)
    amp = compose_train(["preset=amp"])
    amp_raw = OmegaConf.to_container(amp.trainer, resolve=False)["precision"]
    assert amp_raw.startswith("${accel_precision:amp") and amp.data.num_workers > 0  # resolved per hardware
    ddp = compose_train(["preset=ddp"])
    assert ddp.trainer.strategy._target_.endswith("DDPStrategy") and ddp.trainer.devices == "auto"
    assert OmegaConf.to_container(ddp.trainer, resolve=False)["precision"] == amp_raw
    for cfg in (amp, ddp):  # the DataLoader's workers are found by timing real steps
        assert cfg.callbacks.dataloader_tuner._target_.endswith("DataLoaderTuner")
    assert "dataloader_tuner" not in baseline.callbacks


def test_command_line_beats_preset(compose_train) -> None:
    cfg = compose_train(["preset=amp", "precision=fp32", "data.num_workers=1"])
    assert cfg.trainer.precision == "32-true"
    assert cfg.data.num_workers == 1


def test_callbacks_are_a_dict_keyed_by_name(compose_train) -> None:
    cfg = compose_train(["~callbacks.lr_monitor", "callbacks.model_checkpoint.save_top_k=3"])
    assert "lr_monitor" not in cfg.callbacks
    assert cfg.callbacks.model_checkpoint.save_top_k == 3
    both = compose_train(["callbacks=[default,early_stopping]"])
    assert set(both.callbacks) == {
        "model_checkpoint",
        "lr_monitor",
        "model_summary",
        "skipped_steps",
        "stop_on_signal",
        "gpu_monitor",
        "early_stopping",
        "matmul_precision",  # the precision group's: float32_matmul_precision on every rank
        "nonfinite",  # NonFiniteGuard: a non-finite loss skips its step
    }


def test_the_default_heartbeat_takes_the_full_gpu_monitor_when_asked(compose_train) -> None:
    """The default callbacks publish only (callbacks/monitor.yaml); adding `gpu_monitor` turns the same node into the
    full monitor, and `~callbacks.gpu_monitor` removes it."""
    default = compose_train([]).callbacks.gpu_monitor
    assert (default.log_metrics, default.publish, "pcie" in default.readings) == (False, True, False)
    full = compose_train(["callbacks=[default,gpu_monitor]"]).callbacks.gpu_monitor
    assert (full.log_metrics, full.publish, full.readings, full.interval_s) == (True, True, None, 0.5)
    assert "gpu_monitor" not in compose_train(["~callbacks.gpu_monitor"]).callbacks


def test_classifier_model_brings_its_data(compose_train) -> None:
    cfg = compose_train(["model=classifier"])
    assert cfg.data._target_.endswith("DigitsDataModule")
    assert cfg.model._target_.endswith("DigitsClassifier")


def test_slurm_launcher_follows_the_trainer(compose_train) -> None:
    cfg = compose_train(["hydra/launcher=accel_slurm", "trainer.num_nodes=2", "trainer.devices=4", "strategy=ddp"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)


def test_slurm_launcher_sends_the_signal_lightning_requeues_on(compose_train, tmp_path) -> None:
    """The sbatch script submitit writes asks for SIGUSR1 (Lightning's requeue signal), not submitit's SIGUSR2."""
    import signal

    from lightning.fabric.plugins.environments import SLURMEnvironment
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import _make_sbatch_string

    launcher = compose_train(["hydra/launcher=accel_slurm", "hydra.launcher.signal_delay_s=300"]).hydra.launcher
    extra = OmegaConf.to_container(launcher.additional_parameters, resolve=True)
    script = _make_sbatch_string(
        command="python -m lightning_accel.train",
        folder=tmp_path,
        signal_delay_s=launcher.signal_delay_s,
        additional_parameters=extra,
    )
    assert "#SBATCH --signal=USR1@300" in script and "USR2" not in script
    assert SLURMEnvironment().requeue_signal == signal.SIGUSR1


def test_schedule_keys_change_from_the_command_line(compose_train) -> None:
    """`callbacks.accumulation.scheduling={0:1,50:2}` failed ("Key '50' is not in struct"): the schedule is a list of
    [step, micro-batches] pairs, which an override replaces whole."""
    from hydra.utils import instantiate

    cfg = compose_train(["accumulation=schedule", "callbacks.accumulation.scheduling=[[0,1],[50,2]]"])
    assert instantiate(cfg.callbacks.accumulation).scheduling == {0: 1, 50: 2}
    assert instantiate(compose_train(["accumulation=schedule"]).callbacks.accumulation).scheduling == {
        0: 1,
        100: 2,
        300: 4,
    }


@pytest.mark.slow
def test_precision_amp_builds_a_trainer_in_an_app_that_never_calls_apply_precision(tmp_path) -> None:
    """A lightning-hydra-template app with `precision=amp` instantiated its Trainer with `precision='amp'` and got
    Lightning's "Precision 'amp' is invalid": the resolver, registered by the search-path plugin Hydra imports in
    every app, gives this machine's precision string."""
    import subprocess
    import sys

    app = tmp_path / "app.py"
    app.write_text(
        "import hydra\nfrom hydra.utils import instantiate\n\n"
        "@hydra.main(version_base='1.3', config_path=None, config_name='train')\n"
        "def main(cfg):\n    trainer = instantiate(cfg.trainer, logger=False)\n"
        "    print('PRECISION', trainer.precision)\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            str(app),
            "hydra.searchpath=[pkg://lightning_accel.conf]",
            "precision=amp",
            "trainer.accelerator=cpu",
            "~trainer.plugins",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PRECISION bf16-mixed" in done.stdout or "PRECISION 32-true" in done.stdout


def test_the_example_optimizers_fuse_on_cuda_only(compose_train, monkeypatch) -> None:
    """`fused: ${accel_fused:${trainer.accelerator}}`: True for a CUDA run (one kernel per AdamW update), None (torch's
    foreach default) on the CPU; `auto` counts the visible CUDA devices."""
    from lightning_accel.launch import fused_resolver

    assert fused_resolver("gpu") is True and fused_resolver("cuda") is True and fused_resolver("cpu") is None
    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: 1)
    assert fused_resolver("auto") is True
    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: 0)
    for model in ("gpt", "classifier"):
        cfg = compose_train([f"model={model}", "trainer.accelerator=cpu"])
        assert cfg.model.optimizer.fused is None
        assert OmegaConf.to_container(cfg.model.optimizer)["fused"].startswith("${accel_fused:")


@pytest.mark.parametrize(
    ("preset", "precision", "tf32"), [("baseline", "highest", False), ("amp", "high", True), ("ddp", "high", True)]
)
def test_each_preset_sets_the_cuda_matmul_precision_explicitly(
    compose_train, preset: str, precision: str, tf32: bool
) -> None:
    """The fp32 baseline is true fp32 (TF32 off in cuBLAS), the amp rungs let CUDA's fp32 matmuls use TF32."""
    cfg = compose_train([f"preset={preset}", "trainer.accelerator=cpu"])
    assert cfg.float32_matmul_precision == precision
    before = torch.get_float32_matmul_precision()
    try:
        apply_precision(cfg)
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_amp_and_ddp_presets_pin_host_batches_on_cuda_only(compose_train, monkeypatch) -> None:
    from lightning_accel.launch import on_cuda_resolver

    assert on_cuda_resolver("gpu") is True and on_cuda_resolver("cpu") is False
    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: 0)
    assert on_cuda_resolver("auto") is False
    for preset in ("amp", "ddp"):
        assert compose_train([f"preset={preset}", "trainer.accelerator=cpu"]).data.pin_memory is False
        assert compose_train([f"preset={preset}", "trainer.accelerator=gpu"]).data.pin_memory is True
    assert compose_train(["preset=baseline", "trainer.accelerator=gpu"]).data.pin_memory is False  # the article's


def test_lightning_copies_batches_to_a_cuda_device_with_non_blocking() -> None:
    """Pinned memory pays only with asynchronous copies: Lightning's batch transfer asks for `non_blocking=True` on
    CUDA (checked with a tensor that records the call instead of copying)."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    calls = []

    class _Recorder(torch.Tensor):
        def to(self, *args, **kwargs):  # type: ignore[override]
            calls.append(kwargs)
            return self

    batch = (torch.zeros(2, 3).as_subclass(_Recorder), torch.ones(2).as_subclass(_Recorder))
    move_data_to_device(batch, torch.device("cuda", 0))
    assert len(calls) == 2 and all(c.get("non_blocking") is True for c in calls)
