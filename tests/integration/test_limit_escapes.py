"""Ways around the router's judgement, through real Envoy: a metadata alias
counts against its model's limits; a fallback hop honours the key's
allowed_models and is charged to the hop model's limits; a refusal names the
model as the client sent it; the client's address stays away from backends
that must not get it."""

from __future__ import annotations

import time

import httpx
import pytest

from ..conftest import clear_demo_requests, demo_requests, metered

pytestmark = pytest.mark.integration

CONFIG = """
server: {admin_token: adm-escapes}
metering: {flush_interval_ms: 100}
monitor: {probe_interval_s: 0.2, timeout_s: 0.2}
proxy: {variant_suffixes: {enabled: true}}
api_keys:
  - {id: open, key: sk-open}
  - {id: narrow, key: sk-narrow, allowed_models: [model-dead, gpt-public, fast]}
backends:
  - {name: dead, url: "http://127.0.0.1:9", models: [model-dead], health_path: /health}  # nothing listens
  - {name: pool-a, url: "demo://", models: [gpt-public, other]}
  - {name: private, url: "demo://", models: [quiet], forward_client_address: false}
model_aliases: {sneaky: other, fast: gpt-public}
model_metadata:
  - {id: gpt-public, aliases: [gp]}
fallback_chains: {model-dead: [other, gpt-public]}
fallback_attempts: 1
limits:
  - {model: gpt-public, key_id: open, requests_per_minute: 3}
  - {model: gpt-public, key_id: narrow, tokens: 1000000, token_window: 1h}
"""
OPEN = {"authorization": "Bearer sk-open"}
NARROW = {"authorization": "Bearer sk-narrow"}
CHAT = "/v1/chat/completions"


def ask(stack, model: str, headers: dict, path: str = CHAT) -> httpx.Response:
    body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "one two three"}]}
    return httpx.post(stack.url + path, json=body, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG)
    admin = f"http://{s.sidecar_admin[0]}/admin/backends"
    deadline = time.monotonic() + 15  # until the probe has seen the dead backend: hops chosen at selection
    while httpx.get(admin, headers={"authorization": "Bearer adm-escapes"}).json()["backends"]["dead"]["admissible"]:
        assert time.monotonic() < deadline, "the monitor never marked the dead backend down"
        time.sleep(0.1)
    return s


def test_a_metadata_alias_draws_from_its_models_request_rate(stack):
    """'gp' and 'gp:nitro' are gpt-public: they count in its bucket (3 a minute)."""
    names = ["gp", "gp:nitro", "gpt-public"] * 4
    statuses = []
    for name in names:
        r = ask(stack, name, OPEN)
        statuses.append(r.status_code)
        if r.status_code == 200:
            assert r.headers["x-ratelimit-limit-requests"] == "3", (name, dict(r.headers))
    # Twelve requests against a bucket of three, refilled one per 20 s: most are refused.
    assert statuses.count(429) >= len(names) - 3 - 2, statuses


def test_a_limit_naming_a_metadata_alias_is_refused():
    from sidecar.config.schema import ConfigError, parse

    with pytest.raises(ConfigError, match=r"limits\[0\]\.model: 'gp' is a model_metadata alias of 'gpt-public'"):
        parse("""
backends: [{name: a, url: "http://127.0.0.1:1", models: [gpt-public]}]
model_metadata: [{id: gpt-public, aliases: [gp]}]
limits: [{model: gp, requests_per_minute: 3}]
""", env={})


def test_a_fallback_hop_honours_allowed_models_and_its_own_limits(stack):
    """model-dead's chain is [other, gpt-public]: the open key falls back to
    'other'; the narrow key may not use 'other', so its hop is gpt-public,
    whose token budget (the narrow key's) it is then charged to."""
    wide = ask(stack, "model-dead", OPEN)
    assert wide.status_code == 200 and wide.headers["x-continuum-fallback-model"] == "other", wide.text
    assert ask(stack, "other", NARROW).status_code == 403  # the direct request: refused
    first = ask(stack, "model-dead", NARROW)
    assert first.status_code == 200, first.text
    assert first.headers["x-continuum-fallback-model"] == "gpt-public"
    assert first.json()["model"] == "gpt-public"
    assert first.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert metered(stack)
    second = ask(stack, "model-dead", NARROW)
    spent = int(first.headers["x-ratelimit-remaining-tokens"]) - int(second.headers["x-ratelimit-remaining-tokens"])
    assert spent == first.json()["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/anthropic/v1/messages"])
def test_a_refusal_names_the_model_as_sent_not_its_alias_target(stack, path):
    r = ask(stack, "sneaky", NARROW, path)
    assert r.status_code == 403, r.text
    assert "'sneaky'" in r.text and "other" not in r.text, r.text
    allowed = ask(stack, "fast", NARROW, path)  # an alias the key names, to a model it may use
    assert allowed.status_code == 200, allowed.text


def test_the_client_address_reaches_only_backends_allowed_to_see_it(stack):
    clear_demo_requests(stack)
    assert ask(stack, "gpt-public", NARROW).status_code == 200
    assert ask(stack, "quiet", NARROW | {"x-forwarded-for": "203.0.113.7"}).status_code == 403
    assert ask(stack, "quiet", OPEN | {"x-forwarded-for": "203.0.113.7"}).status_code == 200
    (plain,) = [r for r in demo_requests(stack, "pool-a") if r["path"] == CHAT]
    (quiet,) = [r for r in demo_requests(stack, "private") if r["path"] == CHAT]
    plain_headers = {k.lower() for k in plain["headers"]}
    assert "x-forwarded-for" in plain_headers and "x-envoy-external-address" in plain_headers
    quiet_headers = {k.lower(): v for k, v in quiet["headers"].items()}
    assert "x-forwarded-for" not in quiet_headers and "x-envoy-external-address" not in quiet_headers
    assert "203.0.113.7" not in str(quiet_headers)
