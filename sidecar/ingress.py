"""The ingress table: which request paths the sidecar decides, and how.

Every per-path difference in behaviour is a column here, so the request path
reads one row instead of testing the path in many places.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

Family = Literal["openai", "anthropic"]
BodyKind = Literal["json", "multipart", "query"]


@dataclass(frozen=True)
class Ingress:
    path: str
    family: Family
    body: BodyKind
    # Where the request lands on a backend, relative to the backend's base URL.
    upstream_path: str
    # model_experiments resolve the client-facing name here.
    experiments: bool = True
    # model_aliases rewrite the requested name before anything else.
    aliases: bool = False
    # OpenRouter-style variant suffixes (:nitro, :floor, ...) are read here.
    suffixes: bool = False
    # Counted in the per-arm request and duration metrics.
    counted: bool = True
    # Response carries token usage worth reading.
    usage: bool = True


_ROWS = [
    Ingress("/v1/chat/completions", "openai", "json", "/v1/chat/completions", suffixes=True),
    Ingress("/v1/completions", "openai", "json", "/v1/completions"),
    Ingress("/v1/embeddings", "openai", "json", "/v1/embeddings"),
    Ingress("/v1/responses", "openai", "json", "/v1/responses", aliases=True),
    Ingress("/v1/responses/compact", "openai", "json", "/v1/responses/compact", aliases=True),
    Ingress("/anthropic/v1/messages", "anthropic", "json", "/v1/messages", aliases=True),
    Ingress(
        "/anthropic/v1/messages/count_tokens", "anthropic", "json", "/v1/messages/count_tokens",
        aliases=True, counted=False, usage=False,
    ),
    Ingress("/v1/images/generations", "openai", "json", "/v1/images/generations"),
    Ingress("/v1/images/edits", "openai", "multipart", "/v1/images/edits"),
    Ingress("/v1/images/variations", "openai", "multipart", "/v1/images/variations"),
    # Literal dispatch: the requested name is the upstream model.
    Ingress("/v1/rerank", "openai", "json", "/v1/rerank", experiments=False, usage=False),
    Ingress("/embed_sparse", "openai", "json", "/embed_sparse", experiments=False, usage=False),
    Ingress("/v1/realtime", "openai", "query", "/v1/realtime", experiments=False, usage=False),
]

INGRESSES: dict[str, Ingress] = {row.path: row for row in _ROWS}


def lookup(path: str) -> Ingress | None:
    """The ingress for a request path (query string ignored), or None to pass through."""
    q = path.find("?")
    if q >= 0:
        path = path[:q]
    return INGRESSES.get(path)


def canonical(path: str) -> str:
    """The path as a backend will understand it: percent-escapes decoded, dot
    segments resolved, repeated slashes merged (query string kept as sent).

    Decisions are made on this form, and it is what goes upstream, so a
    spelling such as ``/v1/chat/%63ompletions`` cannot reach a backend's chat
    endpoint without the decision that endpoint gets.
    """
    base, sep, query = path.partition("?")
    if "%" not in base and "//" not in base and "/." not in base:
        return path
    decoded = unquote(base)
    parts: list[str] = []
    for seg in decoded.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if parts:
                parts.pop()
            continue
        parts.append(seg)
    out = "/" + "/".join(parts)
    if decoded.endswith("/") and parts:
        out += "/"
    return out + sep + query
