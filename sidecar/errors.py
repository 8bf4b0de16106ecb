"""Error bodies in the shape of each API family.

A refusal is built in exactly one place per kind, so two refusals of the same
kind (for example an unknown model and a reserved one) are byte-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import orjson

# kind -> (status, OpenAI error type, OpenAI code, Anthropic error type)
_KINDS: dict[str, tuple[int, str, str | None, str]] = {
    "invalid_request": (400, "invalid_request_error", None, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error", "invalid_json", "invalid_request_error"),
    "missing_model": (400, "invalid_request_error", "missing_model", "invalid_request_error"),
    "unauthorized": (401, "authentication_error", "invalid_api_key", "authentication_error"),
    "model_not_permitted": (403, "permission_error", "model_not_permitted", "permission_error"),
    "model_not_found": (404, "invalid_request_error", "model_not_found", "not_found_error"),
    "unsupported_model_variant": (404, "invalid_request_error", "unsupported_model_variant", "not_found_error"),
    "too_large": (413, "invalid_request_error", "request_too_large", "request_too_large"),
    "no_backend": (503, "server_error", "no_backend_available", "overloaded_error"),
    "bad_gateway": (502, "server_error", "upstream_error", "api_error"),
    "gateway_timeout": (504, "server_error", "upstream_timeout", "api_error"),
    "internal": (500, "server_error", "internal_error", "api_error"),
}


@dataclass(frozen=True)
class Reply:
    """An answer the sidecar gives itself (an Envoy immediate response)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    # Not sent: the experiment whose reserved model this refusal protects.
    reserved_by: str | None = None

    content_type = "application/json"


def error(kind: str, message: str, family: str = "openai", param: str | None = None) -> Reply:
    status, otype, code, atype = _KINDS[kind]
    if family == "anthropic":
        body = {"type": "error", "error": {"type": atype, "message": message}}
    else:
        body = {"error": {"message": message, "type": otype, "param": param, "code": code}}
    return Reply(status, orjson.dumps(body))


def model_not_found(model: str, family: str, reserved_by: str | None = None) -> Reply:
    """The answer for a model the router does not serve (and, byte for byte, for a reserved one)."""
    reply = error(
        "model_not_found",
        f"The model '{model}' does not exist or you do not have access to it.",
        family,
        param="model",
    )
    return replace(reply, reserved_by=reserved_by) if reserved_by else reply


def model_not_permitted(model: str, family: str) -> Reply:
    return error("model_not_permitted", f"This API key is not permitted to use the model '{model}'.", family, "model")
