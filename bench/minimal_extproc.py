"""A minimal Envoy ext_proc: rewrites ``model`` to one fixed value, no decision logic.

    .venv/bin/python bench/minimal_extproc.py --listen 127.0.0.1:50061 --backend nginx --model llama-3.1-8b

The floor of body-based routing, for comparison with the sidecar: grpc.aio on
uvloop, two gRPC messages per request.

- Request headers (SEND): answered with no mutation and a ``mode_override``
  that keeps the body BUFFERED and turns the response phases off.
- Request body (BUFFERED): answered with the routing header
  (``x-model-router-backend: <backend>``), the body with its top-level
  ``model`` replaced, the new ``content-length`` and ``clear_route_cache``.

Any other phase Envoy sends is answered with an empty response. The server
also answers ``grpc.health.v1`` (SERVING), as the sidecar does: the bootstrap
the benchmark shares with the router health-checks every ext_proc endpoint.
SIGINT or SIGTERM stops the server.

Two variants for memory comparisons (``bench/soak.py --processor``):
``--end-stream`` returns right after the body answer, closing the stream with
OK from the server's side (as the sidecar does) instead of waiting for Envoy to
close it; ``--sync`` serves with grpcio's thread-pool server instead of
grpc.aio (and ends streams the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading

import grpc
import orjson
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

BACKEND_HEADER = "x-model-router-backend"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_MODE = pm.ProcessingMode(
    request_header_mode=pm.ProcessingMode.SEND,
    request_body_mode=pm.ProcessingMode.BUFFERED,
    response_header_mode=pm.ProcessingMode.SKIP,
    response_body_mode=pm.ProcessingMode.NONE,
    request_trailer_mode=pm.ProcessingMode.SKIP,
    response_trailer_mode=pm.ProcessingMode.SKIP,
)


class MinimalProcessor(pbg.ExternalProcessorServicer):
    """Answers every stream with the fixed backend and the rewritten model."""

    def __init__(self, backend: str, model: str, end_stream: bool = False) -> None:
        self.end_stream = end_stream
        self.backend = backend.encode()
        self.model = model
        self.headers_response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_MODE)

    def body_response(self, body: bytes) -> pb.ProcessingResponse:
        data = orjson.loads(body)
        data["model"] = self.model
        new = orjson.dumps(data)
        common = pb.CommonResponse(clear_route_cache=True)
        for name, value in ((BACKEND_HEADER, self.backend), ("content-length", str(len(new)).encode())):
            opt = common.header_mutation.set_headers.add()
            opt.header.key = name
            opt.header.raw_value = value
            opt.append_action = _OVERWRITE
        common.body_mutation.body = new
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))

    async def Process(self, request_iterator, context):
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                yield self.headers_response
            elif kind == "request_body":
                yield self.body_response(req.request_body.body)
                if self.end_stream:
                    return
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            elif kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class SyncProcessor(pbg.ExternalProcessorServicer):
    """The same answers from grpcio's synchronous server; the stream ends after the body answer."""

    def __init__(self, backend: str, model: str) -> None:
        self.inner = MinimalProcessor(backend, model)

    def Process(self, request_iterator, context):
        for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                yield self.inner.headers_response
            elif kind == "request_body":
                yield self.inner.body_response(req.request_body.body)
                return


_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.http2.max_pings_without_data", 0)]


def serve_sync(listen: str, backend: str, model: str) -> None:
    """grpcio's thread-pool server on ``listen`` until SIGINT or SIGTERM."""
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=32), options=_OPTIONS)
    pbg.add_ExternalProcessorServicer_to_server(SyncProcessor(backend, model), server)
    health_service = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"cannot listen on {listen}")
    server.start()
    health_service.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"minimal ext_proc (sync) ready on {listen}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()


async def serve(listen: str, backend: str, model: str, end_stream: bool = False) -> None:
    """Serve on ``listen`` until SIGINT or SIGTERM."""
    server = grpc.aio.server(options=_OPTIONS)
    pbg.add_ExternalProcessorServicer_to_server(MinimalProcessor(backend, model, end_stream), server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    if server.add_insecure_port(listen) == 0:
        raise SystemExit(f"cannot listen on {listen}")
    await server.start()
    await health_service.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"minimal ext_proc ready on {listen}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT for the gRPC server")
    parser.add_argument("--backend", required=True, help="Envoy cluster name to route every request to")
    parser.add_argument("--model", required=True, help="model name written into every request body")
    parser.add_argument("--end-stream", action="store_true",
                        help="end each stream from the server's side right after the body answer")
    parser.add_argument("--sync", action="store_true", help="grpcio's thread-pool server instead of grpc.aio")
    args = parser.parse_args()
    if args.sync:
        serve_sync(args.listen, args.backend, args.model)
    else:
        uvloop.run(serve(args.listen, args.backend, args.model, args.end_stream))


if __name__ == "__main__":
    main()
