"""Per-forward decisions: what is the same for every block of a forward is decided once, at the first block that
asks. A :func:`watch` ed transformer's ``__call__`` opens a scope (a fresh decision table) around each eager forward;
:func:`decide` reuses a decision within a scope and makes it on every call outside one.

Threading contract: one forward at a time per process. A forward on another thread meanwhile runs unscoped (correct,
only slower) and logs one warning.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
import torch.nn as nn

T = TypeVar("T")
logger = logging.getLogger("vllm_omni_ascend_opt")

_STACK: list[dict[Hashable, Any]] = []  # the open scopes' decision tables, innermost last
_FORWARDS = [0]  # outermost watched forwards started: the kernel fault backoff's clock
# Called after each outermost watched forward that returned (not raised: the other ranks may not be there).
_AT_END: list[Callable[[], Any]] = []


def at_forward_end(fn: Callable[[], Any]) -> None:
    """Call ``fn()`` after each outermost watched forward returns (idempotent)."""
    if fn not in _AT_END:
        _AT_END.append(fn)


def forwards() -> int:
    """How many outermost watched transformer forwards have started in this process."""
    return _FORWARDS[0]


_OWNER = [0]  # the thread that opened the outermost scope
_WARNED = [False]


def _mine() -> bool:
    return bool(_STACK) and _OWNER[0] == threading.get_ident()


def current() -> dict[Hashable, Any] | None:
    """The decision table of the innermost open scope (the forward being run), or None outside watched forwards."""
    return _STACK[-1] if _mine() else None


def decide(key: Hashable, make: Callable[[], T]) -> T:
    """The decision ``key`` of this forward (``make()`` at the first ask; outside a scope at every ask)."""
    if not _STACK or _OWNER[0] != threading.get_ident():  # _mine(), inlined: asked several times per block
        return make()
    table = _STACK[-1]
    try:
        return table[key]
    except KeyError:
        table[key] = value = make()
        return value


# transformer -> {owner: called with the transformer when a scope opens, or None}
_WATCHED: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable[[nn.Module], None] | None]] = (
    weakref.WeakKeyDictionary()
)
_SCOPED: dict[type, type] = {}


def _scoped_class(cls: type) -> type:
    """A subclass of ``cls`` (same name) whose ``__call__`` opens a scope around a watched instance's eager forward."""
    sub = _SCOPED.get(cls)
    if sub is not None:
        return sub
    base_call = cls.__call__

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        w = _WATCHED.get(self)
        if w is None or self._compiled_call_impl is not None or torch.compiler.is_compiling():  # dynamo traces
            return base_call(self, *args, **kwargs)
        if _STACK and not _mine():  # another thread's forward is open: outside the threading contract
            if not _WARNED[0]:
                _WARNED[0] = True
                logger.warning(
                    "vllm-omni-ascend-opt: two transformer forwards run at once on different threads; the plugin "
                    "expects one forward at a time per process (as vLLM-Omni runs it): this one runs unscoped"
                )
            return base_call(self, *args, **kwargs)
        scope: dict[Hashable, Any] = {}
        depth = len(_STACK)
        if not depth:
            _FORWARDS[0] += 1
            _OWNER[0] = threading.get_ident()
        _STACK.append(scope)
        for callback in [c for c in w.values() if c is not None]:
            callback(self)
        try:
            out = base_call(self, *args, **kwargs)
        finally:
            if len(_STACK) > depth and _STACK[depth] is scope:  # gone if reset() ran; else close any left open inside
                del _STACK[depth:]
        if not _STACK:
            for fn in _AT_END:
                fn()
        return out

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__, "_ascend_scoped_base": cls})
    sub.__qualname__ = cls.__qualname__
    _SCOPED[cls] = sub
    return sub


def watch(transformer: nn.Module, owner: str, on_forward: Callable[[nn.Module], None] | None = None) -> None:
    """Open a scope around every eager forward of ``transformer`` while an owner watches it; ``on_forward`` runs when
    it opens. A ``__class__`` swap: hooks or a ``forward`` wrapper would change how a compiled transformer is traced."""
    w = _WATCHED.get(transformer)
    if w is None:
        w = _WATCHED[transformer] = {}
        if "_ascend_scoped_base" not in type(transformer).__dict__:
            transformer.__class__ = _scoped_class(type(transformer))
    w[owner] = on_forward or w.get(owner)


def unwatch(transformer: nn.Module, owner: str) -> None:
    """Stop watching for ``owner``; the instance gets its class back when no owner is left."""
    w = _WATCHED.get(transformer)
    if w is None:
        return
    w.pop(owner, None)
    if not w:
        del _WATCHED[transformer]
        base = type(transformer).__dict__.get("_ascend_scoped_base")
        if base is not None:
            transformer.__class__ = base


def watched(transformer: nn.Module) -> frozenset[str]:
    """The owners watching ``transformer`` (empty: its forwards open no scope)."""
    return frozenset(_WATCHED.get(transformer, ()))


def reset() -> None:
    """Close every open scope (tests; a forward interrupted without its hook)."""
    _STACK.clear()
