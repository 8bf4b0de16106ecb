"""What the monitor knows about one backend, and the pure readings behind it.

:class:`BackendState` is what routing sees of a backend (through
``routing.selection.BackendView``); :func:`parse_models`, :func:`auth_headers`
and :func:`poll_url` are the readings the monitor's polls are built from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import orjson

from ..payload.body import model_name_problem
from ..routing.route import credentials
from ..routing.selection import admissible, fresh
from ..routing.snapshot import BackendInfo

ANTHROPIC_VERSION = "2023-06-01"

MetricsStatus = Literal["ok", "missing", "failed"]
"""A scrape's outcome: the engine's series read; an answer (a page, a 4xx or a 501) without any; no usable answer."""

@dataclass(frozen=True)
class BackendState:
    """What the monitor knows about one backend, as of one publication.

    ``healthy`` is the verdict of the active health checks (True when the
    backend has no probe path or has not been checked yet); ``probe_failures``
    counts the failed checks since the last passed one. A passive hold-out is
    reported separately in ``held_out_until`` because it ends by the clock;
    :meth:`admissible` combines both. ``engine`` names the engine whose series
    are read (for a backend whose type names none, the one its page showed);
    ``metrics`` is the latest scrape's :data:`MetricsStatus`.
    """

    name: str
    healthy: bool = True
    probe_failures: int = 0
    held_out_until: float = 0.0
    models: tuple[str, ...] | None = None
    models_ok: bool = False
    engine: str | None = None
    metrics: MetricsStatus | None = None
    throughput_tps: float | None = None
    waiting: float | None = None
    running: float | None = None
    scraped_at: float | None = None

    def held_out(self, now: float) -> bool:
        """Whether a passive failure still holds the backend out at ``now``."""
        return now < self.held_out_until

    def fresh(self, now: float, freshness_s: float) -> bool:
        """Whether the latest successful scrape is at most ``freshness_s`` old at ``now``."""
        return fresh(self.scraped_at, now, freshness_s)

    def admissible(self, now: float, max_waiting: int | None, freshness_s: float | None = None) -> bool:
        """:func:`sidecar.routing.selection.admissible`, the rule routing applies too."""
        return admissible(self, now, max_waiting, freshness_s)


def parse_models(body: bytes | str) -> tuple[str, ...]:
    """Model ids of an OpenAI/Anthropic ``{"data": [{"id": ...}, ...]}`` list, in order, deduplicated.

    An entry's ``aliases`` list is read too: llama-server started with
    ``--alias a,b`` lists one entry whose ``id`` is one of the names and whose
    ``aliases`` hold them all, and it answers to each. Names no request could
    ask for (:func:`sidecar.payload.body.model_name_problem`: not a string,
    empty or spaces only, over 256 characters, or with a C0 or C1 control,
    DEL, U+2028 or U+2029) are skipped; a body of another shape raises
    ``ValueError``.
    """
    doc = orjson.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("model list has no 'data' array")
    out: dict[str, None] = {}
    for item in data:
        if not isinstance(item, dict):
            continue
        aliases = item.get("aliases")
        for name in (item.get("id"), *(aliases if isinstance(aliases, list) else ())):
            if model_name_problem(name) is None:
                out.setdefault(name, None)
    return tuple(out)


def auth_headers(info: BackendInfo) -> dict[str, str]:
    """The credentials a request to this backend carries (none without an api_key)."""
    headers = dict(credentials(info))
    if headers and info.family == "anthropic":
        headers["anthropic-version"] = ANTHROPIC_VERSION
    return headers


def poll_url(info: BackendInfo, path: str) -> str:
    """``<scheme>://<authority><base_path><path>`` for a backend."""
    parts = urlsplit(info.url)
    return f"{parts.scheme}://{parts.netloc}{info.base_path}{path}"
