"""The engines the monitor knows, and how it reads their Prometheus pages.

One table, :data:`ENGINES`, keyed by backend ``type``, says for each engine
what its health check is (:class:`HealthCheck`), where its metrics live, which
series carry its generation throughput and its waiting and running requests,
and which labels on those series must not be summed.
:func:`parse_engine_metrics` turns a page into one figure per series under
these rules, applied in this order:

* ``breakdown``: a label whose empty value carries a total beside one series
  per value (SGLang's ``priority``). Where the total is on the page, the
  breakdown's series are ignored; where it is not, they are summed.
* ``copies``: labels that tell apart copies of one figure (SGLang's
  ``tp_rank``, ``pp_rank`` and ``moe_ep_rank`` when every scheduler publishes
  the same batch; ``pid`` when ``prometheus_client``'s multiprocess mode keeps
  one series per process). Series that differ only in these labels count once,
  at their maximum.
* Everything still apart is summed: data-parallel ranks (vLLM's ``engine``,
  SGLang's ``dp_rank``) each carry their own share of the backend's load.

Non-finite values and lines that are not Prometheus text are ignored.
:func:`counter_throughput` turns a token counter's readings into tokens/s as
its :class:`Throughput` kind says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ENGINES", "LIVENESS", "EngineMetrics", "EngineSpec", "HealthCheck", "Reading", "Throughput", "ThroughputKind",
    "DecodeReading", "compute_throughput", "counter_throughput", "decode_speed", "parse_engine_metrics",
]

CheckKind = Literal["liveness", "generation"]
ThroughputKind = Literal["counter", "completion_counter", "gauge", "decode"]


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """How a backend's health is checked.

    ``liveness``: a cheap answer, bounded by ``monitor.timeout_s``.
    ``generation``: the engine generates a token before it answers, which
    takes about a second when idle and longer under load; bounded by
    ``monitor.generation_check_timeout_s``. ``down_after`` failed checks in a
    row mark a backend down; before its first successful check, one does.
    """

    path: str
    kind: CheckKind = "liveness"
    down_after: int = 1


LIVENESS = HealthCheck("/health")
"""The check of a backend whose type names no engine (the demo engine's, or a set ``health_path``)."""


@dataclass(frozen=True, slots=True)
class Throughput:
    """Where an engine's generation throughput comes from.

    ``counter``: a token counter that moves as tokens are generated; the
    monitor takes its rate between two fresh scrapes. ``completion_counter``:
    a token counter that moves only when a request finishes; the monitor takes
    its rate over the freshness window, so one finished request is not a spike
    between two scrapes. ``gauge``: the engine's own tokens/s figure, read as
    it is. ``decode``: the speed of one request, from two counters the engine
    bumps together, generated tokens (``series``) and the seconds spent
    decoding them (``seconds``, summed over requests): their ratio over the
    freshness window, or over the engine's life when the window saw none
    (an idle engine keeps the speed it had).
    """

    series: str
    kind: ThroughputKind
    seconds: str | None = None  # decode: the decode-time counter


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine: its health and metrics paths, the series read, and the label rules."""

    name: str
    health: HealthCheck
    throughput: Throughput
    waiting: str
    running: str
    metrics_path: str = "/metrics"
    copies: frozenset[str] = frozenset()
    breakdown: str | None = None
    metrics_hint: str | None = None  # what makes the engine publish its metrics, for the warning when it does not
    # Whether a response names the model the request asked for; an engine that answers with
    # its own name whatever was asked gets the requested name written back by the router.
    echoes_model: bool = True

    @property
    def series(self) -> frozenset[str]:
        seconds = {self.throughput.seconds} if self.throughput.seconds else set()
        return frozenset({self.throughput.series, self.waiting, self.running, *seconds})


VLLM = EngineSpec(
    name="vllm",
    health=LIVENESS,  # reads a flag; 503 once the engine is dead
    # V0 and V1 alike; V1 declares the family without _total, the sample keeps it.
    throughput=Throughput("vllm:generation_tokens_total", "counter"),
    waiting="vllm:num_requests_waiting",
    running="vllm:num_requests_running",
    copies=frozenset({"pid"}),
    metrics_hint="vLLM publishes them unless started with --disable-log-stats",
)
SGLANG = EngineSpec(
    name="sglang",
    # /health (like /health_generate) waits for a one-token generation: at least 1 s,
    # up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s) under load, 503 past it. One slow
    # answer is no verdict; two failures in a row are.
    health=HealthCheck("/health", "generation", down_after=2),
    # Tokens/s over the scheduler's last decode-log interval (40 steps by default).
    throughput=Throughput("sglang:gen_throughput", "gauge"),
    waiting="sglang:num_queue_reqs",
    running="sglang:num_running_reqs",
    copies=frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "pid"}),
    breakdown="priority",
    metrics_hint="SGLang serves them only when started with --enable-metrics",
)

TGI = EngineSpec(
    name="tgi",
    health=LIVENESS,  # asks the shards; a one-token prefill only after a failed generation
    # A histogram observed as each request ends: its _sum counts tokens at completion.
    throughput=Throughput("tgi_request_generated_tokens_sum", "completion_counter"),
    waiting="tgi_queue_size",
    running="tgi_batch_current_size",
    echoes_model=False,  # answers with the model id it was started with
)
LLAMACPP = EngineSpec(
    name="llamacpp",
    health=LIVENESS,  # 503 while the model loads
    # Both bumped when a request completes, by its tokens and its decode time: their ratio is
    # the speed of one request. (The *_tokens_seconds gauges are reset by every scrape.)
    throughput=Throughput("llamacpp:tokens_predicted_total", "decode", "llamacpp:tokens_predicted_seconds_total"),
    waiting="llamacpp:requests_deferred",
    running="llamacpp:requests_processing",
    metrics_hint="llama-server serves them only when started with --metrics",
    echoes_model=False,  # answers with its first alias whatever the request named
)

ENGINES: Mapping[str, EngineSpec] = {e.name: e for e in (VLLM, SGLANG, TGI, LLAMACPP)}
"""Engine specs by backend ``type``; a type not listed here has no spec."""


@dataclass(frozen=True, slots=True)
class _Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The figures one page gave; None where the page lacks the series.

    ``engine`` names the spec whose series were found (None: none were);
    ``throughput`` is the value of its throughput series, a counter's total or
    a tokens/s gauge as the spec says; ``decode_seconds`` the decode-time
    counter of a ``decode`` spec.
    """

    engine: str | None = None
    throughput: float | None = None
    waiting: float | None = None
    running: float | None = None
    decode_seconds: float | None = None


def _sample_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " ", "\t"):
        i = line.find(stop)
        if 0 <= i < end:
            end = i
    return line[:end]


def _parse(text: str) -> list[_Sample]:
    return [
        _Sample(s.name, s.labels, float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if isinstance(s.value, (int, float)) and math.isfinite(s.value)
    ]


def _samples(text: str, names: frozenset[str]) -> list[_Sample]:
    """The samples of ``names`` on a page, skipping lines prometheus_client rejects."""
    lines = [line for raw in text.splitlines() if (line := raw.strip()) and not line.startswith("#")
             and _sample_name(line) in names]
    if not lines:
        return []
    try:
        return _parse("\n".join(lines) + "\n")
    except ValueError:
        pass
    # One malformed line spoils a whole-page parse; parse line by line instead.
    out: list[_Sample] = []
    for line in lines:
        try:
            out.extend(_parse(line + "\n"))
        except ValueError:
            continue
    return out


def _without(labels: Mapping[str, str], drop: Iterable[str]) -> frozenset[tuple[str, str]]:
    gone = set(drop)
    return frozenset((k, v) for k, v in labels.items() if k not in gone)


def _combine(samples: Iterable[_Sample], spec: EngineSpec) -> float | None:
    """One series' samples as one figure under ``spec``'s label rules; None without samples."""
    rows = list(samples)
    if not rows:
        return None
    if spec.breakdown is not None:
        label = spec.breakdown
        totals = {_without(s.labels, (label,)) for s in rows if s.labels.get(label) == ""}
        rows = [s for s in rows if s.labels.get(label, "") == "" or _without(s.labels, (label,)) not in totals]
    groups: dict[frozenset[tuple[str, str]], float] = {}
    for s in rows:
        key = _without(s.labels, spec.copies)
        groups[key] = max(s.value, groups.get(key, s.value))
    return sum(groups.values())


def parse_engine_metrics(text: str, engine: EngineSpec | None = None) -> EngineMetrics:
    """Read one engine's figures from Prometheus text.

    With ``engine`` None (a backend whose type names no engine), the first
    engine of :data:`ENGINES` with one of its series on the page is read.
    """
    specs = [engine] if engine is not None else list(ENGINES.values())
    samples = _samples(text, frozenset().union(*(s.series for s in specs)))
    for spec in specs:
        found = _read(samples, spec)
        if (found.throughput, found.waiting, found.running) != (None, None, None):
            return found
    return EngineMetrics()


def _read(samples: list[_Sample], spec: EngineSpec) -> EngineMetrics:
    def figure(series: str) -> float | None:
        return _combine((s for s in samples if s.name == series), spec)

    seconds = figure(spec.throughput.seconds) if spec.throughput.seconds else None
    return EngineMetrics(spec.name, figure(spec.throughput.series), figure(spec.waiting), figure(spec.running),
                         seconds)


Reading = tuple[float, float]  # (time, token counter) of one scrape


def compute_throughput(previous: Reading | None, current: Reading, freshness_s: float) -> float | None:
    """Tokens/s between two successful scrapes, each given as ``(time, counter)``.

    None when there is no previous scrape, the two are more than
    ``freshness_s`` apart (or not in time order), or the counter went
    backwards (an engine restart: the next pair makes the statement).
    """
    if previous is None:
        return None
    (t0, c0), (t1, c1) = previous, current
    dt = t1 - t0
    if dt <= 0 or dt > freshness_s or c1 < c0:
        return None
    return (c1 - c0) / dt


def counter_throughput(
    kind: ThroughputKind, history: tuple[Reading, ...], current: Reading, freshness_s: float
) -> tuple[float | None, tuple[Reading, ...]]:
    """Tokens/s of a token counter at ``current``, and the readings to keep for the next scrape.

    ``counter`` (it moves as tokens are generated): the rate since the
    previous scrape. ``completion_counter`` (it moves when a request
    finishes): the rate since the oldest reading at most ``freshness_s``
    older. A counter below the latest reading (an engine restart) starts over
    and states nothing until the next scrape.
    """
    if history and current[1] < history[-1][1]:
        history = ()
    if kind == "completion_counter":
        history = tuple(r for r in history if current[0] - r[0] <= freshness_s)
        kept = (*history, current)
    else:
        history, kept = history[-1:], (current,)
    return compute_throughput(history[0] if history else None, current, freshness_s), kept


DecodeReading = tuple[float, float, float]  # (time, tokens, decode seconds) of one scrape


def decode_speed(
    history: tuple[DecodeReading, ...], current: DecodeReading, freshness_s: float
) -> tuple[float | None, tuple[DecodeReading, ...]]:
    """One request's decode speed (tokens/s) at ``current``, and the readings to keep.

    Tokens over decode seconds since the oldest reading at most ``freshness_s``
    older; when no decode time was counted in that window (idle, or only
    requests still running), the engine's lifetime ratio; None before any
    decode time was counted. A counter below the latest reading (an engine
    restart) starts the window over.
    """
    at, tokens, seconds = current
    if history and (tokens < history[-1][1] or seconds < history[-1][2]):
        history = ()
    history = tuple(r for r in history if at - r[0] <= freshness_s)
    kept = (*history, current)
    if history and seconds - history[0][2] > 0:
        return (tokens - history[0][1]) / (seconds - history[0][2]), kept
    return (tokens / seconds if seconds > 0 else None), kept
