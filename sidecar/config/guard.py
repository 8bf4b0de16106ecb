"""Bounds on config text, and on what the admin API may change with it.

- Size and alias expansion: a YAML alias repeats a node without copying it,
  so a few hundred bytes can stand for billions of nodes that validation would
  walk. Every config, file or admin body, is refused past :data:`MAX_BYTES`
  or once its expanded tree passes :data:`MAX_NODES`.
- ``${ENV}`` values: a loader error or an admin answer shows the reference
  (``${NAME}``), never the value it expanded to.
- Path fields: the admin API may point a file field (usage records, the
  gRPC secret file, the TLS files) only inside the directory the operator gave
  ``serve --admin-path-root``; without it, only the values already in service.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .schema import Config

MAX_BYTES = 1024 * 1024
MAX_NODES = 200_000


MAX_FLOW_DEPTH = 64
_BRACKETS = re.compile(r"[\[\]{}]")


def too_large(text: str) -> str | None:
    """Text refused before YAML reads it: past :data:`MAX_BYTES`, or with flow
    brackets nested past :data:`MAX_FLOW_DEPTH` (PyYAML's scanner takes time
    quadratic in that depth: 2000 levels cost seconds). Brackets are counted
    as written, inside quotes too; a real config nests a few levels."""
    if len(text) > MAX_BYTES:
        return f"(root): the config is larger than {MAX_BYTES} characters"
    depth = 0
    for m in _BRACKETS.finditer(text):
        depth += 1 if m.group() in "[{" else -1
        if depth > MAX_FLOW_DEPTH:
            return "(root): nested too deeply"
    return None


def expansion_error(raw: Any) -> str | None:
    """Whether ``raw`` (as parsed, aliases shared) expands past :data:`MAX_NODES`.
    Each distinct node is sized once (an alias is the same object), so the
    check costs what the text holds, not what it expands to."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(raw, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        kids = list(node.keys()) + list(node.values()) if isinstance(node, dict) else (
            node if isinstance(node, list) else [])
        if not children_done and kids:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
            continue
        sizes[id(node)] = 1 + sum(sizes.get(id(k), 1) for k in kids)
        if sizes[id(node)] > MAX_NODES:
            return (f"(root): the config expands to more than {MAX_NODES} values "
                    "(YAML aliases repeat what they name; write the values out)")
    return None


# Shorter values are no secret worth the noise: replacing "1" would garble "must be >= 1024".
_MIN_REDACTED = 4


def redact_text(text: str, substituted: list[tuple[str, str]]) -> str:
    """``text`` with every value an ``${ENV}`` reference expanded to (of at least
    four characters) put back as that reference."""
    for value, reference in sorted(substituted, key=lambda p: -len(p[0])):
        if len(value) >= _MIN_REDACTED:
            text = text.replace(value, reference)
    return text


def redact_error(error: str, substituted: list[tuple[str, str]]) -> str:
    """A loader error (``path: message``) with its message redacted; the path
    is the config's own field names."""
    path, sep, message = error.partition(": ")
    return path + sep + redact_text(message, substituted) if sep else redact_text(error, substituted)


def redact(obj: Any, substituted: list[tuple[str, str]]) -> Any:
    """:func:`redact_text` over every string (keys included) of a JSON-like answer."""
    if not substituted:
        return obj
    if isinstance(obj, str):
        return redact_text(obj, substituted)
    if isinstance(obj, dict):
        return {redact(k, substituted): redact(v, substituted) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, substituted) for v in obj]
    return obj


def path_fields(config: Config) -> dict[str, str | None]:
    """Every config field naming a file the sidecar opens, by its path."""
    auth = config.server.grpc_auth
    out: dict[str, str | None] = {
        "metering.usage_records": config.metering.usage_records,
        "server.grpc_auth.secret_file": auth.secret_file,
    }
    tls = auth.tls
    for name in ("cert_file", "key_file", "client_ca_file", "envoy_cert_file", "envoy_key_file", "ca_file"):
        out[f"server.grpc_auth.tls.{name}"] = getattr(tls, name) if tls is not None else None
    return out


def _inside(path: str, root: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, base]) == base and real != base


def path_errors(old: Config, new: Config, root: str | None) -> list[str]:
    """Loader-style errors for path fields ``new`` changes outside ``root``."""
    errors = []
    before = path_fields(old)
    for field, value in path_fields(new).items():
        if value is None or value == before[field] or (field == "metering.usage_records" and value == "-"):
            continue
        if root is None:
            errors.append(f"{field}: a file path can change through the admin API only inside the directory "
                          "the sidecar was started with (serve --admin-path-root); edit the file instead")
        elif not _inside(value, root):
            errors.append(f"{field}: must be inside {root} (serve --admin-path-root) when set through the admin API")
    return errors
