"""The limits stage, pure: which limits a request falls under, a budget's
window and verdict, and the config's checks on the section."""

from __future__ import annotations

import orjson
import pytest

from sidecar.config.limits import KEY_HEADER, MODEL_HEADER
from sidecar.config.schema import ConfigError, parse
from sidecar.errors import Reply
from sidecar.routing import Request, authenticate, decide, snapshot
from sidecar.routing import limits as lim
from sidecar.routing.ingress import lookup

CONFIG = """
proxy: {variant_suffixes: {enabled: true}}
api_keys:
  - {key: k-a, id: a}
  - {key: k-b, id: b}
backends:
  - {name: one, url: "http://127.0.0.1:1", models: [base, "base:nitro", solo, m-x, m-y]}
model_experiments:
  - name: exp
    model: chat
    sticky_key: none
    variants: [{id: x, model: m-x, weight: 1}, {id: y, model: m-y, weight: 1}]
limits:
  - {model: base, requests_per_second: 5}
  - {model: base, key_id: b, requests_per_minute: 10, tokens: 100, token_window: 60s}
  - {model: "base:nitro", tokens: 7}
  - {model: solo, requests_per_second: 2}
  - {model: chat, tokens: 50, token_window: 10s}
"""


@pytest.fixture(scope="module")
def snap():
    return snapshot.build(parse(CONFIG).config)


def route(snap, model: str, key: str = "k-a", spent=None, now: float = 1000.0, family_path="/v1/chat/completions"):
    caller = authenticate(snap, {"authorization": f"Bearer {key}"}, "openai")
    body = orjson.dumps({"model": model, "messages": []})
    req = Request(ingress=lookup(family_path), path=family_path, headers={}, body=body, caller=caller,
                  now=now, spent=spent or {})
    return decide(snap, req)


def test_a_suffix_is_limited_as_its_base_and_a_literal_name_as_itself(snap):
    plain, nitro = route(snap, "solo"), route(snap, "solo:nitro")
    assert plain.limits.headers == nitro.limits.headers == ((MODEL_HEADER, "solo"),)
    assert nitro.plan.suffix == "nitro"
    # base:nitro is served literally: its own identity, its own budget, and not base's rate.
    literal = route(snap, "base:nitro")
    assert literal.plan.suffix is None
    assert literal.limits.model == "base:nitro" and literal.limits.budgets == ("*/base:nitro",)
    assert literal.limits.headers == ()


def test_a_keys_own_rule_adds_the_key_to_the_descriptor(snap):
    r = route(snap, "base", key="k-b")
    assert r.limits.headers == ((MODEL_HEADER, "base"), (KEY_HEADER, "b"))
    assert r.limits.budgets == ("b/base",)
    assert route(snap, "m-x").limits is None


def test_a_budget_on_an_experiment_covers_every_arm(snap):
    arms = set()
    for _ in range(40):  # random assignment: both arms show (a miss has odds 2**-39)
        r = route(snap, "chat", spent={"*/chat": (100, 49)}, now=1005.0)
        assert r.limits.budgets == ("*/chat",) and r.limits.tightest.remaining == 1
        arms.add(r.upstream_model)
    assert arms == {"m-x", "m-y"}
    refused = route(snap, "chat", spent={"*/chat": (100, 50)}, now=1005.0)
    assert isinstance(refused, Reply) and refused.status == 429


def test_a_spent_budget_refuses_until_its_window_ends(snap):
    spent = {"b/base": (16, 100)}  # window 16 of 60 s: [960, 1020)
    refused = route(snap, "base", key="k-b", spent=spent, now=1000.0)
    assert isinstance(refused, Reply) and refused.status == 429
    err = orjson.loads(refused.body)["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens" and err["param"] == "model"
    assert "'base'" in err["message"] and "1970-01-01T00:17:00Z" in err["message"]
    headers = dict(refused.headers)
    assert headers["retry-after"] == "20" and headers["x-ratelimit-reset-tokens"] == "20s"
    assert headers["x-ratelimit-remaining-tokens"] == "0" and headers["x-ratelimit-limit-tokens"] == "100"
    # The next window starts empty; another key is not charged with b's tokens.
    assert not isinstance(route(snap, "base", key="k-b", spent=spent, now=1020.0), Reply)
    assert not isinstance(route(snap, "base", key="k-a", spent=spent, now=1000.0), Reply)


def test_anthropic_refusal_shape(snap):
    r = route(snap, "chat", spent={"*/chat": (100, 99)}, now=1001.0, family_path="/anthropic/v1/messages")
    assert isinstance(r, Reply) and r.status == 429
    assert orjson.loads(r.body)["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(("seconds", "text"), [(0.02, "20ms"), (59.2, "1m0s"), (59, "59s"), (360, "6m0s"),
                                                (3600, "1h0m0s")])
def test_durations_read_as_openais(seconds, text):
    assert lim.duration(seconds) == text


@pytest.mark.parametrize(("rules", "expected"), [
    ("- {model: m, requests_per_second: 1, requests_per_minute: 1}", "limits[0]: give requests_per_second"),
    ("- {model: m, burst: 3, tokens: 5}", "limits[0]: burst needs"),
    ("- {model: m}", "limits[0]: a limit needs"),
    ("- {model: m, key_id: nobody, tokens: 5}", "limits[0].key_id: unknown key id 'nobody'"),
    ("- {model: m, tokens: 5}\n  - {model: m, tokens: 6}", "limits[1]: a second limit for model 'm'"),
    ("- {model: m, tokens: 5, token_window: soon}", "limits[0].token_window"),
    ("- {model: m, requests_per_second: 5, shared: true}", "limits[0].shared: a shared request rate is counted in Redis"),
    ("- {model: m, requests_per_second: 5, burst: 9, shared: true}", "limits[0]: shared counts"),
])
def test_config_rejects_limits_with_the_field_path(rules, expected):
    text = "api_keys: [{key: k, id: a}]\nbackends: [{name: one, url: 'http://127.0.0.1:1', models: [m]}]\n"
    with pytest.raises(ConfigError) as exc:
        parse(text + "limits:\n  " + rules)
    assert any(e.startswith(expected) for e in exc.value.errors), exc.value.errors


def test_an_unknown_model_is_a_warning():
    text = "backends: [{name: one, url: 'http://127.0.0.1:1', models: [m]}]\nlimits: [{model: typo, tokens: 5}]\n"
    assert any("limits[0].model" in w for w in parse(text).warnings)


def test_shared_and_local_rates_name_separate_descriptors():
    from sidecar.config.limits import SHARED_KEY_HEADER, SHARED_MODEL_HEADER

    text = """
redis: {url: "redis://127.0.0.1:1"}
api_keys: [{key: k-a, id: a}]
backends: [{name: one, url: "http://127.0.0.1:1", models: [m]}]
limits:
  - {model: m, requests_per_second: 5, burst: 8}
  - {model: m, key_id: a, requests_per_minute: 30, shared: true}
"""
    r = route(snapshot.build(parse(text).config), "m")
    assert r.limits.headers == ((MODEL_HEADER, "m"), (SHARED_MODEL_HEADER, "m"), (SHARED_KEY_HEADER, "a"))
    assert r.limits.metadata()["x_rl_limit"] == "8"  # the local burst, smaller than the shared 30


def test_the_estimate_is_a_quarter_of_the_body_and_the_output_cap_times_n():
    body = b"x" * 41
    assert lim.estimate(body, {"max_tokens": 30}) == (11, 30)
    assert lim.estimate(body, {"max_output_tokens": 7, "max_tokens": 30}) == (11, 7)
    assert lim.estimate(body, {"max_completion_tokens": 9, "n": 3}) == (11, 27)
    assert lim.estimate(b"", None) == (0, lim.DEFAULT_OUTPUT_ESTIMATE)
    assert lim.estimate(b"", {"max_tokens": 10**18, "n": 128}) == (0, lim.MAX_OUTPUT_ESTIMATE)
    # A cap that is not a positive integer is no cap; an absurd n counts once.
    for odd in ({"max_tokens": True}, {"max_tokens": -5}, {"max_tokens": "9"}, {"max_tokens": 1.5}, {"n": 10**6}):
        assert lim.estimate(b"", odd) == (0, lim.DEFAULT_OUTPUT_ESTIMATE)


def test_a_reservation_is_the_cost_at_most_the_largest_budget_and_travels_in_the_metadata(snap):
    rules = lim.applicable(snap, "base", "b")
    small = lim.plan(rules, "base", "b", {}, 6000.0, cost=42)
    huge = lim.plan(rules, "base", "b", {}, 6000.0, cost=10**12)
    assert isinstance(small, lim.LimitPlan) and isinstance(huge, lim.LimitPlan)
    assert small.reserve == 42 and huge.reserve == 100
    assert lim.reservation(small.metadata()) == (42, 6000.0)
    assert lim.reservation({}) is None and lim.reservation({"reserved": "x@y"}) is None
    # No budget: nothing reserved, nothing published.
    rated = lim.plan(lim.applicable(snap, "solo", None), "solo", None, {}, 6000.0, cost=42)
    assert isinstance(rated, lim.LimitPlan) and "reserved" not in rated.metadata()
