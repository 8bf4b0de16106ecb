"""OTLP trace receivers for tests: gRPC ``TraceService/Export`` and HTTP
``POST /v1/traces``, on free loopback ports, keeping what they receive.

They decode with the ``opentelemetry.proto`` modules installed in the
environment (OTLP's own schema, independent of the sidecar's copy), and read
``ResourceSpans`` field 2 by number: newer copies name it ``scope_spans``,
the older one inside ``xds-protos`` ``instrumentation_library_spans``.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def _value(v) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def decode(body: bytes) -> list[dict]:
    """Every span of an ``ExportTraceServiceRequest``, with its resource and scope."""
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in getattr(rs, rs.DESCRIPTOR.fields_by_number[2].name):
            scope = getattr(ss, ss.DESCRIPTOR.fields_by_number[1].name)
            for sp in ss.spans:
                out.append({
                    "name": sp.name,
                    "trace_id": sp.trace_id.hex(),
                    "span_id": sp.span_id.hex(),
                    "parent_span_id": sp.parent_span_id.hex(),
                    "trace_state": sp.trace_state,
                    "kind": sp.kind,
                    "start": sp.start_time_unix_nano,
                    "end": sp.end_time_unix_nano,
                    "status": sp.status.code,
                    "attributes": {kv.key: _value(kv.value) for kv in sp.attributes},
                    "resource": resource,
                    "scope": scope.name,
                    "schema_url": ss.schema_url,
                })
    return out


class _Receiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def _take(self, body: bytes, headers: dict[str, str]) -> None:
        spans = decode(body)
        with self._lock:
            self.spans.extend(spans)
            self.headers.append(headers)

    def wait_for(self, predicate, timeout: float = 30.0) -> list[dict]:
        """The spans that satisfy ``predicate``, once there is at least one."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


class GrpcReceiver(_Receiver):
    def __init__(self) -> None:
        super().__init__()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(self._export)},  # raw bytes in and out
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _export(self, body: bytes, context) -> bytes:
        self._take(body, dict(context.invocation_metadata()))
        return b""  # an empty ExportTraceServiceResponse: all taken

    def start(self) -> GrpcReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)


class HttpReceiver(_Receiver):
    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    receiver._take(body, {k.lower(): v for k, v in self.headers.items()})
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> HttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
