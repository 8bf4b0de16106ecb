"""In-process cost of the request-path decision, without gRPC or Envoy.

    .venv/bin/python bench/decision.py            # about a minute on a quiet machine
    .venv/bin/python bench/decision.py --quick    # 1/100 of the iterations: checks it runs, figures rough

Prints microseconds of this process's CPU time per call (``time.process_time``,
so time the machine gives to other work is not counted) for the pieces the sidecar runs per request,
on the request path (the decision) and off it (one access-log entry: decoding
it from a batch, the metrics, the usage record written to a file, and the
server's observers: spans, the decision log, token budgets, the sample-ratio tracker;
and once more without usage records, the default). The handler rows also
run with the core's caches flushed before each request: live, other
processes run on the same cores between two requests, and the router's
larger working set pays for that more than the trivial processor's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
import timeit

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from sidecar.accounting import metering
from sidecar.config.schema import parse
from sidecar.contract import NAMESPACE
from sidecar.experiments import srm
from sidecar.handlers.answer_parts import NOTHING_MORE, AnswerParts
from sidecar.handlers.extproc import Processor
from sidecar.payload.rewrite import rewrite_json_body
from sidecar.payload.sse import SSERewriter
from sidecar.routing import Request, authenticate, decide, snapshot
from sidecar.routing.ingress import lookup
from sidecar.serve.runtime import Runtime
from sidecar.serve.server import meter_of

CONFIG = """
backends:
  - {name: pool-a, url: "http://127.0.0.1:8001", models: [llama-3.1-8b]}
  - {name: pool-b, url: "http://127.0.0.1:8002", models: [qwen3-8b]}
api_keys:
%s
model_experiments:
  - name: chat-ab
    model: chat
    response_model: client
    response_headers: true
    variants:
      - {id: control, model: llama-3.1-8b, weight: 90}
      - {id: candidate, model: qwen3-8b, weight: 10, backends: [pool-b]}
"""
KEYS = "\n".join(f"  - {{key: sk-{i:04d}, id: team-{i}, allowed_models: [chat, llama-3.1-8b]}}" for i in range(1000))

BODY = orjson.dumps({
    "model": "chat",
    "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Say hello in three words."}],
    "max_tokens": 64,
    "temperature": 0.2,
})
CHUNK = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"llama-3.1-8b",'
         b'"choices":[{"index":0,"delta":{"content":"hello"},"logprobs":null,"finish_reason":null}]}\n\n')
RESPONSE = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "llama-3.1-8b",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there, friend."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25},
})


def processing_requests(i: int) -> list[bytes]:
    """The two ext_proc messages Envoy sends for one chat request, serialized."""
    h = pb.ProcessingRequest()
    for k, v in ((":authority", "127.0.0.1:10000"), (":path", "/v1/chat/completions"), (":method", "POST"),
                 (":scheme", "http"), ("content-type", "application/json"), ("authorization", f"Bearer sk-{i % 1000:04d}"),
                 ("content-length", str(len(BODY))), ("x-forwarded-proto", "http"),
                 ("x-request-id", f"12b8da34-3d86-4eb9-932d-70fb2396{i % 10000:04d}")):
        x = h.request_headers.headers.headers.add()
        x.key, x.raw_value = k, v.encode()
    b = pb.ProcessingRequest()
    b.request_body.body, b.request_body.end_of_stream = BODY, True
    return [h.SerializeToString(), b.SerializeToString()]


SCALE = 1.0  # --quick: a hundredth of the iterations


def _n(number: int) -> int:
    return max(int(number * SCALE), 10)


async def through(servicer, msgs: list[bytes]) -> None:
    """One request through an ext_proc servicer's ``Process``: both messages
    decoded, answered and the answers encoded, as grpc.aio would (without the
    transport)."""
    async def incoming():
        for m in msgs:
            yield pb.ProcessingRequest.FromString(m)

    messages = incoming()
    async for resp in servicer.Process(messages, None):
        resp.SerializeToString()
    await messages.aclose()  # a servicer may return before reading to the end, as grpc.aio allows


def handler_batch(servicer):
    """``batch(n)``: n requests through :func:`through`, one after another."""
    wire = [processing_requests(i) for i in range(1000)]

    async def batch(n: int) -> None:
        for i in range(n):
            await through(servicer, wire[i % len(wire)])

    return batch


def flush_bytes() -> int:
    """Bytes that, written between two requests, push a core's private caches
    out (twice its L2; 4 MiB where the system does not say)."""
    try:
        l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):
        l2 = 0
    return 2 * l2 if l2 > 0 else 4 * 1024 * 1024


def cold_handler_us(servicer, n: int = 2_000) -> float:
    """µs per request through :func:`handler_batch` with the core's caches
    flushed before each request, as live, where Envoy, the upstream and gRPC's
    own threads run on the same cores between two requests of one process.
    Each request is timed alone; the flush is not counted."""
    wire = [processing_requests(i) for i in range(1000)]
    buf = bytearray(flush_bytes())
    ones = b"\x01" * (len(buf) // 64)
    n = _n(n)

    async def timed() -> float:
        spent = 0
        for i in range(n):
            buf[::64] = ones  # one write per cache line
            t = time.process_time_ns()
            await through(servicer, wire[i % len(wire)])
            spent += time.process_time_ns() - t
        return spent / 1e3

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(timed())  # warm-up
        return min(loop.run_until_complete(timed()) for _ in range(3)) / n
    finally:
        loop.close()


def handler_us(servicer, n: int = 5_000) -> float:
    """µs per request through :func:`handler_batch`."""
    batch = handler_batch(servicer)
    n = _n(n)

    async def timed() -> float:
        t = time.process_time()
        await batch(n)
        return time.process_time() - t

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(timed())  # warm-up
        return min(loop.run_until_complete(timed()) for _ in range(5)) / n * 1e6
    finally:
        loop.close()


def decision_call():
    """The bench's request decided by ``routing.decide`` (the caller authenticated once)."""
    snap = snapshot.build(parse(CONFIG % KEYS, env={}).config)
    headers = {":path": "/v1/chat/completions", "authorization": "Bearer sk-0042", "content-type": "application/json"}
    caller = authenticate(snap, headers, "openai")
    ingress, now = lookup("/v1/chat/completions"), time.time()
    return lambda: decide(snap, Request(ingress, "/v1/chat/completions", headers, BODY, caller, now, 1, 0.5))


def bench_runtime(directory: str, usage_records: bool = True) -> Runtime:
    """The server's own Runtime over the bench's config (written into ``directory``)."""
    path = os.path.join(directory, "config.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(CONFIG % KEYS)
    return Runtime(path, usage_records=os.path.join(directory, "usage.jsonl") if usage_records else None)


class ContractFloor:
    """What the public contract alone costs per request, with no decision:
    the headers read into a dict, the body parsed and its ``model`` set, the
    caller's SHA-256, and the routed answer the router sends for this request
    (its shared and own headers, its 17 metadata fields, copied from a
    skeleton as the router does). The router's figure less this one is the
    work of its own stages."""

    SHARED = (("x-model-router-backend", "pool-a"), ("accept-encoding", "identity"),
              ("x-model-router-response", "rewrite"))
    REMOVE = ("authorization", "x-api-key")
    DECISION = dict(
        x_experiment="chat-ab", x_experiment_variant="control", variant="control", upstream_model="llama-3.1-8b",
        strip_usage=False, rewrite_model="chat", kind="routed", ingress="/v1/chat/completions", family="openai",
        experiment="chat-ab", client_model="chat", backend="pool-a", assignment="sticky",
    )

    def __init__(self) -> None:
        self.parts = AnswerParts()
        self.send_body = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(),
            mode_override=pm.ProcessingMode(request_body_mode=pm.ProcessingMode.BUFFERED),
        )

    async def Process(self, messages, context):
        headers: dict[str, str] = {}
        async for req in messages:
            if req.WhichOneof("request") == "request_headers":
                for x in req.request_headers.headers.headers:
                    raw = x.raw_value
                    headers[x.key] = raw.decode("latin-1") if raw else x.value
                yield self.send_body
                continue
            data = orjson.loads(req.request_body.body)
            data["model"] = "llama-3.1-8b"
            body = orjson.dumps(data)
            caller = hashlib.sha256(headers["authorization"].encode()).hexdigest()[:16]
            md = dict(self.DECISION, request_id=headers["x-request-id"], key_id="team-1", estimate="41,64",
                      caller=caller)
            own = [("content-length", str(len(body)))]
            yield self.parts.routed("body", NOTHING_MORE, NAMESPACE, md, self.SHARED, self.REMOVE, own, body)
            return


ALS_BATCH = 16  # entries per access-log message (Envoy flushes at 16 KiB)


def answers(servicer, i: int) -> list[pb.ProcessingResponse]:
    """A servicer's answers to the bench's request ``i`` (both messages)."""

    async def run() -> list[pb.ProcessingResponse]:
        async def messages():
            for m in processing_requests(i):
                yield pb.ProcessingRequest.FromString(m)
        return [a async for a in servicer.Process(messages(), None)]

    return asyncio.run(run())


def routed_decisions(runtime: Runtime, n: int = ALS_BATCH) -> list[struct_pb2.Struct]:
    """The decision metadata the router's handler sends Envoy for the bench's
    first ``n`` requests: what Envoy's access log hands back."""
    processor = Processor(runtime)
    out = [a.dynamic_metadata.fields[NAMESPACE].struct_value
           for i in range(n) for a in answers(processor, i) if NAMESPACE in a.dynamic_metadata.fields]
    if len(out) != n or any(d.fields["kind"].string_value != "routed" for d in out):
        raise RuntimeError("the bench's requests were not routed: check CONFIG")
    return out


def access_log_batch(decisions: list[struct_pb2.Struct]) -> bytes:
    """A serialized ``StreamAccessLogsMessage``, one entry per decision, shaped like Envoy's for a routed request."""
    msg = als_pb2.StreamAccessLogsMessage()
    for i, decision in enumerate(decisions):
        e = msg.http_logs.log_entry.add()
        c = e.common_properties
        c.downstream_remote_address.socket_address.address = "127.0.0.1"
        c.downstream_remote_address.socket_address.port_value = 40000 + i
        c.downstream_local_address.socket_address.address = "127.0.0.1"
        c.downstream_local_address.socket_address.port_value = 10000
        c.upstream_remote_address.socket_address.address = "127.0.0.1"
        c.upstream_remote_address.socket_address.port_value = 8001
        c.upstream_cluster = "pool-a"
        c.route_name = "default"
        c.start_time.GetCurrentTime()
        for name, ns in (("time_to_last_rx_byte", 90_000), ("time_to_first_upstream_tx_byte", 800_000),
                         ("time_to_last_upstream_tx_byte", 810_000), ("time_to_first_upstream_rx_byte", 1_200_000),
                         ("time_to_last_upstream_rx_byte", 1_210_000), ("time_to_first_downstream_tx_byte", 1_300_000),
                         ("time_to_last_downstream_tx_byte", 1_310_000), ("duration", 1_310_000)):
            getattr(c, name).nanos = ns
        c.metadata.filter_metadata[NAMESPACE].CopyFrom(decision)
        c.metadata.filter_metadata[metering.USAGE_NAMESPACE].update({"prompt_tokens": 24, "completion_tokens": 5})
        r = e.request
        r.request_method = base_pb2.POST
        r.scheme, r.authority, r.path = "http", "127.0.0.1:10000", "/v1/chat/completions"
        r.user_agent, r.request_id = "bench", f"12b8da34-3d86-4eb9-932d-70fb2396{i:04d}"
        r.request_headers_bytes, r.request_body_bytes = 180, 200
        e.response.response_code.value = 200
        e.response.response_headers_bytes, e.response.response_body_bytes = 260, 310
        e.response.response_code_details = "via_upstream"
    return msg.SerializeToString()


def account(meter: metering.Meter, raw: bytes) -> None:
    """One access-log message, decoded and accounted as the server's AccessLogService does."""
    message = als_pb2.StreamAccessLogsMessage.FromString(raw)
    batch = meter.batch()
    meter.record((metering.entry_of(x, batch.reads) for x in message.http_logs.log_entry), batch)


def access_log_us(meter: metering.Meter, raw: bytes) -> float:
    """µs per entry: :func:`account` over a batch, divided by its entries."""
    return per_call_us(lambda: account(meter, raw), 2_000) / ALS_BATCH


def access_log_hold_us(meter: metering.Meter, raw: bytes, batches: int = 200) -> float:
    """The longest the access-log service holds the event loop while it
    accounts one batch (a task that only yields notes the gaps between its
    turns): what an ext_proc message arriving mid-batch waits for."""
    batches = _n(batches)

    class Stream:
        def __init__(self) -> None:
            self.left = batches

        async def read(self):
            if not self.left:
                return grpc.aio.EOF
            self.left -= 1
            return als_pb2.StreamAccessLogsMessage.FromString(raw)

    service = metering.AccessLogService(meter)

    async def main() -> float:
        stream = asyncio.ensure_future(service.StreamAccessLogs(None, Stream()))
        gaps = []
        last = time.process_time()
        while not stream.done():
            await asyncio.sleep(0)
            now = time.process_time()
            gaps.append(now - last)
            last = now
        await stream
        gaps.sort()
        return gaps[int(len(gaps) * 0.99)] * 1e6  # (the 99th percentile: the longest, without the odd outlier)

    return asyncio.run(main())


def per_call_us(fn, number: int) -> float:
    number = _n(number)
    return min(timeit.repeat(fn, number=number, repeat=5, timer=time.process_time)) / number * 1e6


def main() -> None:
    global SCALE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a hundredth of the iterations (a smoke test)")
    if parser.parse_args().quick:
        SCALE = 0.01
    snap = snapshot.build(parse(CONFIG % KEYS, env={}).config)
    ingress = lookup("/v1/chat/completions")
    headers = {":path": "/v1/chat/completions", "authorization": "Bearer sk-0042", "content-type": "application/json"}
    now = time.time()
    counter = iter(range(10**9))

    def full():
        c = authenticate(snap, headers, "openai")
        return decide(snap, Request(ingress, "/v1/chat/completions", headers, BODY, c, now, next(counter), 0.5))

    rows = [
        ("key gate (1,000 keys)", per_call_us(lambda: authenticate(snap, headers, "openai"), 200_000)),
        ("decision: parse, gate, experiment, select, rewrite", per_call_us(decision_call(), 50_000)),
        ("request path total (gate + decision)", per_call_us(full, 50_000)),
        ("JSON response rewrite + usage", per_call_us(lambda: rewrite_json_body(RESPONSE, "chat", "openai"), 50_000)),
    ]
    rw = SSERewriter("chat", "openai")
    rows.append(("SSE event rewrite (one ~200 B event)", per_call_us(lambda: rw.feed(CHUNK), 100_000)))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from minimal_extproc import MinimalProcessor

    with tempfile.TemporaryDirectory() as d:
        # The server's own Runtime and accounting, so the handler and the
        # access log meet what they meet in production.
        runtime = bench_runtime(d)
        meter = meter_of(runtime, srm.Tracker(lambda: runtime.snapshot.config))
        raw = access_log_batch(routed_decisions(runtime))
        rows.append((f"access-log entry (decode in a batch of {ALS_BATCH}, metrics, usage record, observers)",
                     access_log_us(meter, raw)))
        rows.append((f"access log: the loop held while a batch of {ALS_BATCH} is accounted (p99 of the holds)",
                     access_log_hold_us(meter, raw)))
        rows.append(("ext_proc handler, 2 messages with protobuf (model-router)", handler_us(Processor(runtime))))
        rows.append(("ext_proc handler, caches flushed before each request (model-router)",
                     cold_handler_us(Processor(runtime))))
    with tempfile.TemporaryDirectory() as d:
        # The default deployment: usage records off.
        runtime = bench_runtime(d, usage_records=False)
        meter = meter_of(runtime, srm.Tracker(lambda: runtime.snapshot.config))
        raw = access_log_batch(routed_decisions(runtime))
        rows.append(("access-log entry without usage records (the default)", access_log_us(meter, raw)))
    rows.append(("ext_proc handler, 2 messages with protobuf (the contract's own work, no decision)",
                 handler_us(ContractFloor())))
    rows.append(("ext_proc handler, 2 messages with protobuf (trivial processor)",
                 handler_us(MinimalProcessor("pool-a", "llama-3.1-8b"))))
    rows.append(("ext_proc handler, caches flushed before each request (trivial processor)",
                 cold_handler_us(MinimalProcessor("pool-a", "llama-3.1-8b"))))
    width = max(len(r[0]) for r in rows)
    print(f"{'step':<{width}}  µs/call")
    print(f"{'-' * width}  -------")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.2f}")


if __name__ == "__main__":
    main()
