"""Hostile and malformed input through real Envoy, spoofing attempts and leaks.

Every case checks the status, that an error body is JSON in the ingress
family's shape, that nothing undecided reached a backend, and that the
sidecar is still alive and Envoy saw no failed ext_proc stream.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from sidecar.payload.body import set_top_level
from sidecar.routing.assignment import assign

from ..conftest import clear_demo_requests, demo_requests, envoy_stat, metered, metric

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
MESSAGES = "/anthropic/v1/messages"
EDITS = "/v1/images/edits"
MAX_BODY = 1024 * 1024

GOOD_KEY = "sk-input-good-4b1d"  # in the "candidate" arm
OTHER_KEY = "sk-input-other-0"  # in the "control" arm
ADMIN_TOKEN = "adm-token-5e6f7a8b9c"
# Distinctive strings that must never show up in logs or metrics.
LEAK_VALID = "sk-LEAKPROBE-valid-91c2e7"
LEAK_REJECTED = "sk-LEAKPROBE-rejected-3fa804"

CONFIG = f"""
server: {{max_body_bytes: {MAX_BODY}, admin_token: {ADMIN_TOKEN}}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a, plain-a]}}
  - {{name: pool-b, url: "demo://", models: [model-b, plain-b]}}
api_keys:
  - {{key: {GOOD_KEY}, id: good}}
  - {{key: {OTHER_KEY}, id: other}}
  - {{key: {LEAK_VALID}, id: leak-probe}}
model_experiments:
  - name: split
    model: chat
    hide_variant_models: true
    response_headers: true
    variants:
      - {{id: control, model: model-a, weight: 1}}
      - {{id: candidate, model: model-b, weight: 1}}
  - name: by-header
    model: chat-h
    sticky_key: header:x-user
    response_headers: true
    variants:
      - {{id: one, model: plain-a, weight: 1}}
      - {{id: two, model: plain-b, weight: 1}}
"""
ARMS = (("control", 1), ("candidate", 1))
ARM = {"control": ("pool-a", "model-a"), "candidate": ("pool-b", "model-b")}
AUTH = {"authorization": f"Bearer {GOOD_KEY}"}


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


@pytest.fixture()
def stays_healthy(stack):
    """After the test: the sidecar process lives, answers /healthz, raised no
    stream error and no internal-error refusal, and Envoy saw no failed stream."""
    failed = envoy_stat(stack, "ext_proc.streams_failed")
    clear_demo_requests(stack)
    yield
    assert stack._procs["sidecar-0"].popen.poll() is None
    assert httpx.get(f"http://{stack.sidecar_admin[0]}/healthz", timeout=5).json() == {"status": "ok"}
    assert metric(stack, "model_router_stream_errors_total") == 0
    assert metric(stack, "model_router_decisions_total", outcome="500") == 0
    assert envoy_stat(stack, "ext_proc.streams_failed") == failed
    # The stack still routes.
    r = httpx.post(stack.url + CHAT, json={"model": "plain-a", "messages": []}, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def family_of(path: str) -> str:
    return "anthropic" if path.startswith("/anthropic/") else "openai"


def check_error(status: int, headers, body: bytes, family: str) -> dict:
    """An error body in the family's shape: OpenAI {"error": {message, type, param, code}},
    Anthropic {"type": "error", "error": {type, message}}."""
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:300])
    doc = json.loads(body)
    if family == "openai":
        assert set(doc) == {"error"}, doc
        assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    else:
        assert set(doc) == {"type", "error"} and doc["type"] == "error", doc
        assert set(doc["error"]) == {"type", "message"}, doc
    assert isinstance(doc["error"]["message"], str) and isinstance(doc["error"]["type"], str)
    return doc


def expect_error(r: httpx.Response, status: int, family: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    return check_error(r.status_code, r.headers, r.content, family)


def nothing_reached_backends(stack) -> None:
    for name in stack.demo_urls:
        assert demo_requests(stack, name) == [], name


# ----------------------------------------------------------------------- raw HTTP/1.1


def raw_request(addr: str, method: str, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b"",
                chunked: bool = False, timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    """Send bytes exactly as given; status 0 when the server closed without a response."""
    head = [method.encode() + b" " + path + b" HTTP/1.1", b"host: model-router.test", b"connection: close"]
    head += [k + b": " + v for k, v in headers]
    if chunked:
        head.append(b"transfer-encoding: chunked")
        step = 64 * 1024
        payload = b"".join(b"%x\r\n" % len(body[i:i + step]) + body[i:i + step] + b"\r\n"
                           for i in range(0, len(body), step)) + b"0\r\n\r\n"
    else:
        head.append(b"content-length: %d" % len(body))
        payload = body
    host, _, port = addr.rpartition(":")
    data = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + payload)
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    if not data:
        return 0, {}, b""
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = head_bytes.split(b"\r\n")
    out: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        out[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if out.get("transfer-encoding") == "chunked":
        body_out, pos = b"", 0
        while True:
            size_end = rest.find(b"\r\n", pos)
            size = int(rest[pos:size_end], 16) if size_end > pos else 0
            if size == 0:
                break
            body_out += rest[size_end + 2:size_end + 2 + size]
            pos = size_end + 2 + size + 2
        rest = body_out
    return int(lines[0].split()[1]), out, rest


JSON_AUTH = [(b"content-type", b"application/json"), (b"authorization", b"Bearer " + GOOD_KEY.encode())]


# ----------------------------------------------------------------------- bodies

DEEP_ARRAYS = b"[" * 100_000 + b"]" * 100_000
BAD_BODIES = {
    "malformed": b'{"model": "chat", ',
    "array": b'["chat"]',
    "string": b'"chat"',
    "number": b"42",
    "null": b"null",
    "model-missing": b'{"messages": []}',
    "model-null": b'{"model": null}',
    "model-number": b'{"model": 7}',
    "model-array": b'{"model": ["chat"]}',
    "model-object": b'{"model": {"id": "chat"}}',
    "model-blank": b'{"model": "  \\t "}',
    "model-empty": b'{"model": ""}',
    "model-control-escaped": b'{"model": "ch\\u0001at"}',
    "model-newline": b'{"model": "chat\\n"}',
    "model-raw-control": b'{"model": "ch\x01at"}',
    "model-100kb": b'{"model": "' + b"m" * 100_000 + b'"}',
    "empty": b"",
    "whitespace": b" \r\n\t ",
    "invalid-utf8-model": b'{"model": "ch\xff\xfeat"}',
    "invalid-utf8-elsewhere": b'{"model": "chat", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
    "utf8-bom": b'\xef\xbb\xbf{"model": "chat"}',
    "nan": b'{"model": "chat", "temperature": NaN}',
    "deep-arrays": DEEP_ARRAYS,
    "deep-arrays-in-object": b'{"model": "chat", "x": ' + DEEP_ARRAYS + b"}",
    "deep-objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "trailing-garbage": b'{"model": "chat"} {"model": "model-a"}',
}


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_json_bodies_get_400_in_family_shape(stack, stays_healthy, case, path):
    """Every malformed body is a 400 from the sidecar, in the ingress family's
    shape, and nothing reaches a backend."""
    r = httpx.post(stack.url + path, content=BAD_BODIES[case],
                   headers={**AUTH, "content-type": "application/json"}, timeout=30)
    doc = expect_error(r, 400, family_of(path))
    assert doc["error"]["type"] == "invalid_request_error"
    nothing_reached_backends(stack)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length-0", "chunked-empty"])
def test_empty_body_with_json_content_type(stack, stays_healthy, chunked):
    """An empty body with ``content-type: application/json`` is a 400, whether
    announced by ``content-length: 0`` or as an empty chunked body."""
    status, headers, body = raw_request(stack.listen, "POST", CHAT.encode(), JSON_AUTH, b"", chunked=chunked)
    assert status == 400
    assert check_error(status, headers, body, "openai")["error"]["code"] == "invalid_json"
    nothing_reached_backends(stack)


def arm_of(key: str) -> str:
    return assign("split", ARMS, key).variant_id


@pytest.mark.parametrize("raw", [
    b'{"model": "model-a", "messages": [], "model": "chat"}',
    b'{"\\u006dodel": "model-b", "model": "chat", "messages": []}',
    b'{"model": "chat", "model": "chat", "messages": []}',
])
def test_duplicate_model_keys_decision_and_upstream_agree(stack, stays_healthy, raw):
    """With duplicate ``model`` keys the last one decides (as every JSON parser
    upstream reads it), and every copy is rewritten, so the backend reads the
    model the decision chose."""
    r = httpx.post(stack.url + CHAT, content=raw, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 200, r.text
    variant = r.headers["x-continuum-experiment-variant"]
    assert variant == arm_of(GOOD_KEY)
    backend, model = ARM[variant]
    assert r.json()["model"] == model
    (rec,) = [x for x in demo_requests(stack, backend) if x["path"] == CHAT]
    assert rec["json"]["model"] == model
    assert rec["body_len"] == len(set_top_level(raw, {"model": model}))
    other = "pool-b" if backend == "pool-a" else "pool-a"
    assert [x for x in demo_requests(stack, other) if x["path"] == CHAT] == []


@pytest.mark.parametrize("raw", [
    b'{"model": "chat", "model": "model-a", "messages": []}',
    b'{"model": "chat", "\\u006dodel": "model-b", "messages": []}',
    b'{"model": "chat", "messages": [], "model": "no-such-model"}',
])
def test_duplicate_model_keys_cannot_smuggle_a_reserved_model(stack, stays_healthy, raw):
    """A last ``model`` naming a reserved or unknown model is refused like that
    model, whatever came before it."""
    r = httpx.post(stack.url + CHAT, content=raw, headers={**AUTH, "content-type": "application/json"})
    assert expect_error(r, 404, "openai")["error"]["code"] == "model_not_found"
    nothing_reached_backends(stack)


# ----------------------------------------------------------------------- multipart

GOOD_FORM = (b'--BND\r\ncontent-disposition: form-data; name="model"\r\n\r\nchat\r\n'
             b'--BND\r\ncontent-disposition: form-data; name="prompt"\r\n\r\nadd a hat\r\n'
             b'--BND\r\ncontent-disposition: form-data; name="image"; filename="a.png"\r\n'
             b"content-type: image/png\r\n\r\n\x89PNG-data\r\n--BND--\r\n")
BAD_FORMS = {
    "no-boundary": (b"multipart/form-data", GOOD_FORM, None),
    "empty-boundary": (b'multipart/form-data; boundary=""', GOOD_FORM, None),
    "boundary-too-long": (b"multipart/form-data; boundary=" + b"b" * 71, GOOD_FORM, None),
    "wrong-boundary": (b"multipart/form-data; boundary=OTHER", GOOD_FORM, None),
    "not-multipart": (b"application/x-www-form-urlencoded", b"model=chat", None),
    "truncated-headers": (b"multipart/form-data; boundary=BND", GOOD_FORM[:30], None),
    "truncated-value": (b"multipart/form-data; boundary=BND", GOOD_FORM[:GOOD_FORM.index(b"chat") + 2], None),
    "unterminated": (b"multipart/form-data; boundary=BND", GOOD_FORM[:GOOD_FORM.index(b"--BND", 10)], None),
    "missing-model": (b"multipart/form-data; boundary=BND", GOOD_FORM.replace(b'name="model"', b'name="mode"'),
                      "missing_model"),
    "empty": (b"multipart/form-data; boundary=BND", b"", None),
    "model-not-utf8": (b"multipart/form-data; boundary=BND", GOOD_FORM.replace(b"\r\n\r\nchat", b"\r\n\r\nch\xffat"),
                       None),
    "model-blank": (b"multipart/form-data; boundary=BND", GOOD_FORM.replace(b"\r\n\r\nchat", b"\r\n\r\n   "),
                    "missing_model"),
    "garbage": (b"multipart/form-data; boundary=BND", b"\x00\xff" * 500, None),
}


@pytest.mark.parametrize("case", list(BAD_FORMS))
def test_bad_multipart_gets_400(stack, stays_healthy, case):
    """Malformed multipart on /v1/images/edits is a 400 in OpenAI shape."""
    ctype, body, code = BAD_FORMS[case]
    status, headers, out = raw_request(stack.listen, "POST", EDITS.encode(),
                                       [(b"content-type", ctype), JSON_AUTH[1]], body)
    assert status == 400, (status, out[:300])
    doc = check_error(status, headers, out, "openai")
    if code:
        assert doc["error"]["code"] == code
    nothing_reached_backends(stack)


def test_good_multipart_is_routed_by_the_experiment(stack, stays_healthy):
    """The well-formed counterpart of the cases above is routed and rewritten."""
    status, headers, out = raw_request(stack.listen, "POST", EDITS.encode(),
                                       [(b"content-type", b"multipart/form-data; boundary=BND"), JSON_AUTH[1]],
                                       GOOD_FORM)
    assert status == 200, out[:300]
    backend, model = ARM[headers["x-continuum-experiment-variant"]]
    (rec,) = [x for x in demo_requests(stack, backend) if x["path"] == EDITS]
    assert rec["path"] == EDITS and rec["form"]["model"] == model


def test_reserved_model_in_multipart_is_404(stack, stays_healthy):
    """A hidden variant model named in a form is refused like an unknown model."""
    form = GOOD_FORM.replace(b"\r\n\r\nchat", b"\r\n\r\nmodel-b")
    status, headers, out = raw_request(stack.listen, "POST", EDITS.encode(),
                                       [(b"content-type", b"multipart/form-data; boundary=BND"), JSON_AUTH[1]], form)
    assert status == 404
    check_error(status, headers, out, "openai")
    nothing_reached_backends(stack)


# ----------------------------------------------------------------------- size limits


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("size", [MAX_BODY + 1, 3 * MAX_BODY], ids=["just-over", "over-envoy-buffer"])
def test_body_over_the_limit_gets_413(stack, stays_healthy, path, chunked, size):
    """Over ``max_body_bytes``, with or without content-length: 413 in the
    family's shape, and nothing reaches a backend. Envoy's body buffer
    answers past ``max_body_bytes`` (its local reply mapped to the same body
    the sidecar's own 413 has); the sidecar's check stays behind it."""
    head = b'{"model": "chat", "pad": "'
    body = head + b"z" * (size - len(head) - 2) + b'"}'
    assert len(body) == size > MAX_BODY
    status, headers, out = raw_request(stack.listen, "POST", path.encode(), JSON_AUTH, body, chunked=chunked)
    assert status == 413, (status, out[:300])
    doc = check_error(status, headers, out, family_of(path))
    assert doc["error"]["message"] == f"The request body is larger than the limit of {MAX_BODY} bytes.", doc
    if family_of(path) == "openai":
        assert (doc["error"]["code"], doc["error"]["type"]) == ("request_too_large", "invalid_request_error"), doc
    else:
        assert doc["error"]["type"] == "request_too_large", doc
    nothing_reached_backends(stack)


def test_body_at_the_limit_is_accepted(stack, stays_healthy):
    """A chunked body just under ``max_body_bytes`` is routed."""
    body = b'{"model": "plain-a", "pad": "' + b"z" * (MAX_BODY - 100) + b'"}'
    assert len(body) <= MAX_BODY
    status, _, out = raw_request(stack.listen, "POST", CHAT.encode(), JSON_AUTH, body, chunked=True)
    assert status == 200, out[:300]


# ----------------------------------------------------------------------- absurd headers

BODY = b'{"model": "chat", "messages": []}'


def test_header_over_envoys_limit_is_refused_by_envoy(stack, stays_healthy):
    """A header value past Envoy's 60 KiB limit, or more headers than it
    takes, is refused by Envoy's codec before any filter runs: a 431 with a
    JSON body (the decision filter stays out of that reply, so the codec does
    not close the connection first). Nothing reaches a backend."""
    too_many = [(b"x-h%d" % i, b"v") for i in range(200)]
    for path, extra in ((CHAT, [(b"x-big", b"a" * 60 * 1024)]), (CHAT, [(b"x-big", b"a" * 100 * 1024)]),
                        (MESSAGES, [(b"x-big", b"a" * 100 * 1024)]), (CHAT, too_many)):
        status, headers, out = raw_request(stack.listen, "POST", path.encode(), JSON_AUTH + extra, BODY)
        assert status == 431, (status, out[:200])
        # The codec refuses before the path is read: the reply cannot take the ingress's family.
        check_error(status, headers, out, "openai")
    nothing_reached_backends(stack)


def test_header_under_envoys_limit_is_decided_normally(stack, stays_healthy):
    """A 60,000-byte header value passes Envoy: the sidecar decides the request
    (attribution headers present) and never answers 5xx; what the backend
    makes of the header is the backend's answer."""
    status, headers, out = raw_request(stack.listen, "POST", CHAT.encode(),
                                       JSON_AUTH + [(b"x-big", b"a" * 60_000)], BODY)
    assert 200 <= status < 500, (status, out[:200])
    assert headers["x-continuum-experiment-variant"] == arm_of(GOOD_KEY)


def test_same_header_repeated_50_times(stack, stays_healthy):
    """Fifty copies of one header are harmless: the request is decided normally."""
    status, headers, out = raw_request(stack.listen, "POST", CHAT.encode(),
                                       JSON_AUTH + [(b"x-repeat", b"v%d" % i) for i in range(50)], BODY)
    assert status == 200, out[:300]
    assert headers["x-continuum-experiment-variant"] == arm_of(GOOD_KEY)


def test_authorization_repeated_50_times_with_one_bad_copy_is_refused(stack, stays_healthy):
    """Many Authorization headers with one unknown key among them are never admitted, whichever comes first."""
    good = (b"authorization", b"Bearer " + GOOD_KEY.encode())
    for headers in ([good] * 49 + [(b"authorization", b"Bearer sk-nope")],
                    [(b"authorization", b"Bearer sk-nope")] + [good] * 49):
        status, h, out = raw_request(stack.listen, "POST", CHAT.encode(),
                                     [(b"content-type", b"application/json")] + headers, BODY)
        assert status == 401, out[:300]
        check_error(status, h, out, "openai")
    nothing_reached_backends(stack)


@pytest.mark.parametrize("path", [CHAT, MESSAGES, "/v1/files", "/v1/models"])
@pytest.mark.parametrize("header", [
    (b"authorization", b"Bearer sk-\xff\xfe\x80"),
    (b"authorization", b"Bearer " + GOOD_KEY.encode() + b"\xc3\xa9"),
    (b"authorization", b"\xe2\x98\x83 " + GOOD_KEY.encode()),
    (b"x-api-key", b"sk input good 4b1d"),
    (b"x-api-key", GOOD_KEY.encode()[:-1] + b" " + GOOD_KEY.encode()[-1:]),
    (b"x-api-key", b"Bearer " + GOOD_KEY.encode()),
    (b"authorization", b"Bearer"),
    (b"authorization", b"Basic " + GOOD_KEY.encode()),
], ids=["non-ascii", "valid-plus-utf8", "snowman-scheme", "spaces", "space-inside-valid", "x-api-key-bearer",
        "bearer-only", "basic"])
def test_malformed_credentials_get_401(stack, stays_healthy, path, header):
    """Keys with non-ASCII bytes, inner spaces or the wrong scheme are 401 in
    the family's shape, on decided, listing and passthrough paths alike."""
    status, h, out = raw_request(stack.listen, "POST" if path in (CHAT, MESSAGES) else "GET", path.encode(),
                                 [(b"content-type", b"application/json"), header], BODY)
    assert status == 401, (status, out[:300])
    check_error(status, h, out, family_of(path))
    nothing_reached_backends(stack)


def test_key_with_surrounding_whitespace_is_the_key(stack, stays_healthy):
    """Whitespace around a valid key (trimmed by HTTP) still admits it."""
    status, _, out = raw_request(stack.listen, "POST", CHAT.encode(),
                                 [(b"content-type", b"application/json"),
                                  (b"x-api-key", b"  " + GOOD_KEY.encode() + b" \t")],
                                 BODY)
    assert status == 200, out[:300]


def sticky_arm(stack, value: bytes) -> tuple[int, str | None]:
    body = b'{"model": "chat-h", "messages": []}'
    status, h, out = raw_request(stack.listen, "POST", CHAT.encode(), JSON_AUTH + [(b"x-user", value)], body)
    return status, h.get("x-continuum-experiment-variant")


def test_sticky_header_with_control_characters(stack, stays_healthy):
    """Control characters in the sticky header are refused by Envoy before any
    decision (the connection is closed, or a JSON 400); a tab or non-ASCII
    bytes are a sticky value like any other: the same value, the same arm."""
    for value in (b"user\x01x", b"user\x00x", b"user\x1bx", b"user\x7fx", b"user\x0bx"):
        errors = envoy_stat(stack, "downstream_cx_protocol_error")
        status, h, out = raw_request(stack.listen, "POST", CHAT.encode(), JSON_AUTH + [(b"x-user", value)],
                                     b'{"model": "chat-h"}')
        assert status in (0, 400), (value, status, out[:200])
        if status:
            check_error(status, h, out, "openai")
        else:
            assert envoy_stat(stack, "downstream_cx_protocol_error") > errors
    nothing_reached_backends(stack)
    try:
        for value in (b"user\tx", b"\xff\xfe\x80", "usér".encode(), b"u" * 4000):
            first = sticky_arm(stack, value)
            assert first[0] == 200 and first[1] in ("one", "two")
            assert sticky_arm(stack, value) == first
            expected = assign("by-header", (("one", 1), ("two", 1)), value.decode("latin-1")).variant_id
            assert first[1] == expected
        # A bare CR is dropped by Envoy's codec: still one well-defined value.
        first = sticky_arm(stack, b"user\rx")
        assert first[0] == 200 and sticky_arm(stack, b"user\rx") == first
    finally:
        clear_demo_requests(stack)


def test_demo_engine_request_log_survives_non_utf8_header(stack, stays_healthy):
    """The demo engine's request log stays readable after a request with non-UTF-8 header bytes."""
    try:
        assert sticky_arm(stack, b"\xff\xfe")[0] == 200
        r = httpx.get(stack.demo_urls["pool-a"] + "/_demo/requests")
        r2 = httpx.get(stack.demo_urls["pool-b"] + "/_demo/requests")
        assert r.status_code == 200 and r2.status_code == 200
    finally:
        clear_demo_requests(stack)


# ----------------------------------------------------------------------- spoofing

SPOOF_HEADERS = {
    "routing-header": lambda other: {"x-model-router-backend": ARM[other][0]},
    "experiment-headers": lambda other: {
        "x-continuum-experiment": "split", "x-continuum-experiment-variant": other,
        "x-continuum-model-variant": "nitro",
    },
    "backend-preference": lambda other: {"x-backend": ARM[other][0]},
    "all": lambda other: {
        "x-model-router-backend": ARM[other][0], "x-backend": ARM[other][0],
        "x-continuum-experiment": "split", "x-continuum-experiment-variant": other,
    },
}


@pytest.mark.parametrize("spoof", list(SPOOF_HEADERS))
def test_client_headers_and_body_fields_never_steer(stack, stays_healthy, spoof):
    """Routing headers, attribution headers, a backend preference and
    ``backends``/``variant`` body fields naming the other arm leave the caller
    in its own arm, on its arm's backend."""
    assert {arm_of(GOOD_KEY), arm_of(OTHER_KEY)} == {"control", "candidate"}
    for key in (GOOD_KEY, OTHER_KEY):
        mine = arm_of(key)
        other = "candidate" if mine == "control" else "control"
        clear_demo_requests(stack)
        headers = {"authorization": f"Bearer {key}", **SPOOF_HEADERS[spoof](other)}
        body = {"model": "chat", "messages": [], "backends": [ARM[other][0]], "variant": other,
                "x-model-router-backend": ARM[other][0]}
        r = httpx.post(stack.url + CHAT, json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["x-continuum-experiment-variant"] == mine
        assert r.headers["x-continuum-experiment"] == "split"
        assert "x-continuum-model-variant" not in r.headers
        assert r.json()["model"] == ARM[mine][1]
        (rec,) = [x for x in demo_requests(stack, ARM[mine][0]) if x["path"] == CHAT]
        assert [x for x in demo_requests(stack, ARM[other][0]) if x["path"] == CHAT] == []
        assert "x-model-router-backend" not in rec["headers"]
    # A reserved model stays refused whatever the client claims.
    r = httpx.post(stack.url + CHAT, json={"model": "model-b", "messages": []},
                   headers={**AUTH, **SPOOF_HEADERS[spoof]("candidate")})
    expect_error(r, 404, "openai")


def test_spoofed_routing_header_on_refused_requests_reaches_nothing(stack, stays_healthy):
    """A routing header on a request without a valid key reaches no backend, on decided and passthrough paths."""
    for headers in ({}, {"authorization": "Bearer sk-nope"}):
        r = httpx.post(stack.url + CHAT, json={"model": "chat", "messages": []},
                       headers={**headers, "x-model-router-backend": "pool-b"})
        expect_error(r, 401, "openai")
    r = httpx.get(stack.url + "/v1/files", headers={"x-model-router-backend": "pool-b"})
    expect_error(r, 401, "openai")
    nothing_reached_backends(stack)


def test_percent_encoded_ingress_path_cannot_bypass_the_decision(stack, stays_healthy):
    """A percent-encoded spelling of a decided path never reaches a backend undecided."""
    for spelling in ("/v1/chat/%63ompletions", "/v1//chat/./completions", "/v1/x/../chat/completions",
                     "/v1%2Fchat%2Fcompletions"):
        r = httpx.post(stack.url + spelling, json={"model": "model-a", "messages": []}, headers=AUTH)
        expect_error(r, 404, "openai")
        assert r.json()["error"]["code"] == "model_not_found"
    assert [rec for rec in demo_requests(stack, "pool-a") if (rec.get("json") or {}).get("model") == "model-a"] == []
    # The same spelling of a decided request is decided, and goes upstream canonical.
    clear_demo_requests(stack)
    r = httpx.post(stack.url + "/v1/chat/%63ompletions", json={"model": "chat", "messages": []}, headers=AUTH)
    assert r.status_code == 200
    seen = demo_requests(stack, "pool-a") + demo_requests(stack, "pool-b")
    assert [rec["path"] for rec in seen] == ["/v1/chat/completions"]


# ----------------------------------------------------------------------- leaks


def test_api_keys_never_in_logs_or_metrics(stack, stays_healthy):
    """Valid and rejected keys, in either header, on every kind of path, never
    appear in the sidecar's or Envoy's logs, in /metrics, or upstream."""
    valid = {"authorization": f"Bearer {LEAK_VALID}"}
    sent = 0
    for headers in (valid, {"x-api-key": LEAK_VALID}, {"authorization": f"Bearer {LEAK_REJECTED}"},
                    {"x-api-key": LEAK_REJECTED},
                    {"authorization": f"Bearer {LEAK_REJECTED}", "x-api-key": LEAK_VALID}):
        for method, path, body in (
            ("POST", CHAT, {"model": "chat", "messages": []}),
            ("POST", CHAT, {"model": "model-a", "messages": []}),
            ("POST", CHAT, {"model": "no-such-model"}),
            ("POST", MESSAGES, {"model": "chat", "max_tokens": 5, "messages": []}),
            ("POST", "/anthropic/v1/messages/count_tokens", {"model": "chat", "messages": []}),
            ("POST", CHAT, {"model": 5}),
            ("GET", "/v1/models", None),
            ("GET", "/v1/files", None),
            ("GET", "/v1/realtime?model=chat", None),
        ):
            r = httpx.request(method, stack.url + path, json=body, headers={**headers, "x-user": LEAK_VALID})
            assert r.status_code < 500
            sent += 1
    r = httpx.post(stack.url + CHAT, content=b"{" + LEAK_REJECTED.encode(), headers=valid)
    assert r.status_code == 400
    assert LEAK_REJECTED not in r.text
    assert metered(stack, timeout=15)  # every request's access-log entry has reached the sidecar and its log
    logs = {"sidecar": stack.log("sidecar-0"), "envoy": stack.log("envoy")}
    metrics_text = "\n".join(stack.metrics_text())
    for secret in (LEAK_VALID, LEAK_REJECTED, ADMIN_TOKEN, "LEAKPROBE"):
        for name, text in logs.items():
            assert secret not in text, f"{secret} in the {name} log"
        assert secret not in metrics_text
    for name in stack.demo_urls:
        for rec in demo_requests(stack, name):
            assert "LEAKPROBE" not in str(rec["headers"].get("authorization", "")) + rec["headers"].get("x-api-key", "")


ADMIN = [("GET", "/admin/models"), ("GET", "/admin/backends"), ("POST", "/admin/reload")]


@pytest.mark.parametrize("method, path", ADMIN)
def test_admin_endpoints_refuse_without_the_exact_token(stack, stays_healthy, method, path):
    """No token, a wrong one, a prefix or an extension of the right one, another scheme or header: 401."""
    url = f"http://{stack.sidecar_admin[0]}{path}"
    for headers in (
        {},
        {"authorization": "Bearer"},
        {"authorization": "Bearer wrong-token"},
        {"authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},  # a prefix
        {"authorization": f"Bearer {ADMIN_TOKEN[:4]}"},
        {"authorization": f"Bearer {ADMIN_TOKEN}x"},  # an extension
        {"authorization": f"Bearer {ADMIN_TOKEN.upper()}"},
        {"authorization": f"Basic {ADMIN_TOKEN}"},
        {"x-api-key": ADMIN_TOKEN},
        {"authorization": f"Bearer {GOOD_KEY}"},  # a router key is not an admin token
    ):
        r = httpx.request(method, url, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert ADMIN_TOKEN not in r.text
    r = httpx.request(method, url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method, path", ADMIN)
def test_admin_endpoints_refuse_non_utf8_token_with_401(stack, method, path):
    """Non-UTF-8 bytes in the admin Authorization header are refused with 401."""
    status, _, out = raw_request(stack.sidecar_admin[0], method, path.encode(),
                                 [(b"authorization", b"Bearer " + ADMIN_TOKEN.encode() + b"\xff")])
    assert status == 401, (status, out[:200])


NO_TOKEN_CONFIG = f"""
server: {{reload_interval_ms: 100}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a]}}
api_keys:
  - {{key: {LEAK_VALID}, id: leak-probe}}
"""


@pytest.fixture(scope="module")
def plain_stack(stack_factory):
    return stack_factory(NO_TOKEN_CONFIG)


def test_admin_endpoints_without_a_configured_token_refuse_everyone(plain_stack):
    """Without ``server.admin_token`` the admin endpoints admit no one."""
    for method, path in ADMIN:
        for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Bearer None"},
                        {"authorization": "Bearer null"}):
            r = httpx.request(method, f"http://{plain_stack.sidecar_admin[0]}{path}", headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)


def test_rejected_config_edit_does_not_log_api_keys(plain_stack):
    """A rejected config edit is logged without the API keys it contains."""
    stack = plain_stack
    failures = metric(stack, "model_router_config_reloads_total", result="failure")
    original = stack.config_path.read_text()
    try:
        stack.config_path.write_text(original.replace(f"{{key: {LEAK_VALID}, id: leak-probe}}",
                                                      f"{{key: {LEAK_VALID}, id: leak-probe"))
        deadline = time.monotonic() + 10
        while metric(stack, "model_router_config_reloads_total", result="failure") <= failures:
            assert time.monotonic() < deadline, "the invalid edit was not noticed"
            time.sleep(0.05)
    finally:
        stack.config_path.write_text(original)
    assert "config reload rejected" in stack.log("sidecar-0")
    assert LEAK_VALID not in stack.log("sidecar-0")
