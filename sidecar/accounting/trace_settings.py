"""Trace export settings: the config's ``tracing:`` section merged with the
standard ``OTEL_*`` environment variables. Pure.

A field set in the file wins; a field left out takes its variable (the
signal-specific ``OTEL_EXPORTER_OTLP_TRACES_*`` before the general
``OTEL_EXPORTER_OTLP_*``); then the default. ``OTEL_SDK_DISABLED=true`` turns
export off whatever the file says, ``enabled: false`` whatever the
environment says. A variable that cannot be used is a warning and its default
applies, as the OpenTelemetry specification asks (docs/observability.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args
from urllib.parse import unquote, urlsplit

from ..config.schema import SamplerName, Tracing
from .spans import Sampler

_SAMPLERS = get_args(SamplerName)
_DEFAULT_SAMPLER = "parentbased_always_on"


@dataclass(frozen=True)
class Settings:
    """Export settings after the config file and the environment are merged."""

    endpoint: str  # the full URL: host:port for gRPC, .../v1/traces for HTTP
    protocol: str  # grpc | http/protobuf
    headers: tuple[tuple[str, str], ...]
    timeout_s: float
    resource: tuple[tuple[str, str], ...]
    sampler: Sampler
    max_queue_size: int
    max_export_batch_size: int
    schedule_delay_s: float

    def __repr__(self) -> str:  # headers may carry a collector's credentials
        return f"Settings(endpoint={self.endpoint!r}, protocol={self.protocol!r}, sampler={self.sampler!r})"


def _pairs(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (values percent-decoded), as OTEL_*_HEADERS and OTEL_RESOURCE_ATTRIBUTES spell them."""
    out = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            out[k.strip()] = unquote(v.strip())
    return out


def _env(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        v = env.get(name, "").strip()
        if v:
            return v
    return None


def _number(env: Mapping[str, str], name: str, default: float, warnings: list[str], low: float = 0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1
    if not v >= low:
        warnings.append(f"{name}={raw!r} is not a number >= {low:g}; using {default:g}")
        return default
    return v


def resolve(cfg: Tracing, env: Mapping[str, str]) -> tuple[Settings | None, list[str]]:
    """The export settings (None: export is off) and warnings about ignored variables."""
    warnings: list[str] = []
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or cfg.enabled is False:
        return None, warnings
    exporter = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if exporter not in ("otlp", "none"):
        warnings.append(f"OTEL_TRACES_EXPORTER={exporter!r} is not supported (only otlp); exporting OTLP")
    known = cfg.endpoint or _env(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    if cfg.enabled is None and (exporter == "none" or not known):
        return None, warnings
    protocol = _protocol(cfg, env, warnings)
    endpoint = _endpoint(cfg, env, protocol)
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        warnings.append(f"OTLP endpoint {endpoint!r} is not http(s)://host:port; trace export is off")
        return None, warnings
    if cfg.headers is not None:
        headers = dict(cfg.headers)
    else:
        headers = _pairs(_env(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") or "")
    timeout_var = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" if _env(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") else (
        "OTEL_EXPORTER_OTLP_TIMEOUT")

    def setting(value: int | None, name: str, default: int) -> int:
        return value if value is not None else int(_number(env, name, default, warnings, low=1))

    return Settings(
        endpoint=endpoint,
        protocol=protocol,
        headers=tuple((k.lower(), v) for k, v in headers.items()),
        timeout_s=setting(cfg.timeout_ms, timeout_var, 10_000) / 1000,
        resource=tuple(_resource(cfg, env).items()),
        sampler=_sampler(cfg, env, warnings),
        max_queue_size=setting(cfg.max_queue_size, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
        max_export_batch_size=setting(cfg.max_export_batch_size, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        schedule_delay_s=setting(cfg.schedule_delay_ms, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
    ), warnings


def _protocol(cfg: Tracing, env: Mapping[str, str], warnings: list[str]) -> str:
    protocol = cfg.protocol or _env(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol == "http/json":
        warnings.append("OTLP http/json is not supported; exporting http/protobuf to the same endpoint")
        return "http/protobuf"
    if protocol not in ("grpc", "http/protobuf"):
        warnings.append(f"OTLP protocol {protocol!r} is not supported; exporting grpc")
        return "grpc"
    return protocol


def _endpoint(cfg: Tracing, env: Mapping[str, str], protocol: str) -> str:
    """The full URL: the file's (``/v1/traces`` added to a bare host for HTTP),
    the signal's variable as given, or the general one (``/v1/traces`` added for HTTP)."""
    http = protocol == "http/protobuf"
    signal_endpoint = _env(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base_endpoint = _env(env, "OTEL_EXPORTER_OTLP_ENDPOINT")
    if cfg.endpoint:
        endpoint = cfg.endpoint
        if http and urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    elif signal_endpoint:
        endpoint = signal_endpoint
    elif base_endpoint:
        endpoint = base_endpoint.rstrip("/") + "/v1/traces" if http else base_endpoint
    else:
        endpoint = "http://localhost:4318/v1/traces" if http else "http://localhost:4317"
    return endpoint if "://" in endpoint else "http://" + endpoint


def _resource(cfg: Tracing, env: Mapping[str, str]) -> dict[str, str]:
    resource = _pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    resource.update(cfg.resource_attributes or {})
    resource["service.name"] = (cfg.service_name or _env(env, "OTEL_SERVICE_NAME")
                                or resource.get("service.name") or "model-router")
    return resource


def _sampler(cfg: Tracing, env: Mapping[str, str], warnings: list[str]) -> Sampler:
    name = cfg.sampler or (env.get("OTEL_TRACES_SAMPLER") or "").strip().lower() or _DEFAULT_SAMPLER
    if name not in _SAMPLERS:
        warnings.append(f"OTEL_TRACES_SAMPLER={name!r} is not a built-in sampler; using {_DEFAULT_SAMPLER}")
        name = _DEFAULT_SAMPLER
    ratio = cfg.sampler_arg
    if ratio is None:
        ratio = _number(env, "OTEL_TRACES_SAMPLER_ARG", 1.0, warnings) if name.endswith("ratio") else 1.0
        if ratio > 1:
            warnings.append(f"OTEL_TRACES_SAMPLER_ARG={ratio:g} is above 1; using 1")
            ratio = 1.0
    return Sampler(name, ratio)
