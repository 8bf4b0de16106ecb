"""The admin token: how a request presents it and how it is compared.

The admin port takes it as ``Authorization: Bearer <server.admin_token>``.
Without a configured token nothing matches.
"""

from __future__ import annotations

import hmac

__all__ = ["bearer", "matches"]


def matches(expected: str | None, given: bytes) -> bool:
    """Whether ``given`` (the raw header bytes) is the configured token, in constant time."""
    if not expected:
        return False
    return hmac.compare_digest(given, expected.encode("utf-8"))


def bearer(value: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value (the value itself otherwise)."""
    return value[7:].strip() if value.lower().startswith("bearer ") else value
