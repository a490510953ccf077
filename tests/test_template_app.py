"""lightning-hydra-template, taken as it is: its files (tests/template_app/upstream, unchanged) plus exactly the patch
blocks of the guide's "From lightning-hydra-template" section, plus an offline datamodule (the template's MNIST
needs a download). Each run adds a probe callback that records what every rank really ran: world size, samples per
optimizer step, the LR of every step, torch's matmul precision inside training."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _env import clean_env

APP = Path(__file__).parent / "template_app"
GUIDE = Path(__file__).parents[1] / "examples" / "your_own_app.md"
SECTION = "## From lightning-hydra-template"


def guide_patch() -> str:
    """The ```diff blocks of the guide's template section, in order: what a user applies."""
    text = GUIDE.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"```diff\n(.*?)```", section, re.S)
    assert len(blocks) == 4, f"the guide's template section should hold 4 diff blocks, found {len(blocks)}"
    return "".join(blocks)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The template app: upstream files, the guide's patch applied with `git apply`, the offline datamodule."""
    app = tmp_path_factory.mktemp("template") / "app"
    shutil.copytree(APP / "upstream", app)
    done = subprocess.run(
        ["git", "apply", "--verbose", "-"], input=guide_patch(), cwd=app, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"the guide's patch does not apply to the template:\n{done.stderr}"
    shutil.copytree(APP / "overlay", app, dirs_exist_ok=True)
    return app


def run_template(
    app: Path,
    tmp_path: Path,
    *overrides: str,
    timeout: float = 420,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[dict[int, dict], str]:
    """`python src/train.py data=digits trainer.max_epochs=2 <overrides>` in the app; the probe's record of every
    rank, and the output."""
    probe = tmp_path / "probe"
    # test=False: the template at bddbc24 pickles its net and optimizer partials into the checkpoint hyperparameters,
    # which torch >= 2.6 refuses to load weights-only; its test phase fails without this package too (README)
    args = [
        "data=digits",
        "trainer.max_epochs=2",
        "test=False",
        "+callbacks.probe._target_=probe.Probe",
        f"+callbacks.probe.path={probe}",
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    ]
    environment = clean_env(
        PYTHONPATH=os.pathsep.join([str(APP), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1", **(env or {})
    )
    done = subprocess.run(
        [*(command or [sys.executable]), "src/train.py", *args],
        cwd=app,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    records = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in probe.glob("rank*.json")}
    assert records, output[-3000:]
    return records, output


QUICK_TUNER = ["callbacks.dataloader_tuner.max_tuning_time_s=10", "callbacks.dataloader_tuner.steps_per_trial=4"]
"""A preset's DataLoaderTuner in a few seconds: the tests check that the setting is applied, not the sweep's choice."""


def samples_per_step(records: dict[int, dict]) -> list[int]:
    """Samples of each optimizer step over all ranks."""
    per_rank = [[s["samples"] for s in r["steps"]] for r in records.values()]
    return [sum(step) for step in zip(*per_rank, strict=True)]


def test_the_guides_patch_applies_to_the_template_as_it_is(template: Path) -> None:
    train = (template / "src" / "train.py").read_text()
    assert "check_app_config(cfg)" in train and "with hydra_safe_launch(trainer):" in train
    assert "- preset: null" in (template / "configs" / "train.yaml").read_text()


@pytest.mark.slow
def test_ddp_sim_trains_on_two_processes_and_exits_zero(template: Path, tmp_path: Path) -> None:
    """The template's own `trainer=ddp_sim` (`ddp_spawn`): it crashed after a finished fit ("'SpawnProcess' object
    has no attribute 'wait'") and exited 1."""
    records, _ = run_template(template, tmp_path, "trainer=ddp_sim")
    assert sorted(records) == [0, 1] and {r["world_size"] for r in records.values()} == {2}
    assert len({r["pid"] for r in records.values()}) == 2
    assert records[0]["epochs"] == 2 and records[0]["global_step"] == len(records[0]["steps"])
    assert samples_per_step(records)[0] == 128  # the template's batch of 128, 64 per device


@pytest.mark.slow
class TestEverySettingIsApplied:
    """The issue's matrix: each choice, from the template's command line, trains and does what it says."""

    def test_preset_amp(self, template: Path, tmp_path: Path) -> None:
        records, output = run_template(template, tmp_path, "preset=amp", *QUICK_TUNER)
        rank0 = records[0]
        assert rank0["world_size"] == 1 and "DataLoaderTuner" in rank0["callbacks"]
        assert rank0["float32_matmul_precision"] == "high"  # it stayed `highest`: nothing read the key
        assert "MatmulPrecision: precision=" in output and "(amp: " in output  # why amp chose what it chose

    def test_preset_ddp_keeps_the_two_devices_of_ddp_sim(self, template: Path, tmp_path: Path) -> None:
        records, output = run_template(template, tmp_path, "preset=ddp", "trainer=ddp_sim", *QUICK_TUNER)
        assert sorted(records) == [0, 1] and records[0]["strategy"] == "DDPStrategy", output[-3000:]  # one before
        assert {r["float32_matmul_precision"] for r in records.values()} == {"high"}
        assert "your trainer config's `trainer.devices=2` is kept" in output

    def test_scheduler_onecycle_drives_the_lr(self, template: Path, tmp_path: Path) -> None:
        records, _ = run_template(template, tmp_path, "scheduler=onecycle", "trainer=ddp_sim")
        lrs = [s["lr"] for s in records[0]["steps"]]
        peak = max(lrs)
        assert peak == pytest.approx(1e-3, rel=0.05) and lrs[0] == pytest.approx(1e-3 / 25, rel=0.05)
        assert lrs[-1] < peak / 1000 and len(set(lrs)) == len(lrs)  # a new LR every step (it stayed at 1e-3)

    def test_accumulation_global_batch(self, template: Path, tmp_path: Path) -> None:
        records, output = run_template(
            template,
            tmp_path,
            "accumulation=global_batch",
            "callbacks.accumulation.global_batch_size=256",
            "trainer=ddp_sim",
        )
        steps, epochs = samples_per_step(records), [s["epoch"] for s in records[0]["steps"]]
        last_of_epoch = {max(i for i, e in enumerate(epochs) if e == epoch) for epoch in set(epochs)}
        assert {n for i, n in enumerate(steps) if i not in last_of_epoch} == {256}  # an epoch's last may be partial
        assert len(set(epochs)) == 2
        assert "global batch 256 = 64 per device x 2 device(s) x 2 micro-batches" in output

    def test_micro_batch_auto(self, template: Path, tmp_path: Path) -> None:
        records, _ = run_template(template, tmp_path, "micro_batch=auto", "trainer=ddp_sim")
        assert "MicroBatchFinder" in records[0]["callbacks"] and sorted(records) == [0, 1]
        assert samples_per_step(records)[0] == 128  # the global batch kept

    def test_compile_default(self, template: Path, tmp_path: Path) -> None:
        records, _ = run_template(template, tmp_path, "compile=default")
        assert "Compile" in records[0]["callbacks"] and records[0]["epochs"] == 2


@pytest.mark.slow
def test_a_dropped_callback_warns_and_one_removed_on_purpose_does_not(template: Path, tmp_path: Path) -> None:
    _, output = run_template(template, tmp_path / "a", "debug=default", "accumulation=schedule")
    assert "`accumulation=schedule` adds `callbacks.accumulation`, but the composed config has no such" in output
    assert "`debug=default` empties `callbacks` after it" in output
    _, output = run_template(template, tmp_path / "b", "preset=amp", "~callbacks.dataloader_tuner")
    assert "adds `callbacks.dataloader_tuner`" not in output  # removed on purpose: no warning


@pytest.mark.slow
def test_a_scheduler_nothing_reads_warns_naming_where_the_model_expects_it(template: Path, tmp_path: Path) -> None:
    """The template's own model config (without the guide's step 2) reads `model.scheduler`: `scheduler=onecycle`
    writes a key nothing reads, and says so."""
    original = (APP / "upstream" / "configs" / "model" / "mnist.yaml").read_text()
    (template / "configs" / "model" / "unpatched.yaml").write_text(original)
    _, output = run_template(template, tmp_path, "model=unpatched", "scheduler=onecycle", "trainer.max_epochs=1")
    assert (
        "`scheduler=onecycle` sets the top-level `scheduler`, but nothing in your config reads it; your model "
        "reads `model.scheduler` (torch.optim.lr_scheduler.ReduceLROnPlateau) instead" in output
    )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_ranks(records: dict[int, dict]) -> None:
    assert sorted(records) == [0, 1] and {r["world_size"] for r in records.values()} == {2}
    assert len({r["pid"] for r in records.values()}) == 2 and {r["epochs"] for r in records.values()} == {2}
    assert samples_per_step(records)[0] == 128


@pytest.mark.slow  # ~20 s; the template's own ddp_spawn and our DDP multirun run by default
def test_ddp_relaunches_its_child_rank_inside_the_hydra_job(template: Path, tmp_path: Path) -> None:
    """`strategy=ddp` starts rank 1 by running the script again (Lightning issue #11300): through
    `hydra_safe_launch` it joins this job's run directory, and the job exits 0."""
    records, _ = run_template(template, tmp_path, "trainer=ddp_sim", "trainer.strategy=ddp")
    _two_ranks(records)
    assert not (tmp_path / "run" / "multirun.yaml").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook"])
def test_fork_launchers(template: Path, tmp_path: Path, strategy: str) -> None:
    records, _ = run_template(template, tmp_path, "trainer=ddp_sim", f"trainer.strategy={strategy}")
    _two_ranks(records)


@pytest.mark.slow
def test_torchrun(template: Path, tmp_path: Path) -> None:
    """torchrun starts both ranks; Lightning joins them (no launching of its own), each runs the Hydra app."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    records, _ = run_template(template, tmp_path, "trainer=ddp_sim", "trainer.strategy=ddp", command=command)
    _two_ranks(records)


@pytest.mark.slow
def test_slurm(template: Path, tmp_path: Path) -> None:
    """Two tasks of a SLURM job step, as `srun --ntasks=2` starts them (the variables it sets): Lightning's
    SLURMEnvironment joins them, each runs the Hydra app into the same run directory."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "localhost",
            "MASTER_PORT": port,
        }
        environment = clean_env(PYTHONPATH=os.pathsep.join([str(APP), os.environ.get("PYTHONPATH", "")]), **env)
        args = [
            "data=digits",
            "trainer.max_epochs=2",
            "test=False",
            "trainer=ddp_sim",
            "trainer.strategy=ddp",
            "+callbacks.probe._target_=probe.Probe",
            f"+callbacks.probe.path={tmp_path / 'probe'}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
        log = (tmp_path / f"task{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "src/train.py", *args],
                cwd=template,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    codes = [p.wait(timeout=420) for p in procs]
    assert codes == [0, 0], (tmp_path / "task0.log").read_text()[-3000:] + (tmp_path / "task1.log").read_text()[-3000:]
    records = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in (tmp_path / "probe").glob("*.json")}
    _two_ranks(records)


def test_the_groups_types_hold_in_the_template(template: Path) -> None:
    """The template's own trainer, callbacks and model configs around this package's groups: a wrong type is refused
    while composing, by name, and `check_app_config` names a value the types cannot refuse, before anything runs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from lightning_accel.compose import check_app_config
    from lightning_accel.errors import ConfigError
    from lightning_accel.schema import MicroBatchFinderConfig, OneCycleScheduleConfig, composition_error

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(template / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=["data=digits", "micro_batch=auto", "scheduler=onecycle"])
            assert OmegaConf.get_type(cfg.callbacks.micro_batch) is MicroBatchFinderConfig
            assert OmegaConf.get_type(cfg.model.scheduler) is OneCycleScheduleConfig  # through ${oc.select:scheduler}
            with pytest.raises(ConfigCompositionException) as raised:
                compose("train", overrides=["data=digits", "micro_batch=auto", "callbacks.micro_batch.grow_after=x"])
            assert str(composition_error(raised.value)).startswith("`callbacks.micro_batch.grow_after=x`: Value 'x'")
            bad = compose("train", overrides=["data=digits", "scheduler=onecycle", "scheduler.pct_start=2"])
            with pytest.raises(ConfigError, match=r"`scheduler.pct_start=2.0` must be a finite number within \(0, 1\)"):
                check_app_config(bad)
    finally:
        GlobalHydra.instance().clear()
