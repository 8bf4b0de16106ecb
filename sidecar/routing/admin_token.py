"""The admin token: where a request presents it and how it is compared.

The admin port takes it as ``Authorization: Bearer <server.admin_token>``. A
request through Envoy already uses ``Authorization`` for its API key, so it
presents the token in :data:`HEADER` (with ``x-model-router-explain: 1``, to
get its decision's trace). Without a configured token nothing matches.
"""

from __future__ import annotations

import hmac

from .snapshot import ADMIN_TOKEN_HEADER as HEADER

__all__ = ["HEADER", "bearer", "matches"]


def matches(expected: str | None, given: bytes) -> bool:
    """Whether ``given`` (the raw header bytes) is the configured token, in constant time."""
    if not expected:
        return False
    return hmac.compare_digest(given, expected.encode("utf-8"))


def bearer(value: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value; "" (which never
    matches) for any other scheme or a bare token."""
    return value[7:].strip() if value.lower().startswith("bearer ") else ""
