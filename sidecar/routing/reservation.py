"""Which hidden experiment, if any, reserves a model name."""

from __future__ import annotations

from .snapshot import Snapshot


def reserved_by(snap: Snapshot, name: str, aliases: bool = True) -> str | None:
    """The hidden experiment that reserves ``name`` under any reading the
    router or an engine may give it: as sent, through ``model_aliases``
    (unless ``aliases`` is false: an ingress that does not apply them sends
    the name on as it is), or as the base of a suffixed name."""
    for candidate in (name, snap.aliases.get(name, name)) if aliases else (name,):
        exp = snap.reserved.get(candidate) or snap.reserved.get(candidate.rpartition(":")[0])
        if exp is not None:
            return exp
    return None
