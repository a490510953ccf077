"""accel-train's start: the entry (`lightning_accel.train_entry`) sets the thread environment and hands off to the
command by name; Hydra's own answers come before torch and Lightning load; the thread environment is in force when
torch loads (the wait policy's own tests: tests/test_thread_env.py)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_accel.thread_env import PLANNED_ENV

HEAVY = ("torch", "lightning", "pytorch_lightning", "matplotlib", "prometheus_client", "starlette", "uvicorn")
"""What Hydra's answers must not load: a run's libraries and those of the reports, metrics and the dash."""

_ANSWER = """
import json, sys
heavy = set(json.loads(sys.argv[2]))
sys.argv = ["accel-train", *json.loads(sys.argv[1])]
from lightning_accel.train_entry import accel_train
try:
    accel_train()
    code = 0
except SystemExit as stop:
    code = stop.code
loaded = sorted({name.split(".")[0] for name in sys.modules} & heavy)
print("\\n" + json.dumps({"code": code, "loaded": loaded}))
"""


def _answer(args: list[str], cwd: Path) -> tuple[int, list[str], str, str]:
    """Run accel-train's entry with `args` in a fresh interpreter: its exit code, the heavy modules it loaded, its
    output and its error stream."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"ACCEL_LOG_DIR": str(cwd / "outputs")}
    done = subprocess.run(
        [sys.executable, "-c", _ANSWER, json.dumps(args), json.dumps(HEAVY)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    head, _, last = done.stdout.rstrip().rpartition("\n")
    result = json.loads(last)
    return result["code"], result["loaded"], head, done.stderr


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--help"], 0, r"== Configuration groups ==[\s\S]*precision: [\s\S]*== Config ==[\s\S]*trainer:"),
        (["--cfg", "job", "trainer.max_steps=7"], 0, r"trainer:\n(  .*\n)*  max_steps: 7"),
        (["trainer.maxx_steps=3"], 2, r"^accel-train: error: `trainer.maxx_steps`"),
        (["precision=fp64x"], 2, r"^accel-train: error: .*`precision=fp64x`"),
        (["trainer.max_steps=[1"], 2, r"^accel-train: error: .*`trainer.max_steps=\[1`"),
    ],
    ids=["help", "cfg-job", "unknown-key", "unknown-option", "bad-syntax"],
)
def test_hydra_answers_before_torch_or_lightning_load(args: list[str], code: int, says: str, tmp_path: Path) -> None:
    exit_code, loaded, out, err = _answer(args, tmp_path)
    assert exit_code == code, err[-3000:]
    assert re.search(says, out if code == 0 else err.strip(), re.MULTILINE), (out[-2000:], err[-2000:])
    assert loaded == [], f"accel-train {' '.join(args)} loaded {loaded} before answering"
    assert not (tmp_path / "outputs").exists()  # nothing ran: no run directory


def test_the_entry_does_not_import_the_command(tmp_path: Path) -> None:
    """The entry imports only what sets the environment; the command is imported by name when it runs."""
    script = "import json, sys, lightning_accel.train_entry as e; print(json.dumps([e.COMMAND, sorted(sys.modules)]))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    command, loaded = json.loads(done.stdout)
    assert command == "lightning_accel.train" and command not in loaded
    assert not {name.split(".")[0] for name in loaded} & {*HEAVY, "hydra", "omegaconf"}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["console", "module"])
def test_the_wait_policy_is_set_before_torch_loads_in_a_run(entry: str, tmp_path: Path) -> None:
    """`accel-train` (the console entry) and `python -m lightning_accel.train`: libgomp loads with
    OMP_WAIT_POLICY=PASSIVE (spin count 0 in what OMP_DISPLAY_ENV prints; 300000 when set too late)."""
    args = ["check=true", "trainer.accelerator=cpu", "trainer=smoke"]
    if entry == "console":
        command = [sys.executable, "-c", "from lightning_accel.train_entry import accel_train; accel_train()"]
    else:
        command = [sys.executable, "-m", "lightning_accel.train"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", PLANNED_ENV)}
    env |= {"OMP_DISPLAY_ENV": "VERBOSE", "ACCEL_LOG_DIR": str(tmp_path / "outputs")}
    done = subprocess.run([*command, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the config is valid" in done.stdout
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr) == ["0"], done.stderr[-3000:]


def test_help_shares_the_config_store_and_says_the_same(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The help's config store is shared, not copied per group, and the help is the same as with copies; the store
    is left as it was."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    from lightning_accel import train

    store = ConfigStore.instance()
    with train._config_store_shared():
        assert copy.deepcopy(store) is store
    assert copy.deepcopy(store) is not store and "__deepcopy__" not in vars(store)

    helps = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(train, "_config_store_shared", contextlib.nullcontext)
        monkeypatch.setattr(sys, "argv", ["accel-train", "--help"])
        GlobalHydra.instance().clear()
        with pytest.raises(SystemExit) as exited:
            train.main()
        assert exited.value.code in (None, 0)
        helps.append(capsys.readouterr().out)
    assert "== Configuration groups ==" in helps[0] and helps[0] == helps[1]
    assert "__deepcopy__" not in vars(store)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("trainer.maxx_steps=3", "`trainer.maxx_steps`"),  # a key the config lacks
        ("model=nope", "`model=nope` is not an option"),  # an option the group lacks
        ("trainer.max_steps=[", "cannot be read"),  # an override Hydra cannot parse
    ],
)
def test_a_config_that_does_not_compose_is_told_from_the_first_composition(
    override: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path
) -> None:
    """Hydra composes a run twice (to read `hydra.mode`, then for the run); the error comes from the first, once,
    and Hydra's `get_mode` is put back after."""
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra

    from lightning_accel import train

    original_get_mode, original_compose = Hydra.get_mode, Hydra.compose_config
    composed = []

    def counting(self: Hydra, *args, **kwargs):
        composed.append(kwargs.get("run_mode"))
        return original_compose(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counting)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["accel-train", override])
    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as exited:
        train.main()
    assert exited.value.code == 2
    assert len(composed) == 1, composed
    assert said in capsys.readouterr().err
    assert Hydra.get_mode is original_get_mode
