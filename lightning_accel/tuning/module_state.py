"""State a LightningModule carries on itself from one `training_step` call to the next, found by comparing.

Searches that run the user's `training_step` (MicroBatchFinder's pieces, DataLoaderTuner's trials) must know what a
call leaves behind besides gradients and buffers: an RNN's hidden state kept on `self`, an RL agent's environment and
replay buffer, a counter. No rule can tell that from the code, so it is read from the module itself:

- `fingerprint(module)`: a cheap summary of every attribute the module and its submodules hold that is not a
  parameter, a buffer, a submodule or Lightning's own bookkeeping: values of numbers and strings, identity, shape and
  in-place version of tensors, identity and length of containers, and plain objects' attributes two levels deep.
  Identity is a `_Same` token (a weak reference where the object takes one), not `id()`: a tensor freed by a call
  and a new one made at its address by the next would share an `id` and read as unchanged;
- `changed(before, after)`: the attributes whose summary differs, by their path (`hidden`, `agent.replay_buffer`);
- `Snapshot.take(module)` / `snapshot.restore()`: copies of what is cheap to copy (numbers, strings, None, tensors
  and tuples or lists of them), put back after a search, and the names of what changed that could not be.

A lazily built cache (a mask or a positional table made on the first call and reused) changes once, on the first
call; carried state changes on every call. Compare after two calls, not before the first, to tell them apart.
torchmetrics' metric modules are left out: their states accumulate over calls by design.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accel import _lightning

__all__ = ["Snapshot", "changed", "fingerprint"]

_DEPTH = 2  # plain objects (an agent, its buffer) are summarised this many levels down
_MAX_COPY_NUMEL = 1 << 22  # tensors up to 4 Mi elements are copied by a Snapshot (16 MiB of fp32)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


@functools.cache
def _internal_names() -> frozenset[str]:
    """Attributes of torch's and Lightning's own making on a module (hooks, device, trainer, hparams, flags)."""
    import lightning.pytorch as pl

    names = set(vars(nn.Module())) | set(vars(pl.LightningModule()))
    return frozenset(names)


def _is_metric(module: nn.Module) -> bool:
    """torchmetrics' Metric (its states accumulate over updates on purpose), recognised without importing it."""
    return isinstance(getattr(module, "_defaults", None), dict) and hasattr(module, "_update_count")


def _own_attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, value) of what `module` holds itself: not parameters, buffers, submodules or internals."""
    internal, hparams = _internal_names(), _lightning.hyperparameter_attribute_prefix()
    for name, value in vars(module).items():
        if name in internal or name.startswith((hparams, "__")) or isinstance(value, nn.Module):
            continue
        if callable(value) and not isinstance(value, (torch.Tensor, nn.Module)) and not hasattr(value, "__dict__"):
            continue  # functions and builtins: code, not state
        yield name, value


class _Same:
    """An object's identity in a fingerprint, which never keeps the object alive. Where the object takes a weak
    reference (tensors, arrays, plain objects), the token is equal to another token of the same object while it
    lives, and never once it is gone: an object built at a freed one's address is not the same. Lists, tuples and
    dicts take none: their token is their `id()`, and what they hold is summarised by tokens of its own."""

    __slots__ = ("_id", "_ref")

    def __init__(self, value: Any) -> None:
        self._id = id(value)
        try:
            self._ref: weakref.ref[Any] | None = weakref.ref(value)
        except TypeError:
            self._ref = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same):
            return NotImplemented
        if self._ref is None or other._ref is None:
            return self._ref is other._ref and self._id == other._id
        mine = self._ref()
        return mine is not None and mine is other._ref()

    def __hash__(self) -> int:
        return self._id

    def __repr__(self) -> str:
        gone = self._ref is not None and self._ref() is None
        return f"_Same({self._id:#x}{', gone' if gone else ''})"


def _summary(value: Any, depth: int) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", _Same(value), tuple(value.shape), value.dtype, value._version)
    if isinstance(value, (list, tuple, dict, set, frozenset)) or hasattr(value, "maxlen"):
        items = list(value.values()) if isinstance(value, dict) else list(value) if not isinstance(value, set) else []
        inner = tuple(_summary(item, depth - 1) for item in items[:8]) if depth > 0 and len(items) <= 8 else ()
        last = _Same(items[-1]) if items else None
        return ("container", type(value).__name__, _Same(value), len(value), last, inner)
    array = getattr(value, "__array_interface__", None)
    if array is not None:  # a numpy array: its bytes when small
        nbytes = getattr(value, "nbytes", 1 << 30)
        return ("array", _Same(value), array.get("shape"), value.tobytes() if nbytes <= 1 << 16 else None)
    if isinstance(value, nn.Module) or callable(value) and not hasattr(value, "__dict__"):
        return ("object", _Same(value))
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and depth > 0:
        inner = tuple(sorted(((k, _summary(v, depth - 1)) for k, v in attributes.items()), key=lambda kv: kv[0]))
        return ("object", _Same(value), inner)
    return ("object", _Same(value))


def fingerprint(module: nn.Module) -> dict[str, Any]:
    """A summary of every attribute `module` and its submodules carry besides parameters, buffers and internals, by
    dotted path (`hidden`, `model.src_mask`, `agent`); torchmetrics metrics are left out."""
    summary: dict[str, Any] = {}
    for prefix, sub in module.named_modules():
        if _is_metric(sub):
            continue
        for name, value in _own_attributes(sub):
            summary[f"{prefix}.{name}" if prefix else name] = _summary(value, _DEPTH)
    return summary


def changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The paths whose summary differs between two fingerprints (added or removed ones too), sorted."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k, _MISSING) != after.get(k, _MISSING))


_MISSING = object()


def _cheap_copy(value: Any) -> tuple[bool, Any]:
    """(True, a copy) for numbers, strings, None, tensors up to `_MAX_COPY_NUMEL` and tuples/lists of them."""
    if isinstance(value, _SCALARS):
        return True, value
    if isinstance(value, torch.Tensor):
        if value.numel() > _MAX_COPY_NUMEL:
            return False, None
        return True, value.detach().clone()
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        copies = [_cheap_copy(item) for item in value]
        if all(ok for ok, _ in copies):
            return True, type(value)(copy for _, copy in copies)
    return False, None


@dataclass
class Snapshot:
    """The module's carried state before a search, to put back after it."""

    module: nn.Module
    before: dict[str, Any] = field(default_factory=dict)
    copies: dict[str, tuple[nn.Module, str, Any]] = field(default_factory=dict)

    @classmethod
    def take(cls, module: nn.Module) -> Snapshot:
        snapshot = cls(module, fingerprint(module))
        for prefix, sub in module.named_modules():
            if _is_metric(sub):
                continue
            for name, value in _own_attributes(sub):
                ok, copy = _cheap_copy(value)
                if ok:
                    snapshot.copies[f"{prefix}.{name}" if prefix else name] = (sub, name, copy)
        return snapshot

    def restore(self) -> tuple[list[str], list[str]]:
        """Put back every changed attribute that was copied; returns (restored, changed but not restorable)."""
        differ = changed(self.before, fingerprint(self.module))
        restored, lost = [], []
        for path in differ:
            if path in self.copies:
                owner, name, copy = self.copies[path]
                ok, fresh = _cheap_copy(copy)  # a new copy: the snapshot can be restored again
                setattr(owner, name, fresh if ok else copy)
                restored.append(path)
            elif path in self.before:
                lost.append(path)
            else:  # made by the search (a lazily built cache): removed again
                owner_path, _, name = path.rpartition(".")
                owner = self.module.get_submodule(owner_path) if owner_path else self.module
                if name in vars(owner):
                    delattr(owner, name)
                    restored.append(path)
        return restored, lost
