"""Tables derived from one config snapshot, for the request path.

Much of a decision depends only on the snapshot and on a few of the request's
values (the model it names, the key's allow-lists, the arm it draws). A
:class:`PerSnapshot` table keeps such results for the snapshot it was filled
from: a new snapshot (a reload, a changed model list) starts an empty table,
so no config ever sees another's entries. Its keys can hold values a client
chooses (a model name), so it is bounded: when full it starts over.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from .snapshot import Snapshot

T = TypeVar("T")
LIMIT = 4096  # entries kept per table before starting over


class PerSnapshot(Generic[T]):
    """``compute()``, once per snapshot and key (at most ``limit`` keys at a time)."""

    __slots__ = ("_snap", "_table", "limit")

    def __init__(self, limit: int = LIMIT) -> None:
        self._snap: Snapshot | None = None
        self._table: dict[Hashable, T] = {}
        self.limit = limit

    def get(self, snap: Snapshot, key: Hashable, compute: Callable[[], T]) -> T:
        if self._snap is not snap:
            self._snap, self._table = snap, {}
        table = self._table
        try:
            return table[key]
        except KeyError:
            pass
        if len(table) >= self.limit:
            table.clear()
        value = table[key] = compute()
        return value

    def __len__(self) -> int:
        return len(self._table)
