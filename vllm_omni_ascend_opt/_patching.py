"""Attribute patching that restores originals by identity: every monkey-patch goes through a :class:`PatchSet`, whose
``revert`` puts back *the very object* that was there before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass
class _Record:
    owner: Any
    name: str
    original: Any  # _MISSING when the attribute did not exist on the owner itself
    replacement: Any


@dataclass
class PatchSet:
    """A named group of attribute patches, applied and reverted together."""

    label: str
    _records: list[_Record] = field(default_factory=list)

    def set(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace ``owner.name`` with ``replacement``; a second call for the same target is a no-op."""
        if self.is_patched(owner, name):
            return
        # The owner's own namespace: revert never pins an inherited attribute.
        original = getattr(owner, "__dict__", {}).get(name, _MISSING)
        self._records.append(_Record(owner, name, original, replacement))
        setattr(owner, name, replacement)

    def revert(self) -> None:
        """Restore every patched attribute, newest first; safe to call twice."""
        while self._records:
            rec = self._records.pop()
            if rec.original is _MISSING:
                if rec.name in getattr(rec.owner, "__dict__", {}):
                    delattr(rec.owner, rec.name)
            else:
                setattr(rec.owner, rec.name, rec.original)

    def is_patched(self, owner: Any, name: str) -> bool:
        return any(r.owner is owner and r.name == name for r in self._records)

    def original(self, owner: Any, name: str) -> Any:
        """The object that was there before this PatchSet replaced it."""
        for rec in self._records:
            if rec.owner is owner and rec.name == name:
                return rec.original
        raise KeyError(f"{self.label}: {owner!r}.{name} is not patched")

    def __len__(self) -> int:
        return len(self._records)

    def __bool__(self) -> bool:  # an empty PatchSet is still a PatchSet
        return True
