"""The project's exception and warning classes.

One family for users' mistakes: `ConfigError` (a `ValueError`) and `ConfigTypeError` (also a `TypeError`), so
`except ValueError` / `except TypeError` in a user's script keeps working. A library constructor names its own
arguments (`n_stages=3`), not a Hydra path; it passes `setting="n_stages"`, and the composition layer, which knows
where the value came from, rewrites the message with `err.at("trainer.strategy")` to say `trainer.strategy.n_stages=3`.
"""

from __future__ import annotations

import re
from collections.abc import Container

__all__ = [
    "ConfigError",
    "ConfigTypeError",
    "LightningAccelError",
    "LightningAccelWarning",
    "NonFiniteLossError",
    "NothingLearnedError",
    "PreflightError",
    "WorkerKilledError",
    "named_argument",
]


class LightningAccelError(Exception):
    """Base class of lightning_accel's errors."""


class ConfigError(LightningAccelError, ValueError):
    """A setting that cannot work; the message names the setting, the value received and the fix.

    Args:
        message: the whole message, naming the setting as a constructor argument in backticks (`` `n_stages=3` ``).
        setting: the argument's name when the error is about one argument; `at(prefix)` then rewrites every
            backticked mention of it (`` `n_stages `` -> `` `trainer.strategy.n_stages ``).
    """

    def __init__(self, message: str = "", *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting

    def at(self, prefix: str) -> ConfigError:
        """The same error, of the same class, with the setting named by its config path under `prefix`
        (e.g. `"trainer.strategy"`); an error without a `setting`, or one already under `prefix`, comes back as is."""
        message = str(self)
        if not self.setting or not prefix or self.setting.startswith(f"{prefix}."):
            return self
        pattern = re.compile(r"`" + re.escape(self.setting) + r"(?=[`=\[.])")
        moved = pattern.sub(f"`{prefix}.{self.setting}", message)
        if moved == message:
            return self
        err = type(self).__new__(type(self))
        Exception.__init__(err, moved)
        err.setting = f"{prefix}.{self.setting}"
        err.__cause__, err.__traceback__ = self.__cause__, self.__traceback__
        return err


_NAMED = re.compile(r"`(\w+)[=`\[]|\((\w+)=")


def named_argument(err: ConfigError, arguments: Container[str]) -> ConfigError | None:
    """`err` with `setting` set to the one of `arguments` it is about: its own `setting`, else the first name its
    message gives (`` `name=value` ``, `` `name` ``, `Class(name=value)`); None when it names none of them. The
    composition layer then names the config path (`err.at(prefix)`)."""
    found = [a or b for a, b in _NAMED.findall(str(err))]
    setting = err.setting or next((name for name in found if name in arguments), None)
    if setting is None or setting not in arguments:
        return None
    return err if err.setting == setting else type(err)(str(err), setting=setting)


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (a string where a number belongs); otherwise as `ConfigError`."""


class NonFiniteLossError(LightningAccelError):
    """Training met a NaN/inf loss under `NonFiniteGuard(action="raise")`; the message names the step and checkpoint."""


class PreflightError(LightningAccelError):
    """A `Preflight` check failed before the first step; the message names the node, rank, check and fix."""


class LightningAccelWarning(UserWarning):
    """Warnings of lightning_accel (filter them with `warnings.filterwarnings("ignore", category=...)`)."""


class WorkerKilledError(LightningAccelError):
    """A DataLoader worker was killed (SIGKILL), named with its cause where the cgroup shows it (its memory limit's
    OOM kills) and the checkpoint that stands. accel-train exits 1 with the message (no traceback)."""


class NothingLearnedError(LightningAccelError):
    """A run that ended without a result to keep: every `training_step` returned None, the loss it ended on is
    NaN/inf, or its run directory was removed under it. accel-train exits 1 with the message (no traceback)."""
