"""The second probe's repro cases (bad inputs and faults from outside), each a test that failed before its fix.

Refused before launch, exit 2, the setting and the fix named (items 7 and 9); a run that learned nothing exits 1
(item 8); `fit=false` tests the checkpoint it is given (item 3); the DataLoaderTuner's cache is bounded, locked and
not trusted when others may write it (item 4); accel-bench's report is written whole or not at all and SIGTERM to it
or to accel-tune ends the running stage and writes the outputs (items 5 and 6); what killed saves left is cleaned up.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psutil
import pytest
import torch
from _env import clean_env
from _wait import wait_until
from omegaconf import OmegaConf

from lightning_accel.errors import ConfigError

SMOKE = ["trainer=smoke", "trainer.accelerator=cpu", "data.max_chars=200000"]


def _train(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    module: str = "lightning_accel.train",
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**(env or {})),
    )


# --- item 7 and 9: values checked at the edge, before anything is built ----------------------------------------------

REFUSED = [
    (["model.optimizer.lr=-1"], "`model.optimizer.lr=-1` must be a finite number >= 0"),
    (["model.optimizer.lr=nan"], "`model.optimizer.lr=nan` must be a finite number"),
    (["model.optimizer.lr=abc"], "`model.optimizer.lr='abc'` must be a finite number"),
    (["data.batch_size=3.5"], "`data.batch_size=3.5` must be an integer >= 1"),
    (["seed=-1"], "`seed=-1` must be an integer within [0, 4294967295]"),
    (["seed=100000000000"], "`seed=100000000000` must be an integer within"),
    (["model.vocab_size=10"], "`model.vocab_size=10` is smaller than the 256 byte values"),
    (["trainer.max_epochs=0"], "`trainer.max_epochs=0` trains nothing"),
    (["+trainer.limit_train_batches=0"], "`trainer.limit_train_batches=0` trains on no batch at all"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=[o[0] for o, _ in REFUSED])
def test_a_bad_value_is_refused_before_launch_naming_the_setting(compose_train, overrides, message) -> None:
    from lightning_accel.checks import check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose_train([*overrides, "trainer.accelerator=cpu"]))
    assert message in str(err.value)


@pytest.mark.slow
def test_the_command_line_exits_2_with_the_message(tmp_path: Path) -> None:
    done = _train(["model.optimizer.lr=-1", "check=true"], tmp_path)
    assert done.returncode == 2 and "accel-train: error: `model.optimizer.lr=-1`" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ACCEL_LOG_DIR": ""}, "`ACCEL_LOG_DIR=''` is set but empty"),
        ({"ACCEL_RUN_ID": "x" * 300}, "`ACCEL_RUN_ID` is 300 characters long"),
    ],
)
def test_an_environment_that_would_misplace_the_run_is_refused(tmp_path: Path, env, message) -> None:
    done = _train(["check=true"], tmp_path, env=env)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not Path("/runs").exists() or not any(Path("/runs").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("lightning_accel.tune", ["--tolerance", "nan"], "`--tolerance=nan` must be a fraction"),
        ("lightning_accel.tune", ["--time-budget", "nan"], "`--time-budget=nan` must be a finite number"),
        ("lightning_accel.tune", ["--confirm-steps", "-5"], "`--confirm-steps=-5` must be >= 0"),
        ("lightning_accel.tune", ["--stage-timeout", "nan"], "`--stage-timeout=nan` must be a finite number"),
        ("lightning_accel.bench", ["--stage-timeout", "nan"], "expected a finite float > 0, got nan"),
        ("lightning_accel.bench", ["--peak-tflops", "nan"], "expected a finite float > 0, got nan"),
        ("lightning_accel.bench", ["--target", "nan"], "`--target=nan` must be a finite value"),
    ],
)
def test_a_flag_that_would_turn_a_safeguard_off_is_refused(tmp_path: Path, module, args, message) -> None:
    done = _train([*args, "trainer.accelerator=cpu"], tmp_path, module=module, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()  # nothing ran


def test_a_fifo_as_ckpt_path_is_refused_instead_of_hanging(tmp_path: Path) -> None:
    from lightning_accel.checks import check_ckpt_path

    fifo = tmp_path / "ckpt"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file or directory"):
        check_ckpt_path(OmegaConf.create({"ckpt_path": str(fifo), "fit": True}))
    assert time.monotonic() - started < 5


def test_a_zip_that_is_not_a_torch_archive_is_named(tmp_path: Path) -> None:
    from lightning_accel.checks import check_ckpt_path

    path = tmp_path / "other.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "not a checkpoint")
    with pytest.raises(ConfigError, match="is not a readable torch checkpoint"):
        check_ckpt_path(OmegaConf.create({"ckpt_path": str(path), "fit": True}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smoke run's last.ckpt (10 steps of the GPT example)."""
    folder = tmp_path_factory.mktemp("trained")
    done = _train([*SMOKE, "test=false", f"hydra.run.dir={folder / 'run'}"], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_a_checkpoint_of_another_architecture_is_refused_before_launch(trained: Path, tmp_path: Path) -> None:
    done = _train([*SMOKE, "model.n_embd=64", f"ckpt_path={trained}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2 and "was saved by another model configuration" in done.stderr
    assert "differ in shape" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_fit_false_tests_the_weights_of_ckpt_path(trained: Path, tmp_path: Path) -> None:
    """It tested untrained weights (test loss 5.58) and said `tested weights: final`."""
    done = _train(
        [*SMOKE, "fit=false", "test=true", f"ckpt_path={trained}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tested_weights"] == f"checkpoint {trained}"
    assert summary["metrics"]["test/loss"] < 5.0  # ln(256) = 5.55 untrained


@pytest.mark.slow
def test_a_distributed_checkpoint_on_a_single_device_strategy_is_named(tmp_path: Path) -> None:
    from lightning_accel.strategies.pipeline.checkpoint import save_pipeline_checkpoint

    one_rank = type(
        "R", (), {"broadcast": staticmethod(lambda x: x), "barrier": staticmethod(lambda: None), "global_rank": 0}
    )()
    save_pipeline_checkpoint(one_rank, {"state_dict": {"w": torch.ones(1)}, "epoch": 0}, tmp_path / "dir.ckpt")
    done = _train([*SMOKE, f"ckpt_path={tmp_path / 'dir.ckpt'}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2 and "is a distributed checkpoint directory" in done.stderr
    assert "consolidate_checkpoint" in done.stderr


@pytest.mark.slow
def test_an_unwritable_checkpoint_directory_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file where the checkpoint folder goes")
    done = _train([*SMOKE, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2 and "`callbacks.model_checkpoint.dirpath=" in done.stderr
    assert "cannot be written" in done.stderr


@pytest.mark.slow
def test_a_missing_monitor_is_named_before_any_training_step(tmp_path: Path) -> None:
    """It was found after training, at the first save (step 5)."""
    done = _train(
        [*SMOKE, "callbacks.model_checkpoint.monitor=val/nope", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "`ModelCheckpoint(monitor='val/nope')` is not a metric this run logs" in done.stderr
    assert "val/loss" in done.stderr and not list((tmp_path / "run").rglob("*.ckpt"))


@pytest.mark.slow
def test_val_check_interval_beyond_the_epoch_is_named(tmp_path: Path) -> None:
    done = _train([*SMOKE, "trainer.val_check_interval=100000", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2 and "`trainer.val_check_interval=100000`" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_empty_training_set_names_why_there_is_no_step() -> None:
    """`limit_train_batches=0`, `max_epochs=0` and an empty train set all said "`total_steps=0` must be positive"."""
    import lightning.pytorch as pl

    from lightning_accel import schedules
    from lightning_accel.examples import GPTLanguageModel

    class Empty(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 0

    model = GPTLanguageModel(block_size=8, lr_scheduler=schedules.cosine_schedule)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigError, match="the train DataLoader has 0 batches"):
        trainer.fit(model, torch.utils.data.DataLoader(Empty(), batch_size=2))


@pytest.mark.slow
def test_a_taken_master_port_is_refused_at_once(tmp_path: Path) -> None:
    """The ranks waited 125 s and then blamed the rendezvous."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        done = _train(
            [*SMOKE, "strategy=ddp", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"],
            tmp_path,
            env={"MASTER_PORT": str(port)},
        )
    assert done.returncode == 2 and f"`MASTER_PORT={port}` is taken by another process" in done.stderr
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_resuming_with_another_accumulation_says_so(trained: Path, tmp_path: Path) -> None:
    done = _train(
        [
            *SMOKE,
            "trainer.accumulate_grad_batches=2",
            "trainer.max_steps=12",
            f"ckpt_path={trained}",
            "test=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accumulated accumulate_grad_batches=1 and now accumulates accumulate_grad_batches=2" in done.stderr


@pytest.mark.slow
def test_what_killed_saves_left_is_removed_at_the_next_start(trained: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained.parent.parent, run)
    leftovers = [
        run / "checkpoints" / ".last.ckpt.accel-abc12345.tmp",
        run / "checkpoints" / ".last.ckpt.saving-1a2b3c4d",
    ]
    leftovers[0].write_bytes(b"half a checkpoint")
    leftovers[1].mkdir()
    done = _train([*SMOKE, "ckpt_path=last", "trainer.max_steps=12", "test=false", f"hydra.run.dir={run}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(p.exists() for p in leftovers)


# --- item 8: a run that learned nothing says so ---------------------------------------------------------------------

_MODELS = """
import torch
from lightning_accel.examples import GPTLanguageModel


class NaNFromTheStart(GPTLanguageModel):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("nan")


class ReturnsNothing(GPTLanguageModel):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return None
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("NaNFromTheStart", "had a non-finite loss and NonFiniteGuard dropped every update"),
        ("ReturnsNothing", "ran a `training_step` that returned None"),
    ],
)
def test_a_run_that_learned_nothing_exits_1_with_the_reason(tmp_path: Path, model: str, message: str) -> None:
    (tmp_path / "badmodels.py").write_text(_MODELS)
    done = _train(
        [*SMOKE, f"model._target_=badmodels.{model}", "test=false", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert message in done.stderr


def test_nonfinite_guard_is_a_default_callback(compose_train) -> None:
    cfg = compose_train([])
    assert cfg.callbacks.nonfinite._target_.endswith("NonFiniteGuard") and cfg.callbacks.nonfinite.action == "skip"


# --- item 4: the DataLoaderTuner's cache ------------------------------------------------------------------------------


def _decision(key: str, prefetch: int = 2) -> object:
    from lightning_accel.tuning.dataloader.decision import TunerDecision
    from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings

    return TunerDecision(
        fingerprint=key,
        settings=LoaderSettings(num_workers=2, prefetch_factor=prefetch, persistent_workers=True),
        samples_per_s=100.0,
        wait_share=0.1,
    )


def test_a_cached_prefetch_factor_beyond_any_setting_is_a_miss(tmp_path: Path) -> None:
    """A cached `prefetch_factor` of 1,000,000,000 hung the run, about 12 minutes per iterator."""
    from lightning_accel.tuning.dataloader.cache import DecisionCache

    cache = DecisionCache(tmp_path / "cache.json")
    cache.put(_decision("k", prefetch=1_000_000_000))  # type: ignore[arg-type]
    assert cache.get("k", max_workers=8) is None
    cache.put(_decision("k", prefetch=4))  # type: ignore[arg-type]
    assert cache.get("k", max_workers=8) is not None


def test_a_cache_others_may_write_is_not_used(tmp_path: Path) -> None:
    from lightning_accel.errors import LightningAccelWarning
    from lightning_accel.tuning.dataloader.cache import DecisionCache

    cache = DecisionCache(tmp_path / "cache.json")
    cache.put(_decision("k"))  # type: ignore[arg-type]
    (tmp_path / "cache.json").chmod(0o666)
    with pytest.warns(LightningAccelWarning, match="writable by every user"):
        assert cache.get("k", max_workers=8) is None


def _writer(path: str, worker: int) -> None:
    from lightning_accel.tuning.dataloader.cache import DecisionCache

    cache = DecisionCache(path)
    for index in range(20):
        cache.put(_decision(f"w{worker}-{index}"))  # type: ignore[arg-type]


def test_concurrent_writers_keep_every_entry(tmp_path: Path) -> None:
    """8 concurrent writers kept 83 of 160 entries: the read-modify-write had no lock."""
    path = str(tmp_path / "cache.json")
    context = multiprocessing.get_context("fork")  # the writers share nothing but the file; fork starts them at once
    workers = [context.Process(target=_writer, args=(path, w)) for w in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    entries = json.loads(Path(path).read_text())["entries"]
    assert len(entries) == 160


# --- items 5 and 6: accel-bench and accel-tune ------------------------------------------------------------------------


def test_a_full_disk_while_the_report_is_written_truncates_nothing(tmp_path: Path, monkeypatch) -> None:
    """A traceback, bench.md truncated to 0 bytes, no CSV or JSON: each file is now whole or absent."""
    from lightning_accel.benchmark import bench_report as report
    from lightning_accel.benchmark.results import StageResult

    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.md").write_text("the earlier table\n")
    real = Path.write_text

    def full_disk(self: Path, data: str, *args, **kwargs) -> int:
        if self.name.endswith(".tmp") and "bench.csv" in self.name:
            real(self, data[:10], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        report.write_outputs([StageResult(name="baseline")], out, {}, "| table |", "title")
    assert (out / "bench.md").read_text() == "# title\n\n| table |\n"  # written whole before the failure
    assert not (out / "bench.csv").exists() and not list(out.glob(".*.tmp"))  # nothing half-written left


@pytest.mark.slow
@pytest.mark.parametrize(
    "module", ["lightning_accel.bench", pytest.param("lightning_accel.tune", marks=pytest.mark.slow)]
)
def test_sigterm_to_bench_or_tune_ends_the_stage_and_writes_the_outputs(tmp_path: Path, module: str) -> None:
    """The running stage's training process stayed behind, and accel-tune wrote no tune.md."""
    out = tmp_path / "out"
    args = ["--quick", "--out", str(out), "trainer.accelerator=cpu", "data.read_delay_ms=20"]
    args += (
        ["--steps", "200"]
        if module.endswith("bench")
        else ["--time-budget", "600", "--config-dir", str(tmp_path / "conf")]
    )
    log = (tmp_path / "log.txt").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=tmp_path,
        env=clean_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def stage() -> list[psutil.Process]:
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
            return [
                p
                for p in psutil.Process(proc.pid).children(recursive=True)
                if "lightning_accel.train" in " ".join(p.cmdline())
            ]

        stages = wait_until(stage, 180, "a stage's training process")
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
        gone, alive = psutil.wait_procs(stages, timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert code == 128 + signal.SIGTERM, (tmp_path / "log.txt").read_text()[-3000:]
    assert not alive, f"stage processes {[p.pid for p in alive]} outlived {module}"
    written = "bench.md" if module.endswith("bench") else "tune.md"
    assert (out / written).is_file()


# --- the same checks in process, for the default suite (the end-to-end runs above are under -m slow) ---------------


def test_unit_a_checkpoint_of_another_architecture(tmp_path: Path) -> None:
    from lightning_accel.checks import check_checkpoint_fits
    from lightning_accel.examples import GPTLanguageModel

    torch.save({"state_dict": GPTLanguageModel(n_embd=64).state_dict()}, tmp_path / "small.ckpt")
    check_checkpoint_fits(GPTLanguageModel(n_embd=64), str(tmp_path / "small.ckpt"))  # the same: fine
    with pytest.raises(ConfigError, match="saved by another model configuration.*differ in shape"):
        check_checkpoint_fits(GPTLanguageModel(n_embd=128), str(tmp_path / "small.ckpt"))


def test_unit_an_unwritable_checkpoint_dir_and_leftovers(tmp_path: Path) -> None:
    from lightning_accel.checks import check_checkpoint_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="`callbacks.model_checkpoint.dirpath=.*` cannot be written"):
        check_checkpoint_dir(OmegaConf.create({"callbacks": {"model_checkpoint": {"dirpath": str(tmp_path / "file")}}}))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".last.ckpt.accel-x1x1x1x1.tmp").write_bytes(b"half")
    (folder / ".last.ckpt.saving-1234abcd").mkdir()
    (folder / "last.ckpt").write_bytes(b"kept")
    check_checkpoint_dir(OmegaConf.create({"callbacks": {"model_checkpoint": {"dirpath": str(folder)}}}))
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]


def test_unit_a_missing_monitor_at_the_first_validation(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from _tiny import TinyRegression, tiny_loader
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accel.callbacks import RunStats

    class Logged(TinyRegression):
        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.log("val/loss", self.loss(batch))

    steps = []

    class Count(pl.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            steps.append(1)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        callbacks=[RunStats(), Count(), ModelCheckpoint(dirpath=tmp_path, monitor="val/nope")],
    )
    with pytest.raises(ConfigError, match="`ModelCheckpoint\\(monitor='val/nope'\\)` is not a metric this run logs"):
        trainer.fit(Logged(), tiny_loader(64), tiny_loader(16))
    assert steps == []  # the sanity check found it, before any training step


def test_unit_lightnings_refusal_of_a_trainer_setting_is_named() -> None:
    from types import SimpleNamespace

    from lightning_accel.checks import trainer_setting_error

    err = ValueError("`val_check_interval` (100000) must be less than or equal to the number of the training batches")
    cfg = OmegaConf.create({"trainer": {"val_check_interval": 100000}})
    named = trainer_setting_error(err, cfg, SimpleNamespace(global_step=0))
    assert isinstance(named, ConfigError) and str(named).startswith("`trainer.val_check_interval=100000`:")
    assert trainer_setting_error(err, cfg, SimpleNamespace(global_step=5)) is None  # not before launch any more


def test_unit_a_taken_master_port() -> None:
    import socket

    from lightning_accel.checks import check_master_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"`MASTER_PORT={port}` is taken"):
            check_master_port({"MASTER_PORT": str(port)})
        check_master_port({"MASTER_PORT": str(port), "LOCAL_RANK": "1"})  # a launched rank: the launcher's port


def test_unit_resuming_with_another_accumulation_warns(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from _tiny import TinyRegression, tiny_loader

    from lightning_accel.callbacks import RunStats
    from lightning_accel.errors import LightningAccelWarning

    first = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        callbacks=[RunStats()],
    )
    first.fit(TinyRegression(), tiny_loader(64))
    first.save_checkpoint(tmp_path / "a.ckpt")
    second = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        accumulate_grad_batches=2,
        default_root_dir=str(tmp_path),
        callbacks=[RunStats()],
    )
    with pytest.warns(
        LightningAccelWarning,
        match="accumulated accumulate_grad_batches=1 and now accumulates accumulate_grad_batches=2",
    ):
        second.fit(TinyRegression(), tiny_loader(64), ckpt_path=tmp_path / "a.ckpt", weights_only=True)


_DELETE = """
import shutil

import lightning.pytorch as pl


class Delete(pl.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            shutil.rmtree(self.path, ignore_errors=True)
"""


@pytest.mark.slow
def test_a_run_directory_removed_under_the_run_is_named(tmp_path: Path) -> None:
    (tmp_path / "delmod.py").write_text(_DELETE)
    run = tmp_path / "run"
    done = _train(
        [*SMOKE, "+callbacks.del._target_=delmod.Delete", f"+callbacks.del.path={run}", f"hydra.run.dir={run}"],
        tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 1 and f"the run directory {run} was removed while the run was going" in done.stderr
    assert "Traceback" not in done.stderr
