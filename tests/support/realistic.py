"""One realistic config for tests that must hold with every feature on at
once: several experiments (one hiding its arms), ``model_aliases``,
``model_metadata`` aliases, variant suffixes, keys, a fallback chain, the
response cache, limits (a rate and a token budget on each experiment) and
tracing to a local OTLP receiver. One backend is a closed port (Envoy's
connect-refused 503) and Envoy gives up on a silent upstream after a second
(its 504), so tests can make both happen on experiment arms.
"""

from __future__ import annotations

import pytest

from sidecar.devstack.stack import free_port

from .otlp import GrpcReceiver

REALISTIC = """
metering: {flush_interval_ms: 100}
envoy: {upstream_timeout_s: 1}
backends:
  - {name: pool-a, url: "demo://", models: [llama-3.1-8b, gpt-public]}
  - {name: pool-b, url: "demo://", models: [qwen3-8b, mistral-7b]}
  - {name: pool-c, url: "demo://", models: [llama-3.1-70b, secret-9b]}
  - {name: dead, url: "http://127.0.0.1:%(closed)d", models: [dead-1], health_path: "", metrics_path: ""}
api_keys:
  - {key: key-full, id: full}
  - {key: key-narrow, id: narrow, allowed_models: [chat, other, mistral-7b, gpt-public]}
model_aliases: {via-alias: other, ab-alias: chat, fast: gpt-public, sneaky: qwen3-8b, sneaky2: "qwen3-8b:nitro"}
model_metadata:
  - {id: qwen3-8b, aliases: [qwen-alias]}
  - {id: llama-3.1-8b, aliases: [llama], pricing: {input: 0.1, output: 0.2}}
model_experiments:
  - name: chat-ab
    model: chat
    sticky_key: api_key
    response_model: client
    response_headers: true
    hide_variant_models: true
    variants:
      - {id: control, model: llama-3.1-8b, weight: 50}
      - {id: candidate, model: qwen3-8b, weight: 50}
      - {id: shadow, model: secret-9b, weight: 0}
  - name: other-ab
    model: other
    sticky_key: "header:x-caller"
    response_headers: true
    variants:
      - {id: live, model: mistral-7b, weight: 1}
      - {id: gone, model: dead-1, weight: 1}
fallback_chains: {llama-3.1-70b: [qwen3-8b, gpt-public]}
fallback_attempts: 1
proxy: {variant_suffixes: {enabled: true}}
cache: {store: memory, scope: key, ttl_s: 300}
limits:
  - {model: gpt-public, requests_per_minute: 600, burst: 100}
  - {model: chat, key_id: full, tokens: 100000000, token_window: 1h}
  - {model: other, requests_per_minute: 6000, burst: 1000}
  - {model: other, key_id: full, tokens: 100000000, token_window: 1h}
tracing: {endpoint: "%(otlp)s", schedule_delay_ms: 50, sampler: always_on}
"""
# What chat-ab reserves: its arms' models and their metadata aliases.
RESERVED = ("llama-3.1-8b", "qwen3-8b", "secret-9b", "llama", "qwen-alias")


@pytest.fixture(scope="module")
def otlp_receiver():
    receiver = GrpcReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def realistic(stack_factory, otlp_receiver):
    return stack_factory(REALISTIC % {"closed": free_port(), "otlp": otlp_receiver.endpoint})
