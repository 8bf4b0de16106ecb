"""Edits to the config file itself: pausing an arm, masking secrets, atomic writes.

The file stays the one source of truth, so every replica reading it agrees:
an edit is made on the YAML text, validated by the loader, written to a
temporary file beside the original and renamed over it; the sidecars' reload
picks it up. Edits go through ruamel.yaml's round-trip mode, which keeps
comments, key order, quoting, block or flow style and ``${ENV}`` references;
it normalises indentation to two spaces (sequences indented under their key
as the file had them, when consistent) and may rewrap very long lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError

from . import schema as config_mod

# What GET /admin/config shows in place of a secret; PUT refuses it back.
MASK = "**masked**"


class EditError(Exception):
    """An edit that cannot be made; the message says why, with the field path."""


def _yaml() -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)
    return y


def _load(text: str) -> tuple[YAML, Any]:
    y = _yaml()
    try:
        doc = y.load(text)
    except YAMLError:
        raise EditError("(root): not valid YAML (run `model-router config validate` for the position)") from None
    if not isinstance(doc, dict):
        raise EditError("(root): must be a mapping of sections")
    return y, doc


def _dump(y: YAML, doc: Any) -> str:
    out = io.StringIO()
    y.dump(doc, out)
    return out.getvalue()


# --------------------------------------------------------------------------- pause


def set_paused(text: str, experiment: str, variant: str, paused: bool) -> tuple[str, bool]:
    """The config text with that arm paused or resumed, and whether it changed.

    A paused arm keeps its ``weight``; ``paused: true`` takes it out of the
    race. Resuming removes the field, so the file reads as before the pause.
    Raises :class:`EditError` when the experiment or the variant is not there.
    """
    y, doc = _load(text)
    experiments = doc.get("model_experiments") or []
    for i, e in enumerate(experiments):
        if not isinstance(e, dict) or e.get("name") != experiment:
            continue
        for v in e.get("variants") or []:
            if not isinstance(v, CommentedMap) or v.get("id") != variant:
                continue
            if bool(v.get("paused", False)) == paused:
                return text, False
            if paused:
                keys = list(v.keys())
                at = keys.index("weight") + 1 if "weight" in keys else len(keys)
                v.insert(at, "paused", True)
            else:
                del v["paused"]
            return _dump(y, doc), True
        raise EditError(f"model_experiments[{i}].variants: experiment '{experiment}' has no variant '{variant}'")
    raise EditError(f"model_experiments: no experiment named '{experiment}'")


# --------------------------------------------------------------------------- secrets


def _secret_fields(doc: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field path, container, key) of every value that may hold a secret."""
    out: list[tuple[str, Any, Any]] = []
    server = doc.get("server")
    if isinstance(server, dict) and "admin_token" in server:
        out.append(("server.admin_token", server, "admin_token"))
    auth = server.get("grpc_auth") if isinstance(server, dict) else None
    for name in ("secret", "assignment_token"):
        if isinstance(auth, dict) and name in auth:
            out.append((f"server.grpc_auth.{name}", auth, name))
    for i, b in enumerate(doc.get("backends") or []):
        if isinstance(b, dict) and "api_key" in b:
            out.append((f"backends[{i}].api_key", b, "api_key"))
    for i, k in enumerate(doc.get("api_keys") or []):
        if isinstance(k, dict) and "key" in k:
            out.append((f"api_keys[{i}].key", k, "key"))
    ws = doc.get("web_search")
    if isinstance(ws, dict) and "api_key" in ws:
        out.append(("web_search.api_key", ws, "api_key"))
    redis = doc.get("redis")
    if isinstance(redis, dict) and "url" in redis:
        out.append(("redis.url", redis, "url"))
    return out


def _is_reference(value: str) -> bool:
    return config_mod._ENV_RE.fullmatch(value) is not None


def _masked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None or _is_reference(parts.password):
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))


def masked(text: str) -> str:
    """The config text with every secret replaced by :data:`MASK`.

    Masked: ``server.admin_token``, ``server.grpc_auth.secret`` and
    ``.assignment_token``, ``backends[].api_key``, ``api_keys[].key``,
    ``web_search.api_key`` and the password of ``redis.url``. A value that is
    only an ``${ENV}`` reference is shown: it names the secret, it is not one.
    """
    y, doc = _load(text)
    for path, container, key in _secret_fields(doc):
        value = container[key]
        if not isinstance(value, str) or _is_reference(value):
            continue
        container[key] = _masked_url(value) if path == "redis.url" else MASK
    return _dump(y, doc)


def still_masked(text: str) -> list[str]:
    """Loader-style errors for secrets a client sent back as :data:`MASK`."""
    try:
        _, doc = _load(text)
    except EditError:
        return []  # the loader reports it
    return [
        f"{path}: still masked as GET /admin/config shows it; send the value or an ${{ENV}} reference"
        for path, container, key in _secret_fields(doc)
        if isinstance(container[key], str) and MASK in container[key]
    ]


# --------------------------------------------------------------------------- writing


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold the config file's write lock (``fcntl.flock`` on a ``.<name>.lock``
    file beside it): every writer (the admin API of each sidecar, ``model-router
    experiments pause``) reads, edits and writes under it, so no edit is lost to
    another made at the same moment. Raises OSError when the lock file cannot
    be opened (a read-only directory, where no write could succeed either)."""
    target = Path(os.path.realpath(path))
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_atomic(path: str | Path, text: str) -> None:
    """Replace the file's content in one rename (through a symlink, its target),
    keeping its permission bits; readers see the old file or the new one."""
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o640
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
