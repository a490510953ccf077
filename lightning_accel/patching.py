"""The one way this package patches an attribute (of a Lightning object, a module, a thread): replace it, get back
its undo. Lightning's private attributes are patched only through `_lightning`, which calls this."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["patch_attribute"]

_MISSING = object()


def patch_attribute(obj: Any, name: str, value: Any, *, why: str = "") -> Callable[[], None]:
    """Set `obj.name = value` and return the undo, which puts back exactly what was there before: the instance's
    own attribute, or none (so a method of the class shows through again). Call the undo in both `teardown` and
    `on_exception` (Lightning skips `teardown` after an exception), e.g. through an `ExitStack`; calling it twice is
    harmless.

    Args:
        obj: the object to patch (a loop, a strategy, a module instance, a module).
        name: the attribute; it must exist already (a Lightning version without it is refused, not silently
            extended).
        value: what to put there.
        why: what the patch is for, named in the error.

    Raises:
        RuntimeError: when `obj` has no attribute `name` (another Lightning version), naming both and `why`.
    """
    if not hasattr(obj, name):
        lightning = sys.modules.get("lightning")  # named where loaded; this module never imports it
        raise RuntimeError(
            f"`{type(obj).__name__}.{name}` does not exist"
            + (f" in this Lightning {lightning.__version__}" if lightning is not None else "")
            + (f"; {why} needs it" if why else "")
            + ": use Lightning 2.x, or leave the feature out."
        )
    own = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name)
    setattr(obj, name, value)
    done = False

    def undo() -> None:
        nonlocal done
        if done:
            return
        done = True
        if own is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, own)

    return undo
