"""The Envoy side of ``limits:``: request rates enforced by Envoy's local
rate-limit filter, and OpenAI's ``x-ratelimit-*`` response headers.

The sidecar's decision names the limit a request falls under in two request
headers (:mod:`sidecar.config.limits`); the filter, after ext_proc in the chain,
turns them into descriptors (model; model and key id) and counts them
against one token bucket per configured rate. It reports its count as
``x-ratelimit-limit`` / ``-remaining`` / ``-reset`` (draft 03), which a
header-mutation filter renames to OpenAI's ``-requests`` names on the way
out. Token-budget headers come from the decision's metadata. Envoy also
answers its own 429 in the ingress's error shape, naming the model.
"""

from __future__ import annotations

from typing import Any

from .. import decision
from ..config.limits import (
    KEY_ENTRY,
    KEY_HEADER,
    MODEL_ENTRY,
    MODEL_HEADER,
    RATE_LIMIT_DOMAIN,
    SHARED_KEY_HEADER,
    SHARED_MODEL_HEADER,
    index,
)
from ..config.schema import RESERVED_BACKEND_NAME, Config
from ..contract import NAMESPACE as NAMESPACE

_T = "type.googleapis.com/"
_RAW = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")  # the filter's own names
REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
TOKEN_HEADERS = {
    "x-ratelimit-limit-tokens": decision.X_RATELIMIT_LIMIT_TOKENS,
    "x-ratelimit-remaining-tokens": decision.X_RATELIMIT_REMAINING_TOKENS,
    "x-ratelimit-reset-tokens": decision.X_RATELIMIT_RESET_TOKENS,
}
# Request headers that must never reach a backend.
INTERNAL_REQUEST_HEADERS = (MODEL_HEADER, KEY_HEADER, SHARED_MODEL_HEADER, SHARED_KEY_HEADER)


def _set(name: str, value: str) -> dict[str, Any]:
    return {"append": {"header": {"key": name, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                       "keep_empty_value": False}}


def _actions(model_header: str, key_header: str) -> list[dict[str, Any]]:
    """Two descriptors from the decision's headers: (model), and (model, key id)."""
    model = {"request_headers": {"header_name": model_header, "descriptor_key": MODEL_ENTRY}}
    key = {"request_headers": {"header_name": key_header, "descriptor_key": KEY_ENTRY}}
    return [{"actions": [model]}, {"actions": [model, key]}]


def _shared_filter(config: Config) -> list[dict[str, Any]]:
    """Envoy's global rate-limit filter, asking the sidecar's service
    (:mod:`sidecar.handlers.ratelimit`) about shared rates only."""
    if not any(lim.shared for lim in config.limits) or config.redis is None:
        return []
    return [{
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": RATE_LIMIT_DOMAIN,
            "stat_prefix": "model_router_shared_limits",
            # The service answers within Redis's timeout; past this, the request goes on.
            "timeout": f"{(config.redis.timeout_ms + 200) / 1000:.3f}s",
            "failure_mode_deny": False,
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
            "rate_limit_service": {
                "grpc_service": {"envoy_grpc": {"cluster_name": RESERVED_BACKEND_NAME}},
                "transport_api_version": "V3",
            },
            "rate_limits": _actions(SHARED_MODEL_HEADER, SHARED_KEY_HEADER),
        },
    }]


def filters(config: Config) -> list[dict[str, Any]]:
    """The filters that go right after ext_proc (none without a request rate)."""
    if not any(lim.rate is not None for lim in config.limits):
        return []
    descriptors = []
    for rules in index(config).values():
        for r in rules:
            if r.rate is None or r.shared:
                continue
            entries = [{"key": MODEL_ENTRY, "value": r.model}]
            if r.key_id is not None:
                entries.append({"key": KEY_ENTRY, "value": r.key_id})
            requests, per = r.rate
            descriptors.append({"entries": entries, "token_bucket": {
                "max_tokens": r.burst, "tokens_per_fill": requests, "fill_interval": f"{per}s",
            }})
    always = {"runtime_key": "model_router.limits_enabled", "default_value": {"numerator": 100, "denominator": "HUNDRED"}}
    # The filters' own counts under OpenAI's names. The limit comes from the
    # decision (Envoy writes draft 03's "4, 4;w=60"); the reset count becomes a
    # duration only when the decision says a rate applies (else the header
    # stays empty, so unsent).
    reset = f"%RESP(x-ratelimit-reset)%%DYNAMIC_METADATA({NAMESPACE}:{decision.X_RL_UNIT})%"
    values = (f"%DYNAMIC_METADATA({NAMESPACE}:{decision.X_RL_LIMIT})%", "%RESP(x-ratelimit-remaining)%", reset)
    local = [] if not descriptors else [{
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "model_router_limits",
            "filter_enabled": always,
            "filter_enforced": always,
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
            "always_consume_default_token_bucket": False,
            # No default bucket: a request the decision names no rate for is never counted.
            "rate_limits": _actions(MODEL_HEADER, KEY_HEADER),
            "descriptors": descriptors,
        },
    }]
    return [
        {
            "name": "envoy.filters.http.header_mutation",
            "typed_config": {
                "@type": _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"response_mutations": [
                    *(_set(name, value) for name, value in zip(REQUEST_HEADERS, values)),
                    *({"remove": raw} for raw in _RAW),
                ]},
            },
        },
        *local,
        *_shared_filter(config),
    ]


def response_headers_to_add() -> list[dict[str, Any]]:
    """Token-budget headers from the decision's metadata (absent: not sent)."""
    return [
        {"header": {"key": name, "value": f"%DYNAMIC_METADATA({NAMESPACE}:{key})%"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}
        for name, key in TOKEN_HEADERS.items()
    ]


def response_headers_to_remove(config: Config) -> list[str]:
    """An upstream's copies of the filter's own header names, which would
    otherwise be renamed as if they were the router's count."""
    return list(_RAW) if any(lim.rate is not None for lim in config.limits) else []


def reply_mappers(anthropic: dict[str, Any]) -> list[dict[str, Any]]:
    """Envoy's own 429 (the request-rate filter) in the ingress's shape."""
    status = {"status_code_filter": {"comparison": {
        "op": "EQ", "value": {"default_value": 429, "runtime_key": "model_router.local_reply_status_429"},
    }}}
    message = (f"Rate limit reached for the model '%DYNAMIC_METADATA({NAMESPACE}:{decision.LIMIT_MODEL})%': too many "
               "requests. The x-ratelimit-reset-requests header says when the limit resets.")
    openai = {"error": {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    claude = {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    return [
        {"filter": {"and_filter": {"filters": [status, anthropic]}},
         "body_format_override": {"json_format": claude, "content_type": "application/json"}},
        {"filter": status,
         "body_format_override": {"json_format": openai, "content_type": "application/json"}},
    ]
