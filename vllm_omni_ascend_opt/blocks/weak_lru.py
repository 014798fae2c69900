"""A bounded LRU whose entries live only as long as the objects they were made for: the RoPE table cache and the
joint freqs cache key on tensors by identity, so an entry must die with its tensors (an id can be reused once the
object is gone) and must never keep them alive.

Policy: at most ``cap`` entries; a hit moves its entry to the most recent end; a new entry beyond the cap evicts
the least recently used one; an entry is dropped when any of its owners dies. An entry is inserted only once its
value is complete (:meth:`WeakLRU.put` takes the finished value).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class WeakLRU(Generic[V]):
    """Values by key, each valid while the owners it was stored with are alive (compared by identity)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._entries: OrderedDict[Hashable, tuple[tuple[weakref.ref, ...], V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def values(self) -> Iterator[V]:
        return (value for _refs, value in self._entries.values())

    def get(self, key: Hashable, owners: tuple[Any, ...]) -> V | None:
        """The value stored under ``key`` for these very ``owners`` (None: none, or made for other objects)."""
        hit = self._entries.get(key)
        if hit is None or len(hit[0]) != len(owners) or any(r() is not o for r, o in zip(hit[0], owners, strict=True)):
            return None
        self._entries.move_to_end(key)
        return hit[1]

    def put(self, key: Hashable, owners: tuple[Any, ...], value: V) -> V:
        """Store ``value`` under ``key`` until one of ``owners`` dies or it is evicted; returns ``value``."""
        entries = self._entries

        def _drop(_ref: weakref.ref, key: Hashable = key) -> None:
            entries.pop(key, None)

        entries[key] = (tuple(weakref.ref(o, _drop) for o in owners), value)
        entries.move_to_end(key)
        while len(entries) > self.cap:
            entries.popitem(last=False)
        return value


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or tuples / lists / dicts of them, nested): what a cache entry
    holds, for status."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0
