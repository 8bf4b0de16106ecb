"""The serving process's state: the config snapshot, its reloads, the monitor's
backend states, the usage sink and the request count the recycle bound reads."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from .. import metrics
from ..accounting.budgets import Budgets
from ..accounting.metering import JsonLinesSink
from ..accounting.tracing import Tracer
from ..backends.monitor import Monitor
from ..backends.state import BackendState
from ..config import guard as config_guard
from ..config import schema as config_mod
from ..experiments import feedback
from ..payload import response_ids
from ..routing import snapshot
from ..stores import cache
from . import grpc_auth, workers

log = logging.getLogger("model_router.server")


def prime_metrics(config: config_mod.Config) -> None:
    """Every labelled series a config implies, at zero: the router's own, the cache's and feedback's."""
    metrics.prime(config)
    if config.cache is not None:
        cache.prime(config)
    feedback.prime(config)


class Runtime:
    """Holds the current snapshot; a reload swaps it in one assignment."""

    def __init__(
        self, path: str | Path, url_overrides: Mapping[str, str] | None = None, usage_records: str | None = None,
        grpc_secret_file: str | None = None, admin_path_root: str | None = None,
        recycle_bound: int | None = None,
    ):
        self.path = Path(path)
        self.admin_path_root = admin_path_root  # where the admin API may point file fields
        self.admin_writes = asyncio.Lock()  # one admin config write at a time in this process
        self.grpc_secret_file = grpc_secret_file  # overrides server.grpc_auth's secret
        self.url_overrides = dict(url_overrides or {})
        loaded = config_mod.load(self.path)
        for w in loaded.warnings:
            log.warning("config: %s", w)
        self.id_key = self._id_key(loaded.config)
        self.snapshot = snapshot.build(loaded.config, self.url_overrides, id_key=self.id_key)
        self._stamp = self._file_stamp()
        self.ready = False
        self.monitor: Monitor | None = None
        self._http: aiohttp.ClientSession | None = None
        self.usage_records = usage_records  # overrides metering.usage_records
        self._sink: JsonLinesSink | None = None
        bound = loaded.config.server.max_requests_per_worker if recycle_bound is None else recycle_bound
        # Each worker draws its own bound near the configured one, so they do not recycle together.
        self.recycle_after = int(bound * random.uniform(0.9, 1.1)) if bound else 0
        self.requests = 0
        self.on_due: Callable[[], None] | None = None  # without a supervisor: what to do at the bound
        self.budgets = Budgets(lambda: self.snapshot)
        self.tracer = Tracer(lambda: self.snapshot.config.tracing, server_of=self._server_of)
        prime_metrics(loaded.config)
        metrics.CONFIG_RELOADS.labels("success").inc()
        metrics.CONFIG_LOADED.set(time.time())

    def _id_key(self, config: config_mod.Config) -> bytes:
        """The key sealing response ids: from the gRPC secret every replica
        shares; without one, this process's own (ids last as long as it).
        Read at start, like the gRPC gate: Envoy's secret changes with a restart."""
        try:
            secret = grpc_auth.secret_of(config.server.grpc_auth, self.grpc_secret_file)
        except grpc_auth.SecretError as exc:
            raise SystemExit(f"error: {exc}") from None
        return response_ids.derive(secret) if secret else response_ids.PROCESS_KEY

    def _server_of(self, backend: str) -> tuple[str, int] | None:
        info = self.snapshot.backends.get(backend)
        return (info.host, info.port) if info is not None else None

    def exports_traces(self) -> bool:
        """Whether this process exports spans now (the config and ``OTEL_*`` variables)."""
        return self.tracer.on()

    def http_session(self) -> aiohttp.ClientSession:
        """One client session for the sidecar's own upstream calls (the :online loop)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._sink is not None:
            self._sink.close()

    def usage_sink(self) -> JsonLinesSink | None:
        """Where usage records go under the current config (reopened when it changes)."""
        path = self.usage_records or self.snapshot.config.metering.usage_records
        if self._sink is not None and self._sink.path != path:
            self._sink.close()
            self._sink = None
        if self._sink is None and path:
            try:
                self._sink = JsonLinesSink(path)
            except OSError as exc:
                log.error("usage records: cannot open %s: %s", path, exc)
        return self._sink

    def set_discovered(self, discovered: dict[str, tuple[str, ...]]) -> None:
        """The monitor found new model lists: rebuild the snapshot around them."""
        self.snapshot = snapshot.build(self.snapshot.config, self.url_overrides, discovered, self.id_key)
        log.info("model lists discovered: %s", {k: len(v) for k, v in discovered.items()})

    def count_request(self) -> None:
        """One more request decided here; once the bound is reached the
        supervisor hears, or without one the process retires (``on_due``)."""
        self.requests += 1
        if self.requests == self.recycle_after:
            if workers.supervised():
                log.info("%d requests served: asking for a replacement", self.requests)
                workers.notify("recycle")
            elif self.on_due is not None:
                log.info("%d requests served: leaving the endpoints, draining and exiting to be started again",
                         self.requests)
                self.on_due()

    def backend_states(self) -> Mapping[str, BackendState]:
        return self.monitor.states if self.monitor is not None else {}

    def report_response(self, backend: str, status: int | None) -> None:
        if self.monitor is not None:
            self.monitor.report_response(backend, status)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def reload_if_changed(self) -> bool | None:
        """Reload when the file changed. True: applied, False: rejected, None: unchanged."""
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        return self.reload()

    def candidate(self, text: str) -> config_mod.Loaded:
        """Config text from the admin API validated as a reload validates a
        file, and not applied; it may change file paths only inside
        ``admin_path_root``. Raises :class:`~sidecar.config.schema.ConfigError`."""
        loaded = config_mod.parse(text)
        paths = config_guard.path_errors(self.snapshot.config, loaded.config, self.admin_path_root)
        if paths:
            raise config_mod.ConfigError(paths, loaded.warnings)
        try:
            snapshot.build(loaded.config, self.url_overrides, self.snapshot.discovered)
        except Exception as exc:
            raise config_mod.ConfigError([f"(root): {type(exc).__name__}"], loaded.warnings) from None
        return loaded

    def reload(self, mark_seen: bool = False) -> bool:
        """Load the file again; ``mark_seen``: the watcher need not reload this version."""
        if mark_seen:
            self._stamp = self._file_stamp()
        try:
            loaded = config_mod.load(self.path)
            new = snapshot.build(loaded.config, self.url_overrides, self.snapshot.discovered, self.id_key)
        except Exception as exc:  # any failure rejects the edit; the watcher must live on
            metrics.CONFIG_RELOADS.labels("failure").inc()
            problems = exc.errors if isinstance(exc, config_mod.ConfigError) else [type(exc).__name__]
            log.error("config reload rejected, the previous config keeps serving: %s", "; ".join(problems))
            return False
        for w in loaded.warnings:
            log.warning("config: %s", w)
        self.snapshot = new
        prime_metrics(loaded.config)
        metrics.CONFIG_RELOADS.labels("success").inc()
        metrics.CONFIG_LOADED.set(time.time())
        log.info("config reloaded from %s", self.path)
        return True

