"""Tables derived from one config snapshot, for the request path.

Much of a decision depends only on the snapshot and on a few of the request's
values (the model it names, the key's allow-lists, the arm it draws). A
:class:`PerSnapshot` table keeps such results for the snapshot it was filled
from: a new snapshot (a reload, a changed model list) starts an empty table,
so no config ever sees another's entries. Its keys can hold values a client
chooses (a model name), so it is bounded: when full it starts over.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from .snapshot import Snapshot

T = TypeVar("T")
LIMIT = 4096  # entries kept per table before starting over


class PerSnapshot(Generic[T]):
    """Values computed once per snapshot and key (at most ``limit`` keys at a time)::

        found = table.find(snap, key)
        if found is None:
            found = table.keep(key, compute(...))

    (No closure per lookup: the request path looks up several tables per decision.)"""

    __slots__ = ("_snap", "_table", "limit")

    def __init__(self, limit: int = LIMIT) -> None:
        self._snap: Snapshot | None = None
        self._table: dict[Hashable, T] = {}
        self.limit = limit

    def find(self, snap: Snapshot, key: Hashable) -> T | None:
        """The value kept for ``key`` under ``snap``, or None (a new snapshot starts an empty table)."""
        if self._snap is not snap:
            self._snap, self._table = snap, {}
        return self._table.get(key)

    def keep(self, key: Hashable, value: T) -> T:
        """``value`` for ``key`` under the snapshot of the last :meth:`find`."""
        table = self._table
        if len(table) >= self.limit:
            table.clear()
        table[key] = value
        return value

    def __len__(self) -> int:
        return len(self._table)
