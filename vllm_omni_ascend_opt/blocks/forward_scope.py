"""Per-forward decisions: one scope per transformer forward, so that what is the same for every block of a forward
is decided once, at the first block that asks, and never outlives the forward.

Why: the patched block code used to ask the same questions in every block (is autograd recording, is a graph being
captured, which memo entry holds this temb, which kernel runs RoPE for this dtype, which tables belong to these
freqs). Their answers cannot change within one transformer forward (vLLM-Omni's transformer runs its blocks one after
the other, with the same ``temb``, freqs and process state), but they can change between forwards.

How: an optimization that makes per-forward decisions :func:`watch` es each transformer it is attached to (the first
watcher registers a forward pre-hook and an ``always_call`` forward hook on it; the last :func:`unwatch` removes
them). The pre-hook opens a :class:`Scope` (a fresh decision table), the hook closes it, also when the forward raises.
Patched code asks :func:`decide` ``(key, make)``: inside a scope the first call makes the decision and the others
reuse it; outside one (a block called directly, a transformer nobody watches, a hook registry that bypassed the
hooks) every call makes its own decision, exactly as before. A decision therefore never survives its forward: the
next forward opens an empty table.

While torch.compile traces, the hooks open no scope (checked first: :func:`~.guards.tracing`), and patched code
never asks (it checks ``tracing()`` before anything else).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch.nn as nn

from vllm_omni_ascend_opt.blocks import guards

T = TypeVar("T")

_EPOCHS = itertools.count(1)


class Scope:
    """One transformer forward: its model, a unique epoch number and its decision table."""

    __slots__ = ("decisions", "epoch", "model")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.epoch = next(_EPOCHS)
        self.decisions: dict[Hashable, Any] = {}


_STACK: list[Scope] = []


def current() -> Scope | None:
    """The innermost open scope (the transformer forward being run), or None outside any watched forward."""
    return _STACK[-1] if _STACK else None


def decide(key: Hashable, make: Callable[[], T]) -> T:
    """The decision ``key`` of this forward: made by ``make()`` at the first ask within the scope and reused until the
    forward ends; outside a scope, ``make()`` on every call. Callers check ``guards.tracing()`` first."""
    if not _STACK:
        return make()
    table = _STACK[-1].decisions
    try:
        return table[key]
    except KeyError:
        value = table[key] = make()
        return value


def _open(module: nn.Module, args: Any) -> None:
    if guards.tracing():  # first: nothing is recorded while dynamo traces
        return
    _STACK.append(Scope(module))


def _close(module: nn.Module, args: Any, output: Any) -> None:
    if guards.tracing():
        return
    for i in range(len(_STACK) - 1, -1, -1):  # the innermost scope of this module (nested forwards: rare)
        if _STACK[i].model is module:
            del _STACK[i:]
            break


class _Watch:
    __slots__ = ("handles", "owners")

    def __init__(self, handles: tuple[Any, Any]) -> None:
        self.handles = handles
        self.owners: set[str] = set()


_WATCHED: weakref.WeakKeyDictionary[nn.Module, _Watch] = weakref.WeakKeyDictionary()


def watch(transformer: nn.Module, owner: str) -> None:
    """Open a scope around every forward of ``transformer`` while at least one owner watches it (idempotent)."""
    w = _WATCHED.get(transformer)
    if w is None:
        handles = (
            transformer.register_forward_pre_hook(_open),
            transformer.register_forward_hook(_close, always_call=True),
        )
        w = _WATCHED[transformer] = _Watch(handles)
    w.owners.add(owner)


def unwatch(transformer: nn.Module, owner: str) -> None:
    """Stop watching for ``owner``; the hooks go when no owner is left."""
    w = _WATCHED.get(transformer)
    if w is None:
        return
    w.owners.discard(owner)
    if not w.owners:
        for h in w.handles:
            h.remove()
        del _WATCHED[transformer]


def watched(transformer: nn.Module) -> frozenset[str]:
    """The owners watching ``transformer`` (empty: its forwards open no scope)."""
    w = _WATCHED.get(transformer)
    return frozenset(w.owners) if w is not None else frozenset()


def reset() -> None:
    """Close every open scope (tests; a forward interrupted without its hook)."""
    _STACK.clear()
