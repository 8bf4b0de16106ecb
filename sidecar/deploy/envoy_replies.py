"""Envoy's own error replies, in the ingress's error shape and in plain words.

Envoy answers some requests itself: the sidecar unreachable or too slow, a
body over the limit or too slow to arrive, a backend that refused the
connection, reset it or fell silent. Its default text names its internals
(``upstream connect error or disconnect/reset before headers ...``,
``header_mutation_set_contains_invalid_character``); a client gets a fixed
message per status instead, which names the model it asked for when the
sidecar had already routed the request (the decision's ``client_model``
metadata), and never Envoy's details.

The sidecar's own immediate responses carry ``reply`` in their metadata and
are already in shape: the first mapper leaves them as they are.
"""

from __future__ import annotations

from typing import Any

from .. import decision
from ..contract import REPLY_NAMESPACE as NAMESPACE
from . import envoy_limits

_ROUTED_MODEL = f"%DYNAMIC_METADATA({NAMESPACE}:{decision.CLIENT_MODEL})%"

# The OpenAI and Anthropic SDKs retry a 504 unless told not to: a timeout the
# router produced would only run the same long request again upstream.
_NO_RETRY = [{"header": {"key": "x-should-retry", "value": "false"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
# A 503 of Envoy's own (sidecar or upstream unreachable or full) passes soon.
_RETRY_SOON = [{"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]


def _status(op: str, code: int) -> dict[str, Any]:
    return {"status_code_filter": {"comparison": {
        "op": op, "value": {"default_value": code, "runtime_key": f"model_router.local_reply_status_{op.lower()}"},
    }}}


def _meta_present(key: str) -> dict[str, Any]:
    return {"metadata_filter": {
        "matcher": {"filter": NAMESPACE, "path": [{"key": key}], "value": {"present_match": True}},
        "match_if_key_not_found": False,
    }}


# A reply by status: (filter, OpenAI code, OpenAI type, Anthropic type, message, headers).
_Reply = tuple[dict[str, Any], str, str, str, str, list[dict[str, Any]]]


def _routed_replies() -> list[_Reply]:
    """After the decision: what went wrong between Envoy and the backend."""
    model = _ROUTED_MODEL
    return [
        (_status("EQ", 504), "upstream_timeout", "server_error", "api_error",
         f"Timeout: the backend serving the model '{model}' did not answer in time.", _NO_RETRY),
        (_status("EQ", 503), "upstream_unavailable", "server_error", "api_error",
         f"The backend serving the model '{model}' could not be reached or closed the connection; retry shortly.",
         _RETRY_SOON),
        (_status("EQ", 502), "upstream_error", "server_error", "api_error",
         f"The backend serving the model '{model}' sent an answer the router could not pass on.", []),
        (_status("GE", 500), "proxy_error", "server_error", "api_error",
         f"The router could not forward the request for the model '{model}'.", []),
    ]


def _replies(max_body_bytes: int) -> list[_Reply]:
    """Before (or without) a decision."""
    return [
        (_status("EQ", 504), "upstream_timeout", "server_error", "api_error",
         "Timeout: the router did not decide on this request in time.", _NO_RETRY),
        (_status("EQ", 503), "upstream_unavailable", "server_error", "api_error",
         "The router is unavailable; retry shortly.", _RETRY_SOON),
        (_status("EQ", 413), "request_too_large", "invalid_request_error", "request_too_large",
         f"The request body is larger than the limit of {max_body_bytes} bytes.", []),
        (_status("EQ", 408), "request_timeout", "invalid_request_error", "invalid_request_error",
         "Timeout: the request took too long to arrive.", []),
        (_status("EQ", 431), "request_headers_too_large", "invalid_request_error", "invalid_request_error",
         "The request carries too many or too large headers.", []),
        (_status("EQ", 404), "unknown_endpoint", "invalid_request_error", "not_found_error",
         "No backend serves this request.", []),
        (_status("GE", 500), "proxy_error", "server_error", "api_error",
         "The router could not process this request.", []),
        (_status("GE", 400), "invalid_request", "invalid_request_error", "invalid_request_error",
         "The request could not be read.", []),
    ]


def _mappers(reply: _Reply, anthropic: dict[str, Any], when: dict[str, Any] | None) -> list[dict[str, Any]]:
    status, code, otype, atype, message, headers = reply
    extra = {"headers_to_add": headers} if headers else {}
    shapes = (
        (anthropic, {"type": "error", "error": {"type": atype, "message": message}}),
        (None, {"error": {"message": message, "type": otype, "param": None, "code": code}}),
    )
    out = []
    for family, body in shapes:
        parts = [status] + ([family] if family else []) + ([when] if when else [])
        out.append({
            "filter": {"and_filter": {"filters": parts}} if len(parts) > 1 else status,
            **extra,
            "body_format_override": {"json_format": body, "content_type": "application/json"},
        })
    return out


def local_reply_config(max_body_bytes: int) -> dict[str, Any]:
    """Envoy's ``local_reply_config``: the sidecar's replies untouched, then
    the rate limiter's 429, then Envoy's own replies by status and family."""
    # The decision's family once the sidecar has decided (it may have rewritten
    # /anthropic/v1/messages to the backend's /v1/messages); the path before that.
    anthropic = {"or_filter": {"filters": [
        {"metadata_filter": {
            "matcher": {"filter": NAMESPACE, "path": [{"key": decision.FAMILY}],
                        "value": {"string_match": {"exact": "anthropic"}}},
            "match_if_key_not_found": False,
        }},
        {"header_filter": {"header": {"name": ":path", "string_match": {"prefix": "/anthropic/"}}}},
    ]}}
    mappers: list[dict[str, Any]] = [{"filter": _meta_present(decision.REPLY)}, *envoy_limits.reply_mappers(anthropic)]
    routed = _meta_present(decision.CLIENT_MODEL)
    for reply in _routed_replies():
        mappers += _mappers(reply, anthropic, routed)
    for reply in _replies(max_body_bytes):
        mappers += _mappers(reply, anthropic, None)
    return {"mappers": mappers}
