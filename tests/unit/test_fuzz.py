"""Property-based fuzzing of the pure request-path functions (no Envoy, no I/O).

The decision, the body splicer, the variant-suffix grammar, config parsing
and the response rewriters are fed arbitrary input; each must answer within
its contract and never raise.
"""

from __future__ import annotations

import json
import re

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from sidecar.config.schema import Config, ConfigError, parse
from sidecar.errors import Reply
from sidecar.payload.body import set_top_level, top_level_spans
from sidecar.payload.rewrite import rewrite_json_body
from sidecar.payload.sse import SSERewriter
from sidecar.routing import Request, Route, authenticate, decide, snapshot
from sidecar.routing import suffixes as variants
from sidecar.routing.ingress import INGRESSES
from tests.support.properties import budget


def fuzz(max_examples: int) -> settings:
    """A test's example budget (a share of it under CI: tests/support/properties.py)."""
    return settings(max_examples=budget(max_examples), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


CONFIG = """
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m-a, shared, "ollama:7b", "x:nitro"]}
  - {name: b, url: "http://127.0.0.1:2/v1", models: [m-b, shared, think-m, "m-b:floor"], api_key: sk-b, weight: 3}
  - {name: c, url: "https://claude.example.com", type: anthropic, models: [claude], api_key: sk-c}
  - {name: hidden, url: "http://127.0.0.1:3", models: [m-int], internal: true}
  - {name: disabled, url: "http://127.0.0.1:4", models: [m-off], enabled: false}
api_keys:
  - {key: k-all, id: all}
  - {key: k-chat, id: chat-only, allowed_models: [chat, m-a]}
  - {key: k-a, id: a-only, allowed_backends: [a]}
model_aliases: {old: chat, sonnet: claude}
model_metadata:
  - {id: think-m, aliases: [thinker], reasoning_efforts: [low, high], pricing: {input: 1, output: 2}}
  - {id: m-a, pricing: {input: 3, output: 4}, backend_pricing: {a: {input: 1, output: 1}}}
proxy:
  selection: weighted
  variant_suffixes: {enabled: true}
model_experiments:
  - name: exp
    model: chat
    response_model: client
    response_headers: true
    variants:
      - {id: control, model: m-a, weight: 3}
      - {id: pinned, model: m-b, weight: 1, backends: [b]}
  - name: hidden-exp
    model: secret-chat
    hide_variant_models: true
    sticky_key: user
    sticky_ttl: 1h
    variants: [{id: only, model: shared, weight: 1}]
  - name: by-header
    model: chat-h
    sticky_key: header:x-user
    variants: [{id: a, model: m-a, weight: 1}, {id: b, model: claude, weight: 1}]
  - name: random
    model: chat-r
    sticky_key: none
    variants: [{id: a, model: think-m, weight: 1}, {id: zero, model: m-b, weight: 0}]
"""
SNAP = snapshot.build(parse(CONFIG, env={}).config)
STATUSES = {400, 401, 403, 404, 413, 503}

# ----------------------------------------------------------------------- strategies

KNOWN_NAMES = ["chat", "chat-h", "chat-r", "secret-chat", "m-a", "m-b", "shared", "claude", "think-m", "thinker",
               "m-int", "m-off", "old", "sonnet", "ollama:7b", "x:nitro", "m-b:floor", "nope"]
SUFFIX_WORDS = ["nitro", "floor", "thinking", "online", "free", "", "nitro:nitro"]
model_names = st.one_of(
    st.sampled_from(KNOWN_NAMES),
    st.builds(lambda n, w: f"{n}:{w}", st.sampled_from(KNOWN_NAMES), st.sampled_from(SUFFIX_WORDS)),
    st.text(max_size=12),
    st.text(min_size=250, max_size=300),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=15,
)
known_names = st.sampled_from(KNOWN_NAMES)
model_values = st.one_of(known_names, known_names, known_names, model_names, json_values)
# Header values as Envoy hands them over: arbitrary bytes, read as Latin-1.
header_values = st.one_of(st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                          st.sampled_from(["Bearer k-all", "Bearer k-chat", "Bearer k-a", "k-all", "Bearer ", ""]))
HEADER_NAMES = ["authorization", "x-api-key", "content-type", "x-user", "x-backend", "x-model-router-backend",
                "x-continuum-experiment-variant"]
VALID_AUTH = st.sampled_from([{"authorization": "Bearer k-all"}, {"x-api-key": "k-chat"},
                              {"authorization": "bearer  k-a "}])


def header_maps(names: list[str], max_size: int):
    """Random headers; most of the time with a configured key on top."""
    def merge(h, auth, keep):
        if not keep:
            return h
        return {**{k: v for k, v in h.items() if k not in ("authorization", "x-api-key")}, **auth}

    return st.builds(merge,
                     st.dictionaries(st.sampled_from(names), header_values, max_size=max_size), VALID_AUTH,
                     st.sampled_from([True, True, True, False]))


@st.composite
def json_object_bodies(draw) -> bytes:
    obj = draw(st.dictionaries(st.sampled_from(["messages", "stream", "user", "metadata", "stream_options",
                                                "reasoning_effort", "max_tokens", "input"]) | st.text(max_size=6),
                               json_values, max_size=5))
    if draw(st.sampled_from([True, True, True, True, False])):
        obj["model"] = draw(model_values)
    if draw(st.booleans()):
        obj["stream"] = draw(st.sampled_from([True, False, None, "yes"]))
    if draw(st.booleans()):
        obj["user"] = draw(st.one_of(st.text(max_size=8), json_values))
    raw = json.dumps(obj, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2])))
    if draw(st.booleans()) and "model" in obj:
        # A second, earlier or later, copy of the key.
        extra = json.dumps(draw(model_values))
        raw = ('{"model": ' + extra + ", " + raw[1:]) if raw.strip() != "{}" else raw
    return raw.encode()


@st.composite
def multipart_bodies(draw) -> tuple[bytes, str]:
    boundary = draw(st.one_of(st.sampled_from(["BND", "----x", "a" * 70]),
                              st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=0, max_size=80)))
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(["model", "prompt", "image", "mode", 'mo"del']) | st.text(max_size=5))
        value = draw(st.one_of(model_names.map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=30)))
        disposition = draw(st.sampled_from([f'form-data; name="{name}"', f"form-data; name={name}",
                                            f'form-data; name="{name}"; filename="f.png"', "form-data"]))
        sep = draw(st.sampled_from(["\r\n\r\n", "\n\n", "\r\n"]))
        parts.append(b"--" + boundary.encode("latin-1", "replace") + b"\r\ncontent-disposition: "
                     + disposition.encode("utf-8", "surrogatepass") + sep.encode() + value + b"\r\n")
    body = b"".join(parts)
    if draw(st.booleans()):
        body += b"--" + boundary.encode("latin-1", "replace") + b"--\r\n"
    cut = draw(st.integers(0, len(body)))
    if draw(st.sampled_from([True, False, False, False])):
        body = body[:cut]
    ctype = draw(st.sampled_from([f"multipart/form-data; boundary={boundary}",
                                  f'multipart/form-data; boundary="{boundary}"', "multipart/form-data",
                                  f"multipart/mixed; boundary={boundary}", "application/json", ""]))
    return body, ctype


@st.composite
def wellformed_multipart(draw) -> tuple[bytes, str]:
    boundary = draw(st.text(st.sampled_from("abcXYZ019-_'()+,./:=?"), min_size=1, max_size=70))
    delim = b"--" + boundary.encode()
    model = draw(st.one_of(known_names, known_names, model_names))
    parts = [(b'form-data; name="model"', model.encode("utf-8", "surrogatepass"))]
    for name in draw(st.lists(st.sampled_from(["prompt", "n", "image", "model"]), max_size=3)):
        part = (f'form-data; name="{name}"'.encode(), draw(st.binary(max_size=20)))
        parts.insert(draw(st.integers(0, len(parts))), part)
    body = b"".join(delim + b"\r\ncontent-disposition: " + d + b"\r\n\r\n" + v + b"\r\n" for d, v in parts)
    return body + delim + b"--\r\n", f"multipart/form-data; boundary={boundary}"


wellformed_json = st.builds(
    lambda model, stream, user, extra: json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                   **({"stream": stream} if stream is not None else {}),
                                                   **({"user": user} if user is not None else {}), **extra}).encode(),
    st.one_of(known_names, model_names), st.sampled_from([True, False, None]), st.none() | st.text(max_size=6),
    st.dictionaries(st.sampled_from(["stream_options", "reasoning_effort", "metadata", "max_tokens"]), json_values,
                    max_size=2),
)

bodies = st.one_of(
    wellformed_json, wellformed_json,
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    json_object_bodies(),
    json_object_bodies(),
    json_object_bodies(),
    json_object_bodies(),
    json_object_bodies(),
)


def check_reply(reply: Reply, family: str) -> None:
    assert reply.status in STATUSES, reply
    doc = orjson.loads(reply.body)
    if family == "anthropic":
        assert set(doc) == {"type", "error"} and doc["type"] == "error", doc
        assert set(doc["error"]) == {"type", "message"}, doc
    else:
        assert set(doc) == {"error"}, doc
        assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]


def check_route(route: Route, ingress, body: bytes) -> None:
    backend = route.backend
    assert backend.name in SNAP.backends and not backend.internal and backend.config.enabled
    assert backend.name in SNAP.resolve(route.upstream_model)[1]
    if route.body is not None:
        if ingress.body == "json":
            sent = orjson.loads(route.body)
            assert sent["model"] == route.upstream_model
            assert {k: v for k, v in sent.items() if k not in ("model", "stream_options", "reasoning_effort")} == {
                k: v for k, v in orjson.loads(body).items() if k not in ("model", "stream_options", "reasoning_effort")}
        else:
            assert route.upstream_model.encode() in route.body
    elif ingress.body == "json":
        assert orjson.loads(body)["model"] == route.upstream_model
    if route.path is not None:
        assert route.path.startswith(backend.base_path + ingress.upstream_path)


def run_decide(path: str, body: bytes, headers: dict[str, str], rand: float, pick: int, now: float,
               record: bool = True):
    ingress = INGRESSES[path.partition("?")[0]]
    caller = authenticate(SNAP, headers, ingress.family)
    if isinstance(caller, Reply):
        if record:
            event("status 401")
        assert caller.status == 401
        check_reply(caller, ingress.family)
        return caller
    result = decide(SNAP, Request(ingress=ingress, path=path, headers=headers, body=body, caller=caller,
                                  now=now, pick=pick, rand=rand))
    if record:
        event(f"status {result.status}" if isinstance(result, Reply) else "routed")
    if isinstance(result, Reply):
        check_reply(result, ingress.family)
    else:
        assert isinstance(result, Route), result
        check_route(result, ingress, body)
    return result


json_paths = st.sampled_from(sorted(p for p, i in INGRESSES.items() if i.body == "json"))
paths = st.one_of(
    json_paths, json_paths, json_paths, json_paths,
    st.builds(lambda q: "/v1/realtime?" + q, st.one_of(
        st.builds(lambda m: "model=" + m, st.text(max_size=12)), st.text(max_size=20))),
)
rands = st.floats(0, 1, exclude_max=True)


@fuzz(2000)
@given(path=paths, body=bodies, headers=header_maps(HEADER_NAMES, 5),
       rand=rands, pick=st.integers(0, 2 ** 40), now=st.floats(0, 4e9))
def test_decide_never_raises_on_json_and_query_ingresses(path, body, headers, rand, pick, now):
    """Any body and headers: a Route to an enabled, public backend serving the
    upstream model (with a body whose model is that model), or a Reply with a
    documented status and a JSON body in the family's shape."""
    run_decide(path, body, headers, rand, pick, now)


@fuzz(1000)
@given(path=st.sampled_from(sorted(p for p, i in INGRESSES.items() if i.body == "multipart")),
       form=st.one_of(wellformed_multipart(), multipart_bodies()),
       headers=header_maps(HEADER_NAMES[:2] + ["x-user"], 2),
       rand=rands, pick=st.integers(0, 100))
def test_decide_never_raises_on_multipart(path, form, headers, rand, pick):
    """Any multipart body and content type on the image-edit ingresses: a Route or a documented refusal."""
    body, ctype = form
    run_decide(path, body, {**headers, "content-type": ctype}, rand, pick, 0.0)


def test_decide_routes_the_well_formed_requests_the_fuzzers_build():
    """The strategies above do reach routes, not only refusals."""
    body = b'--BND\r\ncontent-disposition: form-data; name="model"\r\n\r\nchat\r\n--BND--\r\n'
    r = run_decide("/v1/images/edits", body, {"content-type": "multipart/form-data; boundary=BND",
                                              "authorization": "Bearer k-all"}, 0.5, 1, 0.0, record=False)
    assert isinstance(r, Route) and r.upstream_model in ("m-a", "m-b")
    r = run_decide("/v1/chat/completions", b'{"model": "chat", "stream": true}', {"x-api-key": "k-all"}, 0.5, 1, 0.0,
                   record=False)
    assert isinstance(r, Route) and orjson.loads(r.body)["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("metadata", ["u1", ["user_id", "u1"], 7, None, True])
def test_a_messages_metadata_that_is_not_an_object_leaves_the_caller_unsticky(metadata):
    """``sticky_key: user`` reads ``metadata.user_id`` on the Messages ingress;
    any other shape of ``metadata`` routes as a caller with no sticky value."""
    body = orjson.dumps({"model": "secret-chat", "max_tokens": 1, "messages": [], "metadata": metadata})
    r = run_decide("/anthropic/v1/messages", body, {"x-api-key": "k-all"}, 0.5, 1, 0.0, record=False)
    assert isinstance(r, Route) and r.upstream_model == "shared"


# ----------------------------------------------------------------------- body splicing

keys = st.one_of(st.sampled_from(["model", "stream", "stream_options", "a"]), st.text(max_size=6))


def encode_key(key: str, escape_mask: int) -> bytes:
    """A JSON string literal for ``key`` with some characters written as \\u escapes."""
    out = []
    for i, ch in enumerate(key):
        if (escape_mask >> (i % 16)) & 1 or ch in '"\\' or ord(ch) < 0x20:
            if ord(ch) > 0xFFFF:
                out.append(json.dumps(ch)[1:-1])
            else:
                out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return ('"' + "".join(out) + '"').encode("utf-8", "surrogatepass")


# Which characters of a key are written as \u escapes: often none or all of
# them, so one key spelled both ways in the same object is a common draw.
escape_masks = st.one_of(st.just(0), st.just(0xFFFF), st.integers(0, 0xFFFF))


@st.composite
def raw_objects(draw) -> tuple[bytes, dict]:
    """A JSON object as raw bytes (possibly with duplicate and escaped keys, odd
    spacing) and the dict a parser reads from it (last duplicate wins)."""
    pairs = draw(st.lists(st.tuples(keys, json_values), max_size=6))
    ws = st.sampled_from(["", " ", "\n", "\t", "\r\n  "])
    items = []
    for k, v in pairs:
        items.append(draw(ws) + encode_key(k, draw(escape_masks)).decode("utf-8", "surrogatepass")
                     + draw(ws) + ":" + draw(ws) + json.dumps(v, ensure_ascii=draw(st.booleans())) + draw(ws))
    raw = (draw(ws) + "{" + ",".join(items) + draw(ws) + "}" + draw(ws)).encode("utf-8", "surrogatepass")
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        assume(False)
    return raw, parsed


# Values the sidecar writes: orjson-encodable (integers within 64 bits).
set_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


def hits_nested_key_fast_path(raw: bytes, parsed: dict, values: dict) -> bool:
    """The case of test_set_top_level_inserts_a_key_that_only_exists_nested."""
    if len(values) != 1 or values.keys() <= parsed.keys() or b"\\u" in raw:
        return False
    (key,) = values
    return raw.count(orjson.dumps(key)) == 1


@fuzz(800)
@given(obj=raw_objects(), values=st.dictionaries(keys, set_values, min_size=1, max_size=3))
def test_set_top_level_round_trips(obj, values):
    """Setting top-level keys then parsing gives the parsed object updated with
    exactly those values, duplicates and escaped keys included; the spans of
    a key's occurrences hold what the parser reads for it."""
    raw, parsed = obj
    assume(not hits_nested_key_fast_path(raw, parsed, values))
    out = set_top_level(raw, values)
    assert orjson.loads(out) == {**parsed, **values}
    spans = top_level_spans(raw, set(parsed))
    assert set(spans) == set(parsed)
    for key, occurrences in spans.items():
        s, e = occurrences[-1]
        assert orjson.loads(raw[s:e]) == parsed[key]
    # Setting the same values again changes nothing more.
    assert orjson.loads(set_top_level(out, values)) == orjson.loads(out)
    # When every key already exists once, spelled as itself, exactly its values'
    # bytes are replaced: every other byte is the client's own. (A key spelled
    # twice or with escapes makes the body the parsed object encoded again.)
    placed = all(len(spans[k]) == 1 and raw.count(orjson.dumps(k)) == 1 for k in values if k in spans)
    if values.keys() <= parsed.keys() and placed and not re.search(rb"\\u00(?:3[0-9]|[4-7][0-9a-fA-F])", raw) \
            and all(len(orjson.dumps(parsed[k])) <= 4096 for k in values):
        edits = sorted((s, e, orjson.dumps(values[k])) for k in values for s, e in spans[k])
        expected, last = [], 0
        for s, e, v in edits:
            expected += [raw[last:s], v]
            last = e
        assert out == b"".join(expected) + raw[last:]


def test_set_top_level_inserts_a_key_that_only_exists_nested():
    """A key missing at the top level is inserted there, whatever nested objects contain."""
    raw = b'{"model": "m", "tools": [{"parameters": {"properties": {"stream_options": {"type": "string"}}}}]}'
    out = set_top_level(raw, {"stream_options": {"include_usage": True}})
    assert orjson.loads(out) == {**orjson.loads(raw), "stream_options": {"include_usage": True}}


ALIAS_ARM = snapshot.build(parse("""
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [chat]}
model_metadata:
  - {id: chat, aliases: [chat-itself]}
model_experiments:
  - name: exp
    model: chat
    variants: [{id: control, model: chat-itself, weight: 1}]
""", env={}).config)


def test_decide_never_edits_a_nested_stream_options():
    """The injected ``stream_options`` goes to the top level and leaves the client's tool schemas alone."""
    body = (b'{"model": "chat", "stream": true, "messages": [], "tools": [{"type": "function", "function": '
            b'{"name": "f", "parameters": {"type": "object", "properties": {"stream_options": {"type": "string"}}}}}]}')
    route = decide(ALIAS_ARM, Request(ingress=INGRESSES["/v1/chat/completions"], path="/v1/chat/completions",
                                      headers={}, body=body, caller=authenticate(ALIAS_ARM, {}, "openai")))
    assert isinstance(route, Route) and route.plan.strip_injected_usage
    sent = orjson.loads(route.body)
    assert sent["tools"] == orjson.loads(body)["tools"]
    assert sent["stream_options"] == {"include_usage": True}


# ----------------------------------------------------------------------- variant suffixes


@fuzz(1000)
@given(name=st.one_of(model_names, st.builds(lambda a, b: a + ":" + b, st.text(max_size=8), st.text(max_size=8))))
def test_variant_split_is_total_and_literal_first(name):
    """Any name: a name the router knows stands as sent; a split yields a known base and a recognised suffix."""
    base, suffix = variants.split(SNAP, name)
    if variants.known(SNAP, name):
        assert (base, suffix) == (name, None)
    if suffix is None:
        assert base == name
    else:
        assert suffix in variants.SUFFIXES
        assert variants.known(SNAP, base) and name == f"{base}:{suffix}"


def test_variant_split_examples():
    """Literal names with a colon win over the suffix grammar."""
    assert variants.split(SNAP, "x:nitro") == ("x:nitro", None)  # served literally
    assert variants.split(SNAP, "m-b:floor") == ("m-b:floor", None)  # served literally, though m-b is known
    assert variants.split(SNAP, "ollama:7b") == ("ollama:7b", None)
    assert variants.split(SNAP, "m-a:nitro") == ("m-a", "nitro")
    assert variants.split(SNAP, "chat:floor") == ("chat", "floor")
    assert variants.split(SNAP, "nope:nitro") == ("nope:nitro", None)


# ----------------------------------------------------------------------- config parsing

TOP = list(Config.model_fields)
SECTION_FIELDS = {
    "server": ["grpc_listen", "admin_listen", "workers", "max_body_bytes", "admin_token", "message_timeout_ms",
               "reload_interval_ms"],
    "envoy": ["listen", "admin_listen", "concurrency", "idle_timeout_s", "upstream_timeout_s"],
    "proxy": ["selection", "variant_suffixes"],
    "monitor": ["enabled", "probe_interval_s", "freshness_s", "max_waiting", "passive_holdout_s"],
}
BACKEND_FIELDS = ["name", "url", "type", "models", "internal", "api_key", "weight", "enabled", "health_path"]
EXPERIMENT_FIELDS = ["name", "model", "sticky_key", "sticky_ttl", "fallback", "response_model", "response_headers",
                     "hide_variant_models", "variants"]
odd_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(), st.text(max_size=12),
    st.sampled_from(["demo://", "http://127.0.0.1:1", "https://x.test/v1", "http://[::1", "ftp://x", "a:b",
                     "127.0.0.1:99999", "${MISSING_VAR}", "${MISSING:-fallback}", "7d", "0s", "header:x-u",
                     "header:", "round_robin", "anthropic", "client", "-1", "1e9", "model-router-sidecar"]),
    st.lists(st.one_of(st.text(max_size=6), st.integers()), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


# Field names as YAML keys; an empty key is left to
# test_config_error_path_keeps_an_empty_key.
names = st.text(min_size=1, max_size=6)


def mapping_of(fields: list[str]):
    return st.dictionaries(st.one_of(st.sampled_from(fields), names), odd_values, max_size=len(fields))


variant_maps = st.dictionaries(st.sampled_from(["id", "model", "weight", "backends", "extra"]),
                               odd_values | st.sampled_from(["v1", "m-a", 1, 0]), max_size=5)
experiment_maps = st.builds(
    lambda m, vs: {**m, "variants": vs} if vs is not None else m,
    mapping_of(EXPERIMENT_FIELDS), st.none() | st.lists(variant_maps, max_size=3) | odd_values,
)
backend_maps = st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries({"name": st.sampled_from(["a", "b", "bad name", ""]) | odd_values,
                           "url": st.sampled_from(["demo://", "http://127.0.0.1:1"]) | odd_values}),
    mapping_of(BACKEND_FIELDS),
)
config_maps = st.dictionaries(
    st.one_of(st.sampled_from(TOP), names),
    st.one_of(
        odd_values,
        st.lists(backend_maps, max_size=3),
        st.lists(experiment_maps, max_size=2),
        st.lists(st.dictionaries(st.sampled_from(["key", "id", "allowed_models", "allowed_backends"]), odd_values,
                                 max_size=4), max_size=3),
        st.one_of(*(mapping_of(f) for f in SECTION_FIELDS.values())),
    ),
    max_size=6,
)


def check_errors(errors: list[str], mapping) -> None:
    firsts = {str(k) for k in mapping} | set(TOP) if isinstance(mapping, dict) else set()
    assert errors
    for err in errors:
        assert isinstance(err, str)
        if err.startswith("(root): "):
            continue
        assert any(err.startswith(f) and err[len(f):len(f) + 1] in (".", "[", ":") for f in firsts if f) \
            or err.startswith("["), err
        assert ": " in err, err


@fuzz(600)
@given(mapping=config_maps, with_backend=st.booleans())
@example(mapping={"[key]": None}, with_backend=False)  # spelled like pydantic's key marker
def test_config_parse_raises_only_config_errors_with_field_paths(mapping, with_backend):
    """Schema keys with wrong types and values: a config or ConfigError, each error led by its field path."""
    if with_backend and not isinstance(mapping.get("backends"), list):
        mapping["backends"] = [{"name": "a", "url": "demo://"}]
    text = yaml.safe_dump(mapping, allow_unicode=True)
    try:
        loaded = parse(text, env={})
    except ConfigError as exc:
        check_errors(exc.errors, yaml.safe_load(text))  # the keys as YAML reads them back
    else:
        assert loaded.config.backends


@fuzz(400)
@given(text=st.text(max_size=200))
def test_config_parse_of_arbitrary_text(text):
    """Arbitrary text: a config or ConfigError, nothing else."""
    try:
        parse(text, env={})
    except ConfigError as exc:
        assert exc.errors and all(isinstance(e, str) and ": " in e for e in exc.errors)


def test_config_error_path_keeps_an_empty_key():
    """An error's path names its real location, even under an empty key."""
    with pytest.raises(ConfigError) as info:
        parse('"": {grpc_listen: "${MISSING_VAR}"}\nbackends: [{name: a, url: "demo://"}]\n', env={})
    assert all(not e.startswith("grpc_listen") for e in info.value.errors), info.value.errors


def test_config_parse_of_deeply_nested_yaml_is_a_config_error():
    """Pathologically nested YAML is a ConfigError."""
    with pytest.raises(ConfigError):
        parse("backends:\n  - {name: a, url: 'demo://'}\nextra: " + "[" * 2000 + "]" * 2000 + "\n", env={})


# ----------------------------------------------------------------------- response rewriters


@st.composite
def chunked(draw, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    out, last = [], 0
    for c in cuts:
        out.append(data[last:c])
        last = c
    out.append(data[last:])
    return out


def run_sse(rw: SSERewriter, chunks) -> bytes:
    return b"".join(rw.feed(c) for c in chunks) + rw.finish()


sse_pieces = st.sampled_from([
    b"data: ", b"data:", b'{"model": "up", "x": 1}', b'{"usage": null}', b'{"type": "message_start", "message": '
    b'{"model": "up", "usage": {"input_tokens": 3}}}', b"[DONE]", b"\n", b"\r\n", b"\r", b"\n\n", b": comment",
    b"event: x", b'{"model": 5}', b'"model"', b"{", b"}", b"\xff", b"id: 7",
])


@fuzz(600)
@given(data=st.data(), family=st.sampled_from(["openai", "anthropic"]), strip=st.booleans(),
       stream=st.one_of(st.binary(max_size=300), st.lists(sse_pieces, max_size=25).map(b"".join)))
def test_sse_rewriter_never_raises_and_ignores_chunking(data, family, strip, stream):
    """Any byte stream, cut anywhere: no exception, and the output does not
    depend on the cuts."""
    whole = run_sse(SSERewriter("client", family, strip_injected_usage=strip), [stream])
    pieces = data.draw(chunked(stream))
    assert run_sse(SSERewriter("client", family, strip_injected_usage=strip), pieces) == whole
    rw = SSERewriter(None, family)
    run_sse(rw, pieces)
    assert rw.usage.prompt_tokens >= 0 and rw.usage.completion_tokens >= 0


@fuzz(600)
@given(data=st.data(), family=st.sampled_from(["openai", "anthropic"]),
       stream=st.one_of(st.binary(max_size=300), st.lists(sse_pieces, max_size=25).map(b"".join)))
def test_sse_rewriter_is_identity_without_a_model_to_rewrite(data, family, stream):
    """A stream in which nothing mentions a model is released byte for byte,
    however it is chunked."""
    assume(b'"model"' not in stream and b"\\u" not in stream)
    pieces = data.draw(chunked(stream))
    assert run_sse(SSERewriter("client", family), pieces) == stream


@fuzz(600)
@given(body=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                      st.builds(lambda m, rest: json.dumps({"model": m, **rest}).encode(), json_values,
                                st.dictionaries(st.text(max_size=5), json_values, max_size=3))),
       model=st.one_of(st.none(), st.text(max_size=8)), family=st.sampled_from(["openai", "anthropic"]))
def test_rewrite_json_body_never_raises(body, model, family):
    """Unchanged unless the body is a JSON object with a different string
    ``model``; then only ``model`` changes."""
    out, usage = rewrite_json_body(body, model, family)
    assert usage.prompt_tokens >= 0 and usage.completion_tokens >= 0
    if out is not body and out != body:
        before, after = orjson.loads(body), orjson.loads(out)
        assert isinstance(before.get("model"), str) and before["model"] != model
        assert after == {**before, "model": model}
    elif model is not None:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(doc, dict) and isinstance(doc.get("model"), str):
            assert doc["model"] == model

