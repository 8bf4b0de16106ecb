"""Who may call the sidecar's gRPC port, on both sides of the wire.

The port serves Envoy (ext_proc, the access log, the rate-limit service), the
Assignment API (other services) and gRPC health. ``server.grpc_auth`` says
how callers prove who they are:

- ``secret`` / ``secret_file``: a per-deployment secret Envoy sends as gRPC
  initial metadata (:data:`METADATA_KEY`) on every stream it opens; every
  Envoy-facing call without it, or with another value, is refused with
  ``UNAUTHENTICATED`` (compared in constant time) and counted in
  ``model_router_grpc_unauthenticated_total{service}``;
- ``tls``: mTLS; a caller without a certificate signed by ``client_ca_file``
  never completes the handshake;
- ``assignment_token``: the Assignment API's own credential, presented as
  ``authorization: Bearer <token>``; Envoy's secret does not open it.

gRPC health stays open: it says SERVING or not and nothing else, and
kubelet's gRPC probes cannot send metadata. With no ``grpc_auth`` at all the
port trusts its network, and ``serve`` refuses to listen beyond loopback.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from ..config import address
from ..config.schema import GrpcAuth, GrpcTls

METADATA_KEY = "x-model-router-grpc-secret"
ASSIGNMENT_SERVICE = "model_router.v1.Assignment"
HEALTH_SERVICE = "grpc.health.v1.Health"
# Every service the port serves but health: the refusal counter's label values.
GUARDED_SERVICES = (
    "envoy.service.ext_proc.v3.ExternalProcessor", "envoy.service.accesslog.v3.AccessLogService",
    "envoy.service.ratelimit.v3.RateLimitService", ASSIGNMENT_SERVICE,
)
MIN_SECRET = 16
_T = "type.googleapis.com/"


class SecretError(ValueError):
    """A secret that cannot be read; the message names the file, never its content."""


def generate() -> str:
    """A fresh secret (``model-router up`` makes one per run)."""
    return secrets.token_urlsafe(32)


def read_secret_file(path: str) -> str:
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"cannot read the gRPC secret file {path}: {type(exc).__name__}") from None
    if len(value) < MIN_SECRET or any(ord(c) < 0x21 or ord(c) == 0x7F for c in value):
        raise SecretError(f"the gRPC secret in {path} must be at least {MIN_SECRET} characters, "
                          "without spaces or control characters")
    return value


def secret_of(auth: GrpcAuth, override_file: str | None = None) -> str | None:
    """The secret Envoy sends: ``override_file`` (serve --grpc-secret-file), else the config's."""
    path = override_file or auth.secret_file
    if path:
        return read_secret_file(path)
    return auth.secret


def is_loopback(listen: str) -> bool:
    host = address.host_of(listen)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------- the sidecar


def _service(method: str) -> str:
    return method.lstrip("/").partition("/")[0]


def _bearer(value: str) -> str:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


class Gate:
    """The rule, without gRPC: whether a call to ``method`` with ``metadata`` may go on."""

    def __init__(self, secret: str | None, auth: GrpcAuth) -> None:
        self.secret = secret
        self.assignment_token = auth.assignment_token
        self.open = secret is None and auth.tls is None and auth.assignment_token is None

    def admits(self, method: str, metadata: dict[str, str]) -> bool:
        service = _service(method)
        if self.open or service == HEALTH_SERVICE:
            return True
        if service == ASSIGNMENT_SERVICE:
            token = self.assignment_token
            return token is not None and _equal(_bearer(metadata.get("authorization", "")), token)
        if self.secret is None:
            return True  # no secret: the mTLS handshake (or loopback) admitted the caller
        return _equal(metadata.get(METADATA_KEY), self.secret)


async def _deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this gRPC port answers the router's Envoy only")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call."""
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, **codec)
    return grpc.unary_unary_rpc_method_handler(_deny, **codec)


class Interceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type information
    """Applies :class:`Gate` to every call; ``refused(service)`` counts a refusal."""

    def __init__(self, gate: Gate, refused: Callable[[str], None]) -> None:
        self.gate = gate
        self.refused = refused

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: gRPC answers UNIMPLEMENTED
        metadata = {m.key: m.value for m in handler_call_details.invocation_metadata or ()
                    if isinstance(m.value, str)}
        if self.gate.admits(handler_call_details.method, metadata):
            return handler
        self.refused(_service(handler_call_details.method))
        return _refusal(handler)


def server_credentials(tls: GrpcTls) -> grpc.ServerCredentials:
    """mTLS for the port: a caller must present a certificate ``client_ca_file`` signed."""
    def read(path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise SecretError(f"server.grpc_auth.tls: cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_server_credentials(
        [(read(tls.key_file), read(tls.cert_file))], root_certificates=read(tls.client_ca_file),
        require_client_auth=True,
    )


# --------------------------------------------------------------------- Envoy's side


def with_secret(doc: Any, cluster: str, secret: str) -> None:
    """Put the secret into every ``grpc_service`` of ``doc`` that calls ``cluster``
    (the decision and response filters, the fallback hop, the access log, the
    rate-limit service), in place: one rule for every call Envoy makes."""
    if isinstance(doc, dict):
        target = doc.get("envoy_grpc")
        if isinstance(target, dict) and target.get("cluster_name") == cluster:
            kept = [m for m in doc.get("initial_metadata", []) if m.get("key") != METADATA_KEY]
            doc["initial_metadata"] = [*kept, {"key": METADATA_KEY, "value": secret}]
        for value in doc.values():
            with_secret(value, cluster, secret)
    elif isinstance(doc, list):
        for value in doc:
            with_secret(value, cluster, secret)


def upstream_tls(tls: GrpcTls) -> dict[str, Any]:
    """The transport socket of Envoy's sidecar cluster: Envoy's client
    certificate, and the CA (and name) it expects of the sidecar."""
    validation: dict[str, Any] = {"trusted_ca": {"filename": tls.ca_file or tls.client_ca_file}}
    context: dict[str, Any] = {"@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"}
    if tls.server_name:
        context["sni"] = tls.server_name
        validation["match_typed_subject_alt_names"] = [{"san_type": "DNS", "matcher": {"exact": tls.server_name}}]
    context["common_tls_context"] = {
        "alpn_protocols": ["h2"],
        "tls_certificates": [{"certificate_chain": {"filename": tls.envoy_cert_file},
                              "private_key": {"filename": tls.envoy_key_file}}],
        "validation_context": validation,
    }
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}
