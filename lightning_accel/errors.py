"""The project's exception and warning classes.

One family for users' mistakes: `ConfigError` (a `ValueError`) and `ConfigTypeError` (also a `TypeError`), so
`except ValueError` / `except TypeError` in a user's script keeps working. A library constructor names its own
arguments (`n_stages=3`), not a Hydra path; it passes `setting="n_stages"`, and the composition layer, which knows
where the value came from, rewrites the message with `err.at("trainer.strategy")` to say `trainer.strategy.n_stages=3`.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Container

__all__ = [
    "AgentWarning",
    "ConfigError",
    "ConfigTypeError",
    "FileOperationError",
    "LightningAccelError",
    "LightningAccelWarning",
    "NonFiniteLossError",
    "NothingLearnedError",
    "PreflightError",
    "RunFailedError",
    "UsageCorruptWarning",
    "UsageStoreWarning",
    "WorkerKilledError",
    "describe_os_error",
    "named_argument",
    "os_error_words",
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


class AgentWarning(LightningAccelWarning):
    """A round of `accel-dash agent` that failed in part (its file not written, its usage record failed); the agent
    goes on with the next round."""


class UsageStoreWarning(LightningAccelWarning):
    """A usage database (accel-dash's usage kept) that cannot be read or written now: locked, read-only, on a network
    filesystem; the writer keeps the interval for its next try, the view goes on without that database."""


class UsageCorruptWarning(UsageStoreWarning):
    """A usage database file that is not a SQLite database or is damaged; the view goes on without it."""


class WorkerKilledError(LightningAccelError):
    """A DataLoader worker was killed (SIGKILL), named with its cause where the cgroup shows it (its memory limit's
    OOM kills) and the checkpoint that stands. accel-train exits 1 with the message (no traceback)."""


class NothingLearnedError(LightningAccelError):
    """A run that ended without a result to keep: every `training_step` returned None, the loss it ended on is
    NaN/inf, or its run directory was removed under it. accel-train exits 1 with the message (no traceback)."""


def os_error_words(err: OSError) -> str:
    """What the operating system said, in words and by name: `No space left on device (ENOSPC)`."""
    number = err.errno
    words = err.strerror or (os.strerror(number) if number else str(err))
    name = errno.errorcode.get(number) if isinstance(number, int) else None
    return f"{words} ({name})" if name else words


class FileOperationError(LightningAccelError, OSError):
    """An operating-system failure on a file, named: `cannot <operation> <file>: <the OS's words> (<ERRNO>)`, then
    what still stands where that is known (`; /run/checkpoints/last.ckpt of step 40 still stands`).

    An `OSError` with the original's `errno` and `strerror` and the file as `filename`, so `except OSError` and
    `err.errno == errno.ENOSPC` keep working; the original is its `__cause__`.

    Args:
        operation: what was being done, as a verb phrase (`write checkpoint`, `create directory`).
        path: the file or directory it was done to.
        err: the operating system's error.
        detail: what still stands, or the fix, added after a semicolon.
    """

    def __init__(self, operation: str, path: str | os.PathLike[str], err: OSError, detail: str = "") -> None:
        super().__init__(err.errno, err.strerror or str(err), os.fspath(path))
        self.operation = operation
        self.detail = detail
        self.__cause__ = err

    def __str__(self) -> str:
        text = f"cannot {self.operation} {self.filename}: {os_error_words(self)}"
        return f"{text}; {self.detail}" if self.detail else text

    def __reduce__(self) -> tuple[object, ...]:
        plain = OSError(self.errno, self.strerror)
        return (type(self), (self.operation, self.filename, plain, self.detail))


def describe_os_error(err: OSError) -> str:
    """An OS failure named: a `FileOperationError` as it says itself; any other `OSError` by its words, errno and
    file(s) (`No space left on device (ENOSPC): /run/metrics.csv`)."""
    if isinstance(err, FileOperationError):
        return str(err)
    files = [str(name) for name in (err.filename, getattr(err, "filename2", None)) if name is not None]
    return os_error_words(err) + (f": {' -> '.join(files)}" if files else "")


class RunFailedError(LightningAccelError):
    """A run that failed while running for a reason the message names (an OS failure on a file: a full disk, a
    read-only directory; a `training_step` whose output Lightning cannot train on), with the rank and the step.
    accel-train exits 1 with the message (no traceback)."""
