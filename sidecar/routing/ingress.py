"""The ingress table: which request paths the sidecar decides, and how.

Every per-path difference in behaviour is a column here, so the request path
reads one row instead of testing the path in many places.

A row is found by any spelling an engine would serve as that endpoint: a
trailing slash, another letter case, and the row's ``spellings`` (for
example ``/v1/messages``, which Anthropic-compatible engines serve as
Messages). Whatever the spelling, the request goes upstream on the row's
``upstream_path``, so no spelling reaches an endpoint without its decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, unquote_to_bytes

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
    # A buffered answer may come from the response cache.
    cacheable: bool = False
    # Other paths that name this endpoint.
    spellings: tuple[str, ...] = ()
    # Responses API: the answer's response ids name the backend that stores it.
    response_ids: bool = False
    # Responses API: ``previous_response_id`` in the body names the backend to use.
    continues: bool = False


_ROWS = [
    Ingress("/v1/chat/completions", "openai", "json", "/v1/chat/completions", suffixes=True, cacheable=True),
    Ingress("/v1/completions", "openai", "json", "/v1/completions", cacheable=True),
    Ingress("/v1/embeddings", "openai", "json", "/v1/embeddings", cacheable=True),
    Ingress("/v1/responses", "openai", "json", "/v1/responses", aliases=True, cacheable=True,
            response_ids=True, continues=True),
    Ingress("/v1/responses/compact", "openai", "json", "/v1/responses/compact", aliases=True, continues=True),
    Ingress(
        "/anthropic/v1/messages", "anthropic", "json", "/v1/messages", aliases=True, cacheable=True,
        spellings=("/v1/messages",),
    ),
    Ingress(
        "/anthropic/v1/messages/count_tokens", "anthropic", "json", "/v1/messages/count_tokens",
        aliases=True, counted=False, usage=False, spellings=("/v1/messages/count_tokens",),
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
_BY_SPELLING: dict[str, Ingress] = {p.lower(): row for row in _ROWS for p in (row.path, *row.spellings)}

# Listings the sidecar answers itself; ``/{id}`` below them names one model.
_LISTINGS = ("/anthropic/v1/models", "/v1/models")


def _base(path: str) -> str:
    """The path without its query string and trailing slashes."""
    return path.partition("?")[0].rstrip("/") or "/"


def lookup(path: str) -> Ingress | None:
    """The ingress for a (canonical) request path, or None when it is not a model endpoint."""
    return _BY_SPELLING.get(_base(path).lower())


def listing_path(path: str) -> str | None:
    """The listing a path asks for, spelled as the table spells it (the model
    id of ``/v1/models/{id}`` keeps its case), or None."""
    base = _base(path)
    low = base.lower()
    for prefix in _LISTINGS:
        if low == prefix or low.startswith(prefix + "/"):
            return prefix + base[len(prefix):]
    return None


# Calls about one stored response: /v1/responses/{id}[/cancel|/input_items].
_RESPONSES = "/v1/responses/"
_ABOUT = ("", "/cancel", "/input_items")


def follow_up(path: str) -> tuple[str, str] | None:
    """``(response id, what the call asks)`` of a (canonical) path about one
    stored response, the second being ``""``, ``"/cancel"`` or
    ``"/input_items"``; None for any other path. Call after :func:`lookup`,
    whose rows (``/v1/responses/compact``) win."""
    base = _base(path)
    if base[: len(_RESPONSES)].lower() != _RESPONSES:
        return None
    rid, _, rest = base[len(_RESPONSES):].partition("/")
    rest = "/" + rest.lower() if rest else ""
    if not rid or rest not in _ABOUT:
        return None
    return rid, rest


def family_for(path: str) -> Family:
    """The API family whose error shape a path's answers use."""
    row = lookup(path)
    if row is not None:
        return row.family
    return "anthropic" if path.lower().startswith("/anthropic/") else "openai"


def path_problem(path: str) -> str | None:
    """Why a request path cannot be decided as the engine will read it, or None.

    Engines decode a path's percent-escapes once more before routing, so a
    path that still holds an escape after the router's decode
    (``/v1/chat/%2563ompletions``) would name one endpoint to the router and
    another to the engine; ``%3F``, ``%23``, spaces and control characters
    would turn path bytes into a query, a fragment or a broken request line.
    """
    base = path.partition("?")[0]
    if "%" not in base and base.isascii() and base.isprintable() and " " not in base:
        return None  # every character visible ASCII (0x21-0x7E), checked natively
    try:
        decoded = unquote_to_bytes(base).decode("utf-8")
    except UnicodeDecodeError:
        return "The request path has percent-escapes that are not UTF-8."
    if "%" in decoded:
        return "The request path still holds percent-escapes after decoding (it is encoded twice)."
    if "?" in decoded or "#" in decoded:
        return "The request path encodes '?' or '#'."
    if any(ord(c) <= 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" for c in decoded):
        return "The request path holds spaces or control characters."
    return None


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
