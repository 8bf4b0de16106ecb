"""In-process cost of the request-path decision, without gRPC or Envoy.

    .venv/bin/python bench/decision.py

Prints microseconds per call for the pieces the sidecar runs per request.
"""

from __future__ import annotations

import time
import timeit

import orjson

from sidecar import snapshot
from sidecar.config import parse
from sidecar.decide import Request, authenticate, decide
from sidecar.ingress import lookup
from sidecar.rewrite import SSERewriter, rewrite_json_body

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


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    snap = snapshot.build(parse(CONFIG % KEYS, env={}).config)
    ingress = lookup("/v1/chat/completions")
    headers = {":path": "/v1/chat/completions", "authorization": "Bearer sk-0042", "content-type": "application/json"}
    caller = authenticate(snap, headers, "openai")
    now = time.time()
    counter = iter(range(10**9))

    def full():
        c = authenticate(snap, headers, "openai")
        return decide(snap, Request(ingress, "/v1/chat/completions", headers, BODY, c, now, next(counter), 0.5))

    rows = [
        ("key gate (1,000 keys)", per_call_us(lambda: authenticate(snap, headers, "openai"), 200_000)),
        ("decision: parse, gate, experiment, select, rewrite", per_call_us(
            lambda: decide(snap, Request(ingress, "/v1/chat/completions", headers, BODY, caller, now, 1, 0.5)), 50_000)),
        ("request path total (gate + decision)", per_call_us(full, 50_000)),
        ("JSON response rewrite + usage", per_call_us(lambda: rewrite_json_body(RESPONSE, "chat", "openai"), 50_000)),
    ]
    rw = SSERewriter("chat", "openai")
    rows.append(("SSE event rewrite (one ~200 B event)", per_call_us(lambda: rw.feed(CHUNK), 100_000)))
    width = max(len(r[0]) for r in rows)
    print(f"{'step':<{width}}  µs/call")
    print(f"{'-' * width}  -------")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.2f}")


if __name__ == "__main__":
    main()
