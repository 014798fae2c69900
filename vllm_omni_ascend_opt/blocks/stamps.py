"""Instance facts checked by identity: what a check read about a module, recorded once, re-read in one pass.

Why: the patched block's per-call checks (which layers run as their kernels, whether the joint QK path fits an
attention) re-derive facts about module instances that only change when somebody changes the model between
forwards: a hook registered, a layer swapped (LoRA wrappers), a parameter replaced, an attribute or class set. Made
in every block of every forward, these derivations cost more host time than some of the kernels they save.

How: a check that is given a :class:`Stamp` records what it reads about an instance (its class, ``__dict__`` entries,
parameters, children: compared by identity) and the hook dicts that must stay empty. The caller keeps the check's
answer with its stamp (:class:`PlanCache`) and reuses it while :meth:`Stamp.holds`: a change between forwards is
seen at the next call, as with the per-call checks, for the price of a few dict reads. What the checks read outside
instances (process state, global hooks, upstream code) stays decided once per forward (:mod:`.forward_scope`), and
callers check ``guards.tracing()`` first.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch.nn as nn

T = TypeVar("T")
_MISSING = object()


class Stamp:
    """The instance state a check read: ``holds()`` while every read would give the same objects again.

    Reads are recorded once each (a check may read the same entry many times) and re-read in C-level passes
    (``map``/``operator.is_``): a block's stamp of ~90 reads holds in a few microseconds."""

    __slots__ = ("_seen", "classes", "empty", "full", "keys", "mappings", "refs", "values")

    def __init__(self) -> None:
        self._seen: set[tuple[int, Any]] = set()
        #: parallel lists: ``mappings[i].get(keys[i]) is values[i]`` (identity)
        self.mappings: list[dict[str, Any]] = []
        self.keys: list[str] = []
        self.values: list[Any] = []
        #: hook dicts that were empty and must stay so
        self.empty: list[Mapping[Any, Any]] = []
        #: hook dicts that were not empty and must stay so (a removed hook changes the answer too)
        self.full: list[Mapping[Any, Any]] = []
        #: parallel lists: a weak reference to an object (or the object where it has none), its class; weak, so that
        #: a plan never keeps the module it is kept for alive
        self.refs: list[Any] = []
        self.classes: list[type] = []

    def read(self, mapping: dict[str, Any], key: str) -> Any:
        """``mapping.get(key)`` (``mapping``: a dict), recorded."""
        value = mapping.get(key, _MISSING)
        seen = (id(mapping), key)
        if seen not in self._seen:
            self._seen.add(seen)
            self.mappings.append(mapping)
            self.keys.append(key)
            self.values.append(value)
        return None if value is _MISSING else value

    def attr(self, obj: Any, name: str) -> Any:
        """``obj.name`` from its instance ``__dict__`` (recorded), else from its class (recorded by the class)."""
        if self.read(obj.__dict__, name) is None and name not in obj.__dict__:
            self.kind(obj)
        return getattr(obj, name)

    def kind(self, obj: Any) -> type:
        """``type(obj)``, recorded (a ``__class__`` swap breaks the stamp)."""
        cls = type(obj)
        seen = (id(obj), None)
        if seen not in self._seen:
            self._seen.add(seen)
            try:
                ref: Any = weakref.ref(obj)
            except TypeError:  # no weak references (None, numbers, slotted objects): they cannot reach a module
                ref = _Strong(obj)
            self.refs.append(ref)
            self.classes.append(cls)
        return cls

    def empty_dict(self, mapping: Mapping[Any, Any]) -> bool:
        """Whether ``mapping`` is empty, recorded: it must stay empty, or stay non-empty (a dict that is never
        replaced, e.g. a module's hook dicts, ``_modules`` or ``_buffers``)."""
        if mapping:
            self.full.append(mapping)
            return False
        self.empty.append(mapping)
        return True

    def hooked(self, m: nn.Module) -> bool:
        """Record ``m``'s class and hook dicts; True when it carries forward (pre-)hooks of its own."""
        self.kind(m)
        d = m.__dict__
        return not (self.empty_dict(d["_forward_hooks"]) & self.empty_dict(d["_forward_pre_hooks"]))

    def module(self, m: nn.Module) -> bool:
        """Record ``m``'s class, hook dicts and instance ``forward``; True when it has no hook and no instance
        forward (what every check asks first)."""
        hooked = self.hooked(m)
        return self.read(m.__dict__, "forward") is None and not hooked

    def holds(self) -> bool:
        """Every recorded read gives the same object, every hook dict is still (non-)empty, every class is the
        same (a dead object's class reads as NoneType)."""
        if any(self.empty) or not all(self.full):
            return False
        now = map(dict.get, self.mappings, self.keys, itertools.repeat(_MISSING))
        if not all(map(operator.is_, now, self.values)):
            return False
        return list(map(type, map(operator.call, self.refs))) == self.classes


class _Strong:
    """A reference with ``weakref.ref``'s call interface, for objects without weak references."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class Unrecorded:
    """:class:`Stamp`'s reads without recording (a check made for one call only): ``UNRECORDED``."""

    __slots__ = ()

    @staticmethod
    def read(mapping: Mapping[str, Any], key: str) -> Any:
        return mapping.get(key)

    @staticmethod
    def attr(obj: Any, name: str) -> Any:
        return getattr(obj, name)

    @staticmethod
    def kind(obj: Any) -> type:
        return type(obj)

    @staticmethod
    def empty_dict(mapping: Mapping[Any, Any]) -> bool:
        return not mapping

    @staticmethod
    def hooked(m: nn.Module) -> bool:
        return bool(m._forward_hooks or m._forward_pre_hooks)

    @staticmethod
    def module(m: nn.Module) -> bool:
        return not (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__)


UNRECORDED = Unrecorded()
#: What the checks read through: a :class:`Stamp` (recorded) or :data:`UNRECORDED`.
Reader = Stamp | Unrecorded


class PlanCache:
    """Per-module answers of a check, each kept with its :class:`Stamp` and reused while it holds.

    Policy: one plan per live module (an entry dies with its module); a plan whose stamp no longer holds is remade at
    the next call; :meth:`clear` on uninstall."""

    def __init__(self) -> None:
        self._plans: dict[int, tuple[weakref.ReferenceType, Stamp, Any]] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()

    def drop(self, module: nn.Module) -> None:
        """Forget ``module``'s plan (the next :meth:`get` makes it anew)."""
        self._plans.pop(id(module), None)

    def get(self, module: nn.Module, make: Callable[[Stamp], T]) -> T:
        """The plan of ``module``: the kept one while its stamp holds, else ``make(stamp)`` (which records into
        ``stamp`` what it reads)."""
        key = id(module)
        kept = self._plans.get(key)
        if kept is not None and kept[0]() is module and kept[1].holds():
            return kept[2]
        stamp = Stamp()
        plan = make(stamp)
        plans = self._plans

        def _drop(_ref: weakref.ReferenceType, key: int = key) -> None:
            plans.pop(key, None)

        plans[key] = (weakref.ref(module, _drop), stamp, plan)
        return plan
