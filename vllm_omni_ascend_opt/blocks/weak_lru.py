"""A bounded LRU whose entries live only as long as the objects they were made for, never keeping them alive (the
RoPE caches key on tensors by identity, and an id can be reused once its object is gone).
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
        """Store the finished ``value`` under ``key`` until one of ``owners`` dies or it is evicted; returns it."""
        entries = self._entries
        entries[key] = (tuple(weakref.ref(o, lambda _r, k=key: entries.pop(k, None)) for o in owners), value)
        entries.move_to_end(key)
        while len(entries) > self.cap:
            entries.popitem(last=False)
        return value


def tensor_bytes(obj: object) -> int:
    """Bytes of the tensors in ``obj`` (nested tuples / lists of tensors): what a cache entry holds."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    return 0
