"""Response ids that name the backend holding the response, sealed by the router.

A Responses API response is stored by the engine that produced it, so every
later call about it (retrieve, delete, cancel, input items, a create that
continues it with ``previous_response_id``) must reach that engine. The
router writes the owner into the id it hands back and reads it again from the
follow-up, so no state is shared between replicas and an immediate retrieve
cannot race the create::

    resp_mr2<base32 of: seal (16 bytes) + the owner, encrypted>_<the engine's id>

The owner is the backend, the create's client-facing model, a flag (the
create's answer named that model instead of the engine's, so a retrieve does
too) and the id of the API key that made it. The seal is HMAC-SHA256 over the
owner and the engine's id, truncated to 16 bytes; the owner is encrypted with
a keystream drawn from the seal (a synthetic-IV construction), so an id shows
neither a backend nor a model, and changing any byte of it, the engine's id
included, breaks the seal. The key comes from the router's secret
(``server.grpc_auth``): every replica sharing it reads every replica's ids.
The same owner and engine id always give the same text: no second id names
the same response.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass

_PREFIX = "resp_mr2"
_SEAL = 16
_BLOCK = 16  # the owner is padded to a multiple of this, so an id's length says little
# Used when no secret is configured: ids then last as long as the process.
PROCESS_KEY = os.urandom(32)


def derive(secret: str) -> bytes:
    """The id key for a router secret."""
    return hmac.new(secret.encode(), b"model-router response ids v2", hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds a response, and who may ask about it."""

    backend: str
    model: str  # the client-facing model of the create
    rewrite: bool  # the create's answer named ``model`` in place of the engine's
    key_id: str = ""  # the API key id that created it ("" without api_keys)

    def payload(self) -> str:
        """The owner as the decision publishes it for the response side."""
        return f"{self.backend}\0{self.model}\0{int(self.rewrite)}\0{self.key_id}"

    @staticmethod
    def from_payload(text: str) -> Owner | None:
        parts = text.split("\0")
        if len(parts) < 4 or not parts[0] or parts[2] not in ("0", "1") or any(parts[4:]):
            return None
        return Owner(parts[0], parts[1], parts[2] == "1", parts[3])


@functools.lru_cache(maxsize=4)
def _keys(key: bytes) -> tuple[bytes, bytes]:
    return hmac.digest(key, b"seal", "sha256"), hmac.digest(key, b"encrypt", "sha256")


def _stream(key: bytes, seal: bytes, n: int) -> bytes:
    out = b""
    counter = 0
    while len(out) < n:
        out += hmac.digest(key, seal + counter.to_bytes(4, "big"), "sha256")
        counter += 1
    return out[:n]


def _seal(key: bytes, plain: bytes, upstream: str) -> bytes:
    return hmac.digest(key, plain + b"\0" + upstream.encode("utf-8", "surrogatepass"), "sha256")[:_SEAL]


def tag(owner: Owner, upstream: str, key: bytes) -> str:
    """The id the client gets for the engine's ``upstream`` id."""
    plain = owner.payload().encode("utf-8", "surrogatepass")
    plain += b"\0" * (-len(plain) % _BLOCK)
    seal_key, enc_key = _keys(key)
    seal = _seal(seal_key, plain, upstream)
    sealed = bytes(a ^ b for a, b in zip(plain, _stream(enc_key, seal, len(plain))))
    return _PREFIX + base64.b32encode(seal + sealed).decode("ascii").rstrip("=").lower() + "_" + upstream


def untag(value: str, key: bytes) -> tuple[Owner, str] | None:
    """``(owner, the engine's id)`` of an id this router issued, or None for
    any other text: an edited, unsigned or foreign id is no id."""
    if not value.startswith(_PREFIX):
        return None
    code, sep, upstream = value[len(_PREFIX):].partition("_")
    if not sep or not upstream or not code or code != code.lower():
        return None
    try:
        raw = base64.b32decode(code.upper() + "=" * (-len(code) % 8))
    except (binascii.Error, ValueError):
        return None
    if len(raw) <= _SEAL or (len(raw) - _SEAL) % _BLOCK:
        return None
    seal, sealed = raw[:_SEAL], raw[_SEAL:]
    seal_key, enc_key = _keys(key)
    plain = bytes(a ^ b for a, b in zip(sealed, _stream(enc_key, seal, len(sealed))))
    if not hmac.compare_digest(seal, _seal(seal_key, plain, upstream)):
        return None
    try:
        owner = Owner.from_payload(plain.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    if owner is None or base64.b32encode(raw).decode("ascii").rstrip("=").lower() != code:
        return None  # one spelling per response
    return owner, upstream


def tagger(payload: str | None, key: bytes) -> Callable[[str], str] | None:
    """What the response side puts in place of each engine id of an answer."""
    owner = Owner.from_payload(payload) if payload else None
    if owner is None:
        return None
    return lambda upstream: tag(owner, upstream, key)
