"""The router reads each request surface as the engine will, or refuses it.

Through real Envoy: multipart forms that Starlette (``python-multipart``) and
aiohttp would read differently, paths an engine would decode into another
endpoint (or into a query), JSON nested past the encoder's limit, model names
with C1 or line-separator characters. Each refusal is a 400 in the family's
shape, nothing reaches an engine, and the well-formed counterpart still works.
"""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import openai
import orjson
import pytest

from ..conftest import clear_demo_requests, demo_requests, metric
from .test_bad_input import check_error, raw_request

pytestmark = pytest.mark.integration

FULL = "sk-boundary-full"
NARROW = "sk-boundary-narrow"  # may use mistral and chat, not qwen
PINNED = "sk-boundary-pinned"  # may use pool-b only
ADMIN = "adm-boundary-token"
CONFIG = f"""
server: {{admin_token: {ADMIN}}}
backends:
  - {{name: pool-a, url: "demo://", models: [open-a, secret-a]}}
  - {{name: pool-b, url: "demo://", models: [mistral, qwen]}}
  - {{name: claude, url: "demo://", type: anthropic, models: [claude-x]}}
api_keys:
  - {{key: {FULL}, id: full}}
  - {{key: {NARROW}, id: narrow, allowed_models: [mistral, chat]}}
  - {{key: {PINNED}, id: pinned, allowed_backends: [pool-b]}}
model_experiments:
  - name: split
    model: chat
    hide_variant_models: true
    response_headers: true
    variants:
      - {{id: control, model: secret-a, weight: 1}}
      - {{id: candidate, model: qwen, weight: 1}}
  - name: pinned-away
    model: chat-pinned
    variants: [{{id: only, model: open-a, weight: 1}}]
proxy: {{passthrough_backend: pool-a}}
cache: {{store: memory, scope: key, ttl_s: 300}}
limits:
  - {{model: open-a, requests_per_minute: 1000, burst: 1000}}
metering: {{flush_interval_ms: 100}}
"""
EDITS = b"/v1/images/edits"


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


@pytest.fixture()
def clean(stack):
    """Engines' request logs cleared before; after: no stream error, no 500
    decision, and the sidecar still routes."""
    clear_demo_requests(stack)
    yield
    assert metric(stack, "model_router_stream_errors_total") == 0
    assert metric(stack, "model_router_decisions_total", outcome="500") == 0
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "open-a", "messages": []},
                   headers={"authorization": f"Bearer {FULL}"}, timeout=30)
    assert r.status_code == 200, r.text


def engine_requests(stack) -> list[dict]:
    """What reached any engine (demo_requests leaves out the monitor's probes)."""
    return [rec for name in stack.demo_urls for rec in demo_requests(stack, name)]


def auth(key: str = FULL) -> tuple[bytes, bytes]:
    return (b"authorization", b"Bearer " + key.encode())


# ----------------------------------------------------------------------- multipart


def part(disposition: bytes, value: bytes, *extra: bytes, boundary: bytes = b"B") -> bytes:
    head = b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\n"
    return head + b"".join(h + b"\r\n" for h in extra) + b"\r\n" + value + b"\r\n"


IMAGE = part(b'form-data; name="image"; filename="a.png"', b"PNG", b"Content-Type: image/png")
END = b"--B--\r\n"
MP = b"multipart/form-data; boundary=B"
FIRST = part(b'form-data; name="model"', b"mistral")

# Each: (content type, body, a word the refusal's message holds). The first
# model part names a model the narrow key may use; the engine would read qwen.
AMBIGUOUS_FORMS = {
    "second-quoted-name": (MP, FIRST + part(b'form-data; name="model"', b"qwen") + IMAGE + END, "more than one"),
    "second-unquoted-name": (MP, FIRST + part(b"form-data; name=model", b"qwen") + IMAGE + END, "more than one"),
    "second-upper-case-name": (MP, FIRST + part(b'form-data; name="MODEL"', b"qwen") + IMAGE + END, "more than one"),
    "second-param-upper-case": (MP, FIRST + part(b'form-data; NAME="model"', b"qwen") + IMAGE + END, "more than one"),
    "rfc2231-name": (MP, FIRST + part(b"form-data; name*=utf-8''model", b"qwen") + IMAGE + END, "RFC 2231"),
    "name-twice-in-one-part": (MP, part(b'form-data; name="model"; name="prompt"', b"qwen") + IMAGE + END, "twice"),
    "slash-quoted-name": (MP, FIRST + part(b'form-data; name="/model"', b"qwen") + IMAGE + END, "starting with '/'"),
    "escaped-quoted-name": (MP, FIRST + part(b'form-data; name="mo\\del"', b"qwen") + IMAGE + END, "backslash"),
    "xboundary-before-boundary": (
        b"multipart/form-data; xboundary=A; boundary=B",
        FIRST + part(b'form-data; name="model"', b"qwen", boundary=b"A") + IMAGE + END, "xboundary"),
    "boundary-twice": (b"multipart/form-data; boundary=B; boundary=C", FIRST + IMAGE + END, "twice"),
    "boundary-rfc2231": (b"multipart/form-data; boundary*=utf-8''B", FIRST + IMAGE + END, "RFC 2231"),
    "preamble": (MP, b"preamble\r\n" + part(b'form-data; name="model"', b"qwen") + FIRST + IMAGE + END, "preamble"),
    "leading-crlf": (MP, b"\r\n" + FIRST + IMAGE + END, "preamble"),
    "bare-lf-in-part-headers": (
        MP, part(b'form-data; name="prompt"\nContent-Disposition: form-data; name="model"', b"qwen") + FIRST + IMAGE + END,
        "bare CR or LF"),
    "part-content-length": (
        MP, part(b'form-data; name="image"; filename="a.png"', b"PNG", b"Content-Length: 3") + FIRST + END, "content-length"),
    "base64-model": (
        MP, part(b'form-data; name="model"', b"cXdlbg==", b"Content-Transfer-Encoding: base64") + IMAGE + END,
        "content-transfer-encoding"),
    "utf16-model": (
        MP, part(b'form-data; name="model"', "qwen".encode("utf-16"), b"Content-Type: text/plain; charset=utf-16")
        + IMAGE + END, "UTF-8"),
    "charset-field": (MP, part(b'form-data; name="_charset_"', b"utf-16") + FIRST + IMAGE + END, "_charset_"),
    "model-as-file": (MP, part(b'form-data; name="model"; filename=""', b"qwen") + IMAGE + END, "file"),
    "folded-header": (
        MP, part(b'form-data;\r\n name="model"', b"qwen") + IMAGE + END, "malformed header"),
    "request-charset": (b"multipart/form-data; boundary=B; charset=utf-16", FIRST + IMAGE + END, "charset"),
    "boundary-line-padding": (MP, b"--B \r\n" + FIRST[5:] + IMAGE + END, "boundary line"),
    # aiohttp reads the prompt as empty and a model part inside it; python-multipart reads one prompt.
    "value-begins-with-boundary": (
        MP, part(b'form-data; name="prompt"', part(b'form-data; name="model"', b"qwen")[:-2]) + FIRST + IMAGE + END,
        "begins with its boundary"),
    "non-utf8-text-field": (MP, part(b'form-data; name="prompt"', b"a \xff hat") + FIRST + IMAGE + END, "UTF-8"),
    "latin1-text-field": (
        MP, part(b'form-data; name="prompt"', b"a hat", b"Content-Type: text/plain; charset=latin-1") + FIRST + IMAGE + END,
        "UTF-8"),
}


@pytest.mark.parametrize("key", [FULL, NARROW], ids=["unrestricted", "narrow"])
@pytest.mark.parametrize("case", list(AMBIGUOUS_FORMS))
def test_forms_engines_could_read_differently_are_refused(stack, clean, case, key):
    """Every form Starlette and aiohttp could read differently (here: where
    the engine would take ``qwen``, reserved and outside the narrow key's
    models) is a 400 ``invalid_multipart`` that names the problem, on the
    table's ingress and on passthrough; nothing reaches an engine."""
    ctype, body, words = AMBIGUOUS_FORMS[case]
    for path in (EDITS, b"/v1/images/variations", b"/v1/audio/transcriptions"):
        if key == NARROW and path == b"/v1/audio/transcriptions":
            continue  # a narrow key may not use passthrough at all (403, tested elsewhere)
        status, headers, out = raw_request(stack.listen, "POST", path, [(b"content-type", ctype), auth(key)], body)
        assert status == 400, (path, status, out[:300])
        doc = check_error(status, headers, out, "openai")
        assert doc["error"]["code"] == "invalid_multipart", doc
        assert words.lower() in doc["error"]["message"].lower(), doc
    assert engine_requests(stack) == []


def test_a_well_formed_form_is_routed_on_the_model_it_names(stack, clean):
    """The OpenAI SDK's own form goes through, judged and delivered on its one model."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=NARROW, max_retries=0)
    client.images.edit(model="mistral", image=("a.png", b"PNG", "image/png"), prompt="a hat")
    (rec,) = [r for r in demo_requests(stack, "pool-b") if r["path"] == "/v1/images/edits"]
    assert rec["form"]["model"] == "mistral"
    with pytest.raises(openai.PermissionDeniedError):
        client.images.edit(model="qwen", image=("a.png", b"PNG", "image/png"), prompt="a hat")
    full = openai.OpenAI(base_url=stack.url + "/v1", api_key=FULL, max_retries=0)
    with pytest.raises(openai.NotFoundError):  # reserved by the experiment
        full.images.edit(model="qwen", image=("a.png", b"PNG", "image/png"), prompt="a hat")
    # A quoted boundary and an unquoted model name are read alike by every parser: accepted.
    image = part(b'form-data; name="image"; filename="a.png"', b"PNG", boundary=b"x-y")
    body = part(b"form-data; name=model", b"mistral", boundary=b"x-y") + image + b"--x-y--\r\n"
    status, _, out = raw_request(stack.listen, "POST", EDITS,
                                 [(b"content-type", b'multipart/form-data; boundary="x-y"'), auth(FULL)], body)
    assert status == 200, out[:300]
    assert [r["form"]["model"] for r in demo_requests(stack, "pool-b") if r["path"] == "/v1/images/edits"] == [
        "mistral", "mistral"]


# ----------------------------------------------------------------------- paths

BAD_PATHS = [
    b"/v1/chat/%2563ompletions",  # the engine decodes again: /v1/chat/completions
    b"/v1/%2563hat/completions",
    b"/v1/respons%2565s",
    b"/v1/images/%2565dits",
    b"/v1/chat/completions%3Fa=b%20c",
    b"/v1/chat/completions%3F%0A",
    b"/v1/chat/completions%23frag",
    b"/v1/chat/completions%20",
    b"/v1/chat/completions%00",  # Envoy's own path normalisation refuses this one (its reply is mapped)
    b"/v1/chat/completions%09",
    b"/v1/chat/%C2%85completions",
    b"/v1/chat/completions%E2%80%A8",
    b"/v1/chat/completions%ff",
    b"/v1/files%3Fpurpose=x",
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_paths_an_engine_would_read_differently_are_refused(stack, clean, path):
    """A path still escaped after one decode, or that decodes to '?', '#',
    spaces or control characters, is a 400 ``invalid_request`` before any
    decision, with passthrough on; nothing reaches an engine."""
    body = b'{"model": "open-a", "messages": []}'
    status, headers, out = raw_request(stack.listen, "POST", path,
                                       [(b"content-type", b"application/json"), auth()], body)
    assert status == 400, (status, out[:300])
    doc = check_error(status, headers, out, "openai")
    # Envoy refuses %00 itself; its reply is mapped to the same code, in plain words.
    assert doc["error"]["code"] == "invalid_request", doc
    assert engine_requests(stack) == []


def test_bad_anthropic_path_is_refused_in_anthropic_shape(stack, clean):
    status, headers, out = raw_request(stack.listen, "POST", b"/anthropic/v1/messages%3Fx",
                                       [(b"content-type", b"application/json"), auth()], b'{"model": "claude-x"}')
    assert status == 400
    doc = check_error(status, headers, out, "anthropic")
    assert doc["error"]["type"] == "invalid_request_error"
    assert engine_requests(stack) == []


def test_refused_paths_are_not_charged_to_a_backend_or_an_arm(stack, clean):
    """The request that used to make Envoy answer 503 after the decision is
    refused first: no backend is held out and the arm counts no error."""
    before = metric(stack, "model_experiment_requests_total", experiment="split")
    for _ in range(3):
        status, _, _ = raw_request(stack.listen, "POST", b"/v1/chat/completions%3F%0A",
                                   [(b"content-type", b"application/json"), auth(NARROW)], b'{"model": "chat"}')
        assert status == 400
    assert metric(stack, "model_experiment_requests_total", experiment="split") == before
    r = httpx.get(f"http://{stack.sidecar_admin[0]}/admin/backends", headers={"authorization": f"Bearer {ADMIN}"})
    backends = r.json()["backends"]
    pool_b = backends["pool-b"] if isinstance(backends, dict) else next(b for b in backends if b["name"] == "pool-b")
    assert pool_b["admissible"] is True and not pool_b["held_out_s"], pool_b


# ----------------------------------------------------------------------- small ones


@pytest.mark.parametrize("depth", [256, 300, 1024])
def test_json_nested_past_the_encoders_limit_is_400(stack, clean, depth):
    body = b'{"model": "open-a", "messages": [], "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    r = httpx.post(stack.url + "/v1/chat/completions", content=body,
                   headers={"authorization": f"Bearer {FULL}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
    assert engine_requests(stack) == []


@pytest.mark.parametrize("name", ["open-a\u0085", "open\u2028a", "open-a\u2029", "\u009b31m"])
def test_model_names_with_c1_or_line_separators_are_invalid(stack, clean, name):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": name, "messages": []},
                   headers={"authorization": f"Bearer {FULL}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_model"
    assert engine_requests(stack) == []


def test_a_cache_hit_carries_no_broken_rate_headers(stack, clean):
    """The miss carries the request-rate headers with a duration; the hit,
    which no rate filter counted, carries none rather than a bare unit."""
    body = {"model": "open-a", "messages": [{"role": "user", "content": "cache me"}]}
    key = {"authorization": f"Bearer {FULL}"}
    miss = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=key)
    assert miss.status_code == 200 and miss.headers["x-model-router-cache"] == "miss"
    assert re.fullmatch(r"\d+s", miss.headers["x-ratelimit-reset-requests"])
    deadline = time.monotonic() + 10
    hit = miss
    while hit.headers.get("x-model-router-cache") != "hit" and time.monotonic() < deadline:
        hit = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=key)  # the store trails the answer
    assert hit.headers.get("x-model-router-cache") == "hit"
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"):
        value = hit.headers.get(name)
        assert value is None or re.fullmatch(r"\d+s?", value), (name, value)


def test_anthropic_sdk_reads_the_request_id(stack, clean):
    """Anthropic ingresses return ``request-id`` (the SDK's ``_request_id``)
    equal to ``x-request-id``, on answers and on refusals."""
    client = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key=FULL, max_retries=0)
    raw = client.messages.with_raw_response.create(
        model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["request-id"] == raw.headers["x-request-id"]
    assert raw.parse()._request_id == raw.headers["x-request-id"]
    with pytest.raises(anthropic.NotFoundError) as refused:
        client.messages.create(model="qwen", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.request_id and refused.value.request_id == refused.value.response.headers["x-request-id"]
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "open-a", "messages": []},
                   headers={"authorization": f"Bearer {FULL}"})
    assert "request-id" not in r.headers  # OpenAI ingresses: x-request-id only


def test_refusals_after_the_arm_are_recorded_as_refusals(stack, clean):
    """A refusal after an arm was chosen (the arm's model lives on a backend
    the key may not use) counts on the arm, and its usage record says
    ``refusal``, never ``routed``."""
    refused = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat-pinned", "messages": []},
                         headers={"authorization": f"Bearer {PINNED}"})
    assert refused.status_code == 403, refused.text
    routed = httpx.post(stack.url + "/v1/chat/completions", headers={"authorization": f"Bearer {FULL}"},
                        json={"model": "open-a", "messages": [{"role": "user", "content": "a record"}]})
    assert routed.status_code == 200, routed.text
    rid, ok_id = refused.headers["x-request-id"], routed.headers["x-request-id"]
    path = stack.usage_records
    records: dict[str, dict] = {}
    deadline = time.monotonic() + 10
    while not {rid, ok_id} <= set(records) and time.monotonic() < deadline:
        lines = path.read_bytes().splitlines() if path.exists() else []
        records = {rec["request_id"]: rec for rec in map(orjson.loads, lines)}
        time.sleep(0.05)
    assert records[rid]["kind"] == "refusal", records[rid]
    assert (records[rid]["experiment_id"], records[rid]["experiment_variant_id"]) == ("pinned-away", "only")
    assert records[ok_id]["kind"] == "routed"


def test_two_content_types_cannot_give_the_router_and_the_engine_different_boundaries(stack, clean):
    """With two Content-Type headers an engine reads the first (boundary A,
    whose form names qwen) while a parser taking the last would read B:
    Envoy joins the copies into one value, which the router refuses."""
    inner = part(b'form-data; name="model"', b"qwen", boundary=b"A") + b"--A--"
    body = (FIRST + part(b'form-data; name="image"; filename="a.png"', inner) + END)
    status, headers, out = raw_request(stack.listen, "POST", EDITS, [
        (b"content-type", b"multipart/form-data; boundary=A"), (b"content-type", MP), auth(NARROW)], body)
    assert status == 400, (status, out[:300])
    assert check_error(status, headers, out, "openai")["error"]["code"] == "invalid_multipart"
    assert engine_requests(stack) == []
