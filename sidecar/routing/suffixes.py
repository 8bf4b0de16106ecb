"""Model variant suffixes (``model:nitro``, ``:floor``, ``:thinking``, ``:online``).

The grammar: the exact name first, then one recognised trailing word on a
known base. What each word does is in :data:`SUFFIXES`, the one table the
decision reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from .snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class Suffix:
    ranker: str | None = None  # a selection ranker that narrows the candidates
    thinking: bool = False  # asks for high reasoning effort; the model must support it
    online: bool = False  # the router runs the web-search loop itself (no fallback)


SUFFIXES: dict[str, Suffix] = {
    "nitro": Suffix(ranker="throughput"),
    "floor": Suffix(ranker="cost"),
    "thinking": Suffix(thinking=True),
    "online": Suffix(online=True),
}


def supported(snap: Snapshot, model: str, suffix: Suffix) -> bool:
    """What the config says of a suffix on ``model``: ``:thinking`` needs a model
    declaring reasoning support, ``:online`` an enabled search provider. (The
    request can still rule a suffix out: ``:online`` does not stream.)"""
    if suffix.thinking:
        meta = snap.meta(model)
        return meta is not None and meta.supports_thinking
    if suffix.online:
        ws = snap.config.web_search
        return ws is not None and ws.enabled
    return True


def known(snap: Snapshot, name: str) -> bool:
    """Whether the router resolves ``name`` as it is (served, declared or an experiment)."""
    return (
        name in snap.experiments
        or bool(snap.resolve(name)[1])
        or name in snap.metadata
        or name in snap.meta_alias
        or name in snap.reserved
    )


def split(snap: Snapshot, name: str) -> tuple[str, str | None]:
    """(base, suffix) for a requested name; suffix None means the name stands as sent.

    The full name is tried first, so a model served literally as ``x:nitro``
    (or an Ollama ``name:tag``) keeps its own identity. Only a recognised word
    after the last ``:`` on a known base is a variant.
    """
    if known(snap, name):
        return name, None
    base, sep, word = name.rpartition(":")
    if sep and base and word in SUFFIXES and known(snap, base):
        return base, word
    return name, None
