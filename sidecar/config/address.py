"""``host:port``: the one reading of a listen or endpoint address.

An IPv6 host is written in brackets (``[::1]:9000``); :func:`split` returns it
without them and :func:`join` puts them back.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def split(addr: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``, the host without IPv6 brackets; ValueError if malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be host:port")
    return host.strip("[]"), int(port)


def host_of(addr: str) -> str:
    """The host of ``host:port`` without IPv6 brackets (the text before the last colon)."""
    return addr.rpartition(":")[0].strip("[]")


def join(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def shifted(addr: str, offset: int) -> str:
    """The same host, ``offset`` ports further on."""
    host, port = split(addr)
    return join(host, port + offset)


def split_url(url: str) -> tuple[str, int, bool, str]:
    """``(host, port, tls, base path)`` of a backend URL; the base path drops a
    trailing ``/v1`` (operators often paste an SDK base URL, and the ingress
    paths carry ``/v1`` already)."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return parts.hostname or "", port, tls, path
