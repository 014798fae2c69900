"""The one verdict type, and the one store rule: a verdict lives as long as the backend probe it was made under.

A :class:`Verdict` is a kernel path's decision at one key (``reason``: the refusal, or the evidence of a pass).
:class:`ProbeDict` holds verdicts (and the guard's faults) by key and drops them all when
:func:`vllm_omni_ascend_opt._backend.probe_id` changes, or on ``clear()``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from vllm_omni_ascend_opt import _backend

V = TypeVar("V")


@dataclass
class Verdict:
    """One kernel's verdict at one key; ``place`` is the key in words (the kernel path renders it)."""

    kernel: str
    key: tuple
    ok: bool
    reason: str = ""
    place: str = ""
    #: equal to the stock result bit for bit on the checked inputs (None: not compared, or read from disk)
    bitwise: bool | None = None
    #: measured errors by name (e.g. ``kernel``, ``stock``, ``over_bound``), for notes and tests
    errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    #: the candidates' and stock's device times and the choice (:func:`.timing.report`), saved with the verdict
    timing: dict[str, Any] | None = None

    def describe(self) -> str:
        t = self.timing or {}
        if not self.ok:
            return f"{self.kernel} at {self.place}: refused ({self.reason}); stock for this class"
        if t.get("kernel_ms") is None:  # untimed
            return f"{self.kernel} at {self.place}: verified, in use ({self.reason})"
        took = f"{t.get('candidate') or 'stock'} {t['kernel_ms']:.4g} ms vs stock {t['stock_ms']:.4g} ms"
        ratio = f", {t['ratio']:.3g}x" if t.get("ratio") is not None else ""
        return f"{self.kernel} at {self.place}: verified, in use ({self.reason}; {took}{ratio})"


class ProbeDict(Generic[V]):
    """Values by key, valid for the backend probe they were made under; ``on_new_probe`` runs when it changes."""

    def __init__(self, on_new_probe: Callable[[], None] | None = None) -> None:
        self._entries: dict[Hashable, V] = {}
        self._probe: int | None = None
        self._on_new_probe = on_new_probe

    def live(self) -> dict[Hashable, V]:
        """The entries of the current probe (emptied first when the probe changed)."""
        probe = _backend.probe_id()
        if probe != self._probe:
            self._entries.clear()
            self._probe = probe
            if self._on_new_probe is not None:
                self._on_new_probe()
        return self._entries

    def __bool__(self) -> bool:  # the hot path: an empty store costs one length check (stale entries: live() drops)
        return bool(self._entries)

    def get(self, key: Hashable) -> V | None:
        return self.live().get(key)

    def put(self, key: Hashable, value: V) -> V:
        self.live()[key] = value
        return value

    def values(self) -> list[V]:
        return list(self.live().values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self.live())
