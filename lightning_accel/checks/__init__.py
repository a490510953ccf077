"""The checks made before anything is built or spawned, by what they check: a config's `trainer` settings
(`trainer_settings`), the other groups' settings (`group_settings`), their combinations (`combinations`), the
checkpoint a run would load (`checkpoints`), where it writes and how its ranks meet (`launch_environment`), the
DataLoader workers against the cgroup's memory (`worker_memory`); and the errors during a run they name
(`trainer_setting_error`, `training_step_error`, `worker_killed_error`). Each names the setting, the value and the fix
(`ConfigError`, exit 2).

The checks read the run's shape (`lightning_accel.shape`) and never build the plan: the caller takes the steps
in order, `run_shape(cfg)` -> `check_run(cfg, shape)` -> `run_plan.build_run_plan(cfg, checked)`.
"""

from __future__ import annotations

from lightning_accel.checks.checked_run import CheckedRun, check_config, check_run, resolve_config_precision
from lightning_accel.checks.checkpoints import (
    check_checkpoint_dir,
    check_checkpoint_fits,
    check_ckpt_path,
    check_hpc_checkpoint,
)
from lightning_accel.checks.combinations import check_combinations
from lightning_accel.checks.launch_environment import OUTPUT_DIR_KEYS, check_master_port, check_output_dirs
from lightning_accel.checks.step_errors import training_step_error
from lightning_accel.checks.trainer_settings import trainer_setting_error
from lightning_accel.checks.worker_memory import check_loader_memory, oom_kills, worker_killed_error

__all__ = [
    "OUTPUT_DIR_KEYS",
    "CheckedRun",
    "check_checkpoint_dir",
    "check_checkpoint_fits",
    "check_ckpt_path",
    "check_combinations",
    "check_config",
    "check_hpc_checkpoint",
    "check_loader_memory",
    "check_master_port",
    "check_output_dirs",
    "check_run",
    "oom_kills",
    "resolve_config_precision",
    "trainer_setting_error",
    "training_step_error",
    "worker_killed_error",
]
