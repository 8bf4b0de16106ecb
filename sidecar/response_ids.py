"""Response ids that name the backend holding the response.

A Responses API response is stored by the engine that produced it, so every
later call about it (retrieve, delete, cancel, input items, a create that
continues it with ``previous_response_id``) must reach that engine. The
router writes the owner into the id it hands back and reads it again from the
follow-up, so no state is shared between replicas and an immediate retrieve
cannot race the create::

    resp_mr1<base32 of "backend NUL client model NUL flag">_<the engine's id>

``flag`` is ``1`` when the create's answer named the client-facing model
instead of the engine's (``response_model: client``), so a retrieve answers
with the same name. The engine's id is kept whole after the tag; a tagged id
of another router behind this one nests and unwraps the same way.

The tag is not a secret and not signed: whatever backend a forged id names,
the follow-up passes the same gates as any request for that backend and
model, and every refusal is the answer an unknown id gets.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

_PREFIX = "resp_mr1"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds a response, as its id says."""

    backend: str
    model: str  # the client-facing model of the create
    rewrite: bool  # the create's answer named ``model`` in place of the engine's

    def tag(self) -> str:
        """The text put before the engine's id."""
        raw = f"{self.backend}\0{self.model}\0{int(self.rewrite)}".encode()
        return _PREFIX + base64.b32encode(raw).decode("ascii").rstrip("=").lower() + "_"


def untag(value: str) -> tuple[Owner, str] | None:
    """``(owner, the engine's id)`` of a tagged id, or None for any other text."""
    if not value.startswith(_PREFIX):
        return None
    code, sep, upstream = value[len(_PREFIX):].partition("_")
    if not sep or not upstream or not code:
        return None
    try:
        raw = base64.b32decode(code.upper() + "=" * (-len(code) % 8)).decode()
    except (binascii.Error, ValueError):
        return None
    parts = raw.split("\0")
    if len(parts) != 3 or not parts[0] or parts[2] not in ("0", "1"):
        return None
    owner = Owner(parts[0], parts[1], parts[2] == "1")
    if owner.tag() != value[: len(value) - len(upstream)]:
        return None  # one spelling per owner: no second id names the same response
    return owner, upstream
