"""Slots: the one way optimizations cooperate (one never imports another). What one offers others goes through a
:class:`Slot` declared in ``blocks/``: the owner fills it in ``install`` and empties it in ``uninstall``; a user asks
:meth:`Slot.get` and takes its own path on None.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Slot(Generic[T]):
    """One provider at a time, named for logs and errors."""

    __slots__ = ("_owner", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._owner: T | None = None

    def provide(self, owner: T) -> None:
        """Make ``owner`` the provider (its optimization's install)."""
        self._owner = owner

    def withdraw(self, owner: T) -> None:
        """Stop offering ``owner`` (its uninstall); a no-op when another one provides."""
        if self._owner is owner:
            self._owner = None

    def get(self) -> T | None:
        """The provider, or None (nobody offers it: the caller takes its own path)."""
        return self._owner
