"""Backend monitor: health, engine load and served models, kept fresh in the background.

The monitor runs asyncio tasks inside the sidecar process. For every enabled
backend it independently

* checks health at ``<origin><base_path><probe_path>`` when the backend has a
  probe path (2xx: a passed check; anything else, an error or a timeout: a
  failed one). The engine's :class:`~sidecar.config.engines.HealthCheck` says how
  long a check may take and how many failures in a row mark the backend down;
* scrapes ``<origin><base_path><scrape_path>`` (Prometheus text) for the load
  figures of the backend's engine (:mod:`sidecar.config.engines`), when the backend
  has a scrape path;
* lists ``<origin><base_path>/v1/models`` with the backend's credentials.

``origin`` is the scheme and authority of the backend's effective URL; the
URL's path is already in ``base_path``.

Results are published as an immutable mapping of
:class:`~sidecar.backends.state.BackendState`; a
new mapping object replaces the old one whenever anything changes, so the
routing decision takes one reference per request and never sees a partial
update. Passive health (:meth:`Monitor.report_response`) holds a backend
out for ``monitor.passive_holdout_s`` after a 5xx or a reset; the hold-out
ends by the clock, with no task involved.

The monitor's settings (``config.monitor``) and the backend list are read
from the current snapshot on every loop iteration, so a config reload takes
effect without a restart. With ``monitor.enabled: false`` nothing polls and
every backend is reported healthy with unknown load and no discovered models.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from urllib.parse import urlsplit

import aiohttp

from ..config.engines import (
    ENGINES,
    DecodeReading,
    EngineMetrics,
    HealthCheck,
    Reading,
    counter_throughput,
    decode_speed,
    parse_engine_metrics,
)
from ..config.schema import Monitor as MonitorConfig
from ..metrics import BACKEND_METRICS_MISSING as METRICS_MISSING
from ..routing.selection import fresh
from ..routing.snapshot import BackendInfo, Snapshot
from .state import BackendState, MetricsStatus, auth_headers, parse_models, poll_url

__all__ = ["USER_AGENT", "Monitor"]

log = logging.getLogger("model_router.monitor")

USER_AGENT = "model-router-monitor"
"""Every poll's user agent: what tells an engine's own request log the monitor's polls apart."""
MODELS_PATH = "/v1/models"
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest probe, metrics or model-list body read; a larger one is a failed poll."""
MAX_RECONCILE_S = 0.5
"""Longest wait before a config change (backends added/removed, monitor toggled) is seen."""
MAX_SLEEP_CHUNK_S = 1.0
"""Longest single sleep of a poll loop, so a shortened interval is seen promptly."""
IDLE_KEEPALIVE_S = 2.5
"""Longest a polling connection is kept idle for reuse: half the 5 s after which vLLM's and
SGLang's servers close an idle connection, so a poll never goes out on a socket the server
is closing. (aiohttp also retries an idempotent request once when a reused connection
turns out closed.)"""

def _pollable(info: BackendInfo) -> bool:
    return info.config.enabled and urlsplit(info.url).scheme in ("http", "https")


# --------------------------------------------------------------------------- monitor


class _PollError(Exception):
    """A poll that got no usable answer; the message is safe to log."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of a non-2xx answer


@dataclass
class _Track:
    """Mutable per-backend bookkeeping; published as a BackendState."""

    url: str
    generation: int = 0
    probe_ok: bool = True
    probe_failures: int = 0  # failed health checks since the last passed one
    probe_passed: bool = False  # a check has passed since this track began
    held_out_until: float = 0.0
    models: tuple[str, ...] | None = None
    models_ok: bool = False
    models_polled: bool = False
    metrics: MetricsStatus | None = None  # the latest scrape's outcome; None: not scraped yet
    missing_warned: bool = False  # the missing metrics were logged; again only after they were seen
    engine: str | None = None
    scraped_at: float | None = None
    readings: tuple[Reading | DecodeReading, ...] = ()  # the token counters' recent readings, oldest first
    tps: float | None = None
    waiting: float | None = None
    running: float | None = None

    def reset_load(self) -> None:
        self.metrics = self.engine = None
        self.missing_warned = False
        self.readings = ()
        self.scraped_at = self.tps = self.waiting = self.running = None


class Monitor:
    """Keeps :attr:`states` current for every backend of ``get_snapshot()``.

    ``clock`` stamps scrapes and hold-outs (monotonic seconds); poll timing
    uses the event loop's own clock. ``on_models_changed`` is called, on the
    event loop, with ``{backend: models}`` for every backend with a known
    model list whenever that mapping changes.
    """

    def __init__(
        self,
        get_snapshot: Callable[[], Snapshot],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_models_changed: Callable[[dict[str, tuple[str, ...]]], None] | None = None,
    ) -> None:
        self._get_snapshot = get_snapshot
        self._clock = clock
        self._on_models_changed = on_models_changed
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._order: tuple[str, ...] = ()
        self._enabled = False
        self._states: Mapping[str, BackendState] = MappingProxyType({})
        self._discovered: dict[str, tuple[str, ...]] = {}
        self._gauged: set[str] = set()  # backends with a METRICS_MISSING series
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False

    # ------------------------------------------------------------------ public

    @property
    def states(self) -> Mapping[str, BackendState]:
        """The current immutable ``{backend: BackendState}``; replaced whole on every change."""
        return self._states

    async def start(self) -> None:
        """Start polling (the first polls begin at once) and return."""
        if self._supervisor is not None:
            return
        self._stopping = False
        snap = self._snapshot()
        timeout = snap.config.monitor.timeout_s if snap is not None else 2.0
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_KEEPALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),
            headers={"user-agent": USER_AGENT},
        )
        if snap is not None:
            self._reconcile(snap)
        self._supervisor = asyncio.create_task(self._supervise(), name="monitor-supervisor")

    async def stop(self) -> None:
        """Cancel every task and close the HTTP session; the last states stay readable."""
        self._stopping = True
        tasks = list(self._tasks.values())
        if self._supervisor is not None:
            tasks.append(self._supervisor)
        self._tasks.clear()
        self._supervisor = None
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def report_response(self, backend: str, status: int | None) -> None:
        """Passive health: a status >= 500, or None (reset, no response), holds the backend out.

        The hold-out lasts ``monitor.passive_holdout_s`` from now; any other
        status, an unknown backend or a disabled monitor changes nothing.
        """
        if status is not None and status < 500:
            return
        snap = self._snapshot()
        if snap is None or not snap.config.monitor.enabled:
            return
        holdout = snap.config.monitor.passive_holdout_s
        with self._lock:
            track = self._tracks.get(backend)
            if track is None or not self._enabled:
                return
            until = self._clock() + holdout
            if until <= track.held_out_until:
                return
            track.held_out_until = until
        self._publish(snap.config.monitor)

    def load(self, state: BackendState, now: float) -> tuple[float | None, float | None, float | None]:
        """``(throughput_tps, waiting, running)``, all None unless the latest scrape is fresh at ``now``."""
        if not state.fresh(now, self._monitor_config().freshness_s):
            return None, None, None
        return state.throughput_tps, state.waiting, state.running

    def throughput(self, state: BackendState, now: float) -> float | None:
        """Generation tokens/s, or None when unknown or the latest scrape is older than ``freshness_s``."""
        return self.load(state, now)[0]

    def admissible(self, state: BackendState, now: float) -> bool:
        """:meth:`BackendState.admissible` with the configured ``max_waiting`` and ``freshness_s``."""
        mon = self._monitor_config()
        return state.admissible(now, mon.max_waiting, mon.freshness_s)

    # ------------------------------------------------------------ bookkeeping

    def _snapshot(self) -> Snapshot | None:
        try:
            return self._get_snapshot()
        except Exception:
            log.warning("monitor: reading the current snapshot failed", exc_info=True)
            return None

    def _monitor_config(self) -> MonitorConfig:
        snap = self._snapshot()
        return snap.config.monitor if snap is not None else MonitorConfig()

    def _wanted_kinds(self, info: BackendInfo) -> set[str]:
        kinds = {"models"}
        if info.config.probe_path:
            kinds.add("probe")
        if info.config.scrape_path:
            kinds.add("scrape")
        return kinds

    def _reconcile(self, snap: Snapshot) -> None:
        """Match tracks and poll tasks to the snapshot's backends and monitor settings."""
        mon = snap.config.monitor
        wanted: set[tuple[str, str]] = set()
        with self._lock:
            self._enabled = mon.enabled
            self._order = tuple(snap.backends)
            for name in list(self._tracks):
                if name not in snap.backends:
                    del self._tracks[name]
            for name, info in snap.backends.items():
                track = self._tracks.get(name)
                active = mon.enabled and _pollable(info)
                if track is None or track.url != info.url or (not active and _differs_from_fresh(track)):
                    generation = track.generation + 1 if track is not None else 0
                    track = self._tracks[name] = _Track(url=info.url, generation=generation)
                if not active:
                    continue
                kinds = self._wanted_kinds(info)
                if "probe" not in kinds and (not track.probe_ok or track.probe_failures):
                    track.probe_ok, track.probe_failures = True, 0
                    track.generation += 1
                if "scrape" not in kinds and (track.scraped_at is not None or track.metrics is not None):
                    track.reset_load()
                    track.generation += 1
                wanted.update((name, k) for k in kinds)
        self._gauge({name for name, kind in wanted if kind == "scrape"})
        if not self._stopping and self._session is not None:
            for key in list(self._tasks):
                if key not in wanted or self._tasks[key].done():
                    task = self._tasks.pop(key)
                    if key not in wanted:
                        task.cancel()
            for key in sorted(wanted):
                if key not in self._tasks:
                    self._tasks[key] = asyncio.create_task(self._poll_loop(*key), name=f"monitor-{key[1]}-{key[0]}")
        self._publish(mon)

    def _gauge(self, scraped: set[str]) -> None:
        """Give every scraped backend a METRICS_MISSING series (0 until a scrape says otherwise), and no other."""
        for name in self._gauged - scraped:
            METRICS_MISSING.remove(name)
        for name in scraped - self._gauged:
            METRICS_MISSING.labels(name).set(0)
        self._gauged = scraped

    def _publish(self, mon: MonitorConfig) -> None:
        """Replace the published mapping when any state differs; report model-list changes."""
        now = self._clock()
        with self._lock:
            old = self._states
            new: dict[str, BackendState] = {}
            for name in self._order:
                track = self._tracks.get(name)
                if track is None:
                    continue
                state = self._state_of(name, track, now, mon)
                prev = old.get(name)
                new[name] = prev if prev == state else state
            if list(new) != list(old) or any(new[n] is not old.get(n) for n in new):
                self._states = MappingProxyType(new)
            discovered = {n: s.models for n, s in new.items() if s.models is not None}
            changed = discovered != self._discovered
            if changed:
                self._discovered = discovered
        if changed and self._on_models_changed is not None:
            try:
                self._on_models_changed(dict(discovered))
            except Exception:
                log.warning("monitor: the on_models_changed callback failed", exc_info=True)

    def _state_of(self, name: str, track: _Track, now: float, mon: MonitorConfig) -> BackendState:
        if not self._enabled:
            return BackendState(name)
        is_fresh = fresh(track.scraped_at, now, mon.freshness_s)
        return BackendState(
            name=name,
            healthy=track.probe_ok,
            probe_failures=track.probe_failures,
            held_out_until=track.held_out_until,
            models=track.models,
            models_ok=track.models_ok,
            engine=track.engine,
            metrics=track.metrics,
            throughput_tps=track.tps if is_fresh else None,
            waiting=track.waiting if is_fresh else None,
            running=track.running if is_fresh else None,
            scraped_at=track.scraped_at,
        )

    def _apply(self, name: str, generation: int, update: Callable[[_Track], None]) -> None:
        """Run ``update`` on the backend's track unless it was reset since the poll began, then publish."""
        with self._lock:
            track = self._tracks.get(name)
            if track is None or track.generation != generation:
                return
            update(track)
        self._publish(self._monitor_config())

    # ------------------------------------------------------------------- tasks

    async def _supervise(self) -> None:
        while True:
            period = MAX_RECONCILE_S
            try:
                snap = self._snapshot()
                if snap is not None:
                    mon = snap.config.monitor
                    period = min(MAX_RECONCILE_S, mon.probe_interval_s, mon.scrape_interval_s, mon.models_interval_s)
                    self._reconcile(snap)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("monitor: reconciling backends failed", exc_info=True)
            await asyncio.sleep(period)

    async def _poll_loop(self, name: str, kind: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            snap = self._snapshot()
            if snap is None:
                await asyncio.sleep(MAX_RECONCILE_S)
                continue
            info = snap.backends.get(name)
            mon = snap.config.monitor
            if info is None or not mon.enabled or not _pollable(info) or kind not in self._wanted_kinds(info):
                return
            started = loop.time()
            try:
                await getattr(self, f"_{kind}")(info, mon)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("monitor: %s poll of backend %s failed unexpectedly", kind, name, exc_info=True)
            while True:
                snap = self._snapshot()
                if snap is None:
                    interval = MAX_RECONCILE_S
                else:
                    interval = getattr(snap.config.monitor, f"{kind}_interval_s")
                remaining = started + interval - loop.time()
                if remaining <= 0:
                    break
                await asyncio.sleep(min(remaining, MAX_SLEEP_CHUNK_S))

    def _generation(self, name: str) -> int | None:
        with self._lock:
            track = self._tracks.get(name)
            return None if track is None else track.generation

    async def _get(
        self, info: BackendInfo, path: str, mon: MonitorConfig, params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        """GET a backend path within ``timeout_s`` (default ``monitor.timeout_s``); the body
        of a 2xx answer, else :class:`_PollError`."""
        timeout_s = mon.timeout_s if timeout_s is None else timeout_s
        session = self._session
        if session is None or session.closed:
            raise _PollError("monitor is stopped")
        try:
            async with session.get(
                poll_url(info, path),
                headers=auth_headers(info),
                params=params,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
            ) as resp:
                if not 200 <= resp.status < 300:
                    raise _PollError(f"status {resp.status}", resp.status)
                if resp.content_length is not None and resp.content_length > MAX_BODY_BYTES:
                    raise _PollError("body too large")
                chunks, size = [], 0
                async for chunk in resp.content.iter_chunked(65536):
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        raise _PollError("body too large")
                    chunks.append(chunk)
                return b"".join(chunks)
        except TimeoutError:
            raise _PollError(f"no answer within {timeout_s}s") from None
        except aiohttp.ClientError as exc:
            raise _PollError(type(exc).__name__) from None
        except OSError as exc:
            raise _PollError(type(exc).__name__) from None

    async def _probe(self, info: BackendInfo, mon: MonitorConfig) -> None:
        generation = self._generation(info.name)
        check = info.config.health_check
        if check is None:
            return
        timeout = mon.generation_check_timeout_s if check.kind == "generation" else mon.timeout_s
        try:
            await self._get(info, check.path, mon, timeout_s=timeout)
            reason = None
        except _PollError as exc:
            reason = str(exc)

        def update(track: _Track) -> None:
            _judge(track, info.name, check, reason)

        if generation is not None:
            self._apply(info.name, generation, update)

    async def _scrape(self, info: BackendInfo, mon: MonitorConfig) -> None:
        generation = self._generation(info.name)
        path = info.config.scrape_path or ""
        engine = info.config.engine
        metrics, missing = None, None
        try:
            body = await self._get(info, path, mon)
            metrics = parse_engine_metrics(body.decode("utf-8", errors="replace"), engine)
            if metrics.engine is None:
                missing = "the page has none of the series read"
            error = None
        except _PollError as exc:
            error = str(exc)
            if _metrics_off(exc.status):
                missing = error
        at = self._clock()

        def update(track: _Track) -> None:
            found = metrics.engine if metrics is not None else None
            track.engine = found or (engine.name if engine is not None else None)
            if missing is not None:
                _metrics_missing(track, info, path, missing)
            elif metrics is None:
                if track.metrics != "failed":
                    log.debug("monitor: metrics scrape of backend %s (%s) failed: %s", info.name, path, error)
                track.metrics = "failed"
            else:
                _metrics_seen(track, info.name)
            if metrics is not None:
                _take_load(track, metrics, at, mon.freshness_s)

        if generation is not None:
            self._apply(info.name, generation, update)

    async def _models(self, info: BackendInfo, mon: MonitorConfig) -> None:
        generation = self._generation(info.name)
        # Anthropic pages its model list (20 by default).
        params = {"limit": "1000"} if info.family == "anthropic" else None
        try:
            models: tuple[str, ...] | None = parse_models(await self._get(info, MODELS_PATH, mon, params))
            error = None
        except _PollError as exc:
            models, error = None, str(exc)
        except ValueError:
            models, error = None, "not a model list"

        def update(track: _Track) -> None:
            first = not track.models_polled
            track.models_polled = True
            if models is None:
                if track.models_ok or first:
                    log.warning("monitor: listing the models of backend %s failed: %s", info.name, error)
                else:
                    log.debug("monitor: listing the models of backend %s failed: %s", info.name, error)
                track.models_ok = False
                return
            if models != track.models:
                log.info("monitor: backend %s serves %d model(s)", info.name, len(models))
            track.models = models
            track.models_ok = True

        if generation is not None:
            self._apply(info.name, generation, update)


def _take_load(track: _Track, metrics: EngineMetrics, at: float, freshness_s: float) -> None:
    """Record one page's figures; a counter's rate needs the earlier scrapes' readings."""
    readings, track.tps, track.readings = track.readings, None, ()
    if metrics.engine is not None and metrics.throughput is not None:
        kind = ENGINES[metrics.engine].throughput.kind
        if kind == "gauge":
            track.tps = metrics.throughput
        elif kind == "decode":
            if metrics.decode_seconds is not None:
                current = (at, metrics.throughput, metrics.decode_seconds)
                track.tps, track.readings = decode_speed(readings, current, freshness_s)  # type: ignore[arg-type]
        else:
            track.tps, track.readings = counter_throughput(kind, readings, (at, metrics.throughput), freshness_s)  # type: ignore[arg-type]
    track.waiting = metrics.waiting
    track.running = metrics.running
    track.scraped_at = at


def _metrics_missing(track: _Track, info: BackendInfo, path: str, reason: str) -> None:
    """A scrape answered without any series of the backend's engine: warn once, and flag it."""
    track.metrics = "missing"
    METRICS_MISSING.labels(info.name).set(1)
    if track.missing_warned:
        return
    track.missing_warned = True
    engine = info.config.engine
    hint = f"; {engine.metrics_hint}" if engine is not None and engine.metrics_hint else ""
    log.warning(
        "monitor: backend %s shows none of the %s metrics the router reads at %s (%s), so :nitro cannot "
        "rank it and the max_waiting gate cannot see its queue%s",
        info.name, engine.name if engine is not None else "engine", path, reason, hint,
    )


def _metrics_off(status: int | None) -> bool:
    """Whether a scrape's answer says the engine serves no metrics, rather than failing to:
    a 4xx (SGLang without --enable-metrics answers 404) or 501 Not Implemented (llama-server
    without --metrics)."""
    return status is not None and (400 <= status < 500 or status == 501)


def _metrics_seen(track: _Track, name: str) -> None:
    if track.missing_warned:
        log.info("monitor: backend %s shows its engine metrics again", name)
    track.metrics, track.missing_warned = "ok", False
    METRICS_MISSING.labels(name).set(0)


def _judge(track: _Track, name: str, check: HealthCheck, failure: str | None) -> None:
    """Apply one health check's outcome (``failure`` None: it passed) to the backend's verdict."""
    what = f"{check.kind} health check {check.path}"
    if failure is None:
        if not track.probe_ok:
            log.info("monitor: backend %s is healthy again (%s passed)", name, what)
        track.probe_ok, track.probe_failures, track.probe_passed = True, 0, True
        return
    track.probe_failures += 1
    if not track.probe_ok:
        return
    if track.probe_failures >= check.down_after or not track.probe_passed:
        log.warning("monitor: backend %s is down: its %s failed %d time(s) in a row: %s",
                    name, what, track.probe_failures, failure)
        track.probe_ok = False
    else:
        log.info("monitor: backend %s: its %s failed (%d of %d before it is marked down): %s",
                 name, what, track.probe_failures, check.down_after, failure)


def _differs_from_fresh(track: _Track) -> bool:
    """Whether an inactive backend's track still carries statements that must be dropped."""
    return track != _Track(url=track.url, generation=track.generation)
