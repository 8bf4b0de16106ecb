"""Error bodies in the shape of each API family.

A refusal is built in exactly one place per kind, so two refusals of the same
kind (for example an unknown model and a reserved one) are byte-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import orjson

from .decision import EMPTY, Decision

Kind = Literal[
    "invalid_request", "invalid_json", "missing_model", "invalid_model", "invalid_multipart", "unauthorized",
    "model_not_permitted", "model_not_found", "unknown_endpoint", "unsupported_model_variant",
    "method_not_allowed", "too_large", "unsupported_encoding", "headers_too_large", "no_backend", "bad_gateway",
    "gateway_timeout", "internal", "overloaded", "rate_limited", "response_not_found", "previous_response_not_found",
    "invalid_feedback", "request_not_found", "feedback_unavailable",
]

# kind -> (status, OpenAI error type, OpenAI code, Anthropic error type).
# Every kind has a code: clients and dashboards branch on it, never on the message.
_KINDS: dict[Kind, tuple[int, str, str, str]] = {
    "invalid_request": (400, "invalid_request_error", "invalid_request", "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error", "invalid_json", "invalid_request_error"),
    "missing_model": (400, "invalid_request_error", "missing_model", "invalid_request_error"),
    "invalid_model": (400, "invalid_request_error", "invalid_model", "invalid_request_error"),
    "invalid_multipart": (400, "invalid_request_error", "invalid_multipart", "invalid_request_error"),
    "unauthorized": (401, "authentication_error", "invalid_api_key", "authentication_error"),
    "model_not_permitted": (403, "permission_error", "model_not_permitted", "permission_error"),
    "model_not_found": (404, "invalid_request_error", "model_not_found", "not_found_error"),
    "unknown_endpoint": (404, "invalid_request_error", "unknown_endpoint", "not_found_error"),
    "unsupported_model_variant": (404, "invalid_request_error", "unsupported_model_variant", "not_found_error"),
    "method_not_allowed": (405, "invalid_request_error", "method_not_allowed", "invalid_request_error"),
    "too_large": (413, "invalid_request_error", "request_too_large", "request_too_large"),
    "unsupported_encoding": (415, "invalid_request_error", "unsupported_content_encoding", "invalid_request_error"),
    "headers_too_large": (431, "invalid_request_error", "request_headers_too_large", "invalid_request_error"),
    "no_backend": (503, "server_error", "no_backend_available", "overloaded_error"),
    "bad_gateway": (502, "server_error", "upstream_error", "api_error"),
    "gateway_timeout": (504, "server_error", "upstream_timeout", "api_error"),
    "internal": (500, "server_error", "internal_error", "api_error"),
    "overloaded": (503, "server_error", "router_overloaded", "overloaded_error"),
    "rate_limited": (429, "tokens", "rate_limit_exceeded", "rate_limit_error"),
    # Responses API: a stored response the router cannot place.
    "response_not_found": (404, "invalid_request_error", "response_not_found", "not_found_error"),
    "previous_response_not_found": (400, "invalid_request_error", "previous_response_not_found", "invalid_request_error"),
    # POST /v1/feedback: a body the router cannot take, a request id it cannot place.
    "invalid_feedback": (400, "invalid_request_error", "invalid_feedback", "invalid_request_error"),
    "request_not_found": (404, "invalid_request_error", "request_not_found", "not_found_error"),
    "feedback_unavailable": (503, "server_error", "feedback_unavailable", "overloaded_error"),
}
# Kinds that pass by themselves soon: the reply says when to come back.
_RETRY_AFTER: dict[Kind, str] = {"overloaded": "1", "no_backend": "1", "feedback_unavailable": "1"}


@dataclass(frozen=True)
class Reply:
    """An answer the sidecar gives itself (an Envoy immediate response)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    # Not sent: the experiment whose reserved model this refusal protects.
    reserved_by: str | None = None
    # The decision so far (an arm already chosen), published with the reply.
    meta: Decision = EMPTY

    content_type = "application/json"


def error(kind: Kind, message: str, family: str = "openai", param: str | None = None) -> Reply:
    status, otype, code, atype = _KINDS[kind]
    if family == "anthropic":
        body = {"type": "error", "error": {"type": atype, "message": message}}
    else:
        body = {"error": {"message": message, "type": otype, "param": param, "code": code}}
    retry = _RETRY_AFTER.get(kind)
    return Reply(status, orjson.dumps(body), (("retry-after", retry),) if retry else (), meta=Decision(refusal=kind))


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


def too_large(limit: int, family: str) -> Reply:
    return error("too_large", f"The request body is larger than the limit of {limit} bytes.", family)


def unsupported_encoding(encoding: str, family: str) -> Reply:
    """A body the router cannot read is a body it cannot judge."""
    return error("unsupported_encoding", f"Request bodies with content-encoding '{encoding}' are not accepted.", family)


def response_not_found(response_id: str) -> Reply:
    """A follow-up about a response the router cannot place: an id it did not
    hand out, and (byte for byte) one whose owner the caller may not use."""
    return error("response_not_found", f"Response with id '{response_id}' not found.")


def previous_response_not_found(response_id: str) -> Reply:
    """A create continuing a response the router cannot place (or the caller may not reach)."""
    return error(
        "previous_response_not_found", f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
    )


def stream_error_event(kind: Kind, message: str, family: str) -> bytes:
    """The last event of a stream the router ends itself: what each family's
    SDK raises as an error (OpenAI: a ``data`` line holding ``error``, with no
    ``[DONE]`` after it; Anthropic: an ``error`` event)."""
    _, otype, code, atype = _KINDS[kind]
    if family == "anthropic":
        data = orjson.dumps({"type": "error", "error": {"type": atype, "message": message}})
        return b"event: error\ndata: " + data + b"\n\n"
    data = orjson.dumps({"error": {"message": message, "type": otype, "param": None, "code": code}})
    return b"data: " + data + b"\n\n"
