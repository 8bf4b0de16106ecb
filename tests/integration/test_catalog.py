"""Listings, hidden and reserved variant models, through real Envoy."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import anthropic
import httpx
import openai
import pytest

from ..conftest import metric

pytestmark = pytest.mark.integration

CONFIG = """
server: {admin_token: adm-secret}
backends:
  - {name: pool-a, url: "demo://", models: [model-a, model-c, model-z]}
  - {name: pool-b, url: "demo://", models: [model-b]}
model_metadata:
  - {id: model-b, aliases: [model-b-alias], reasoning_efforts: [low, high]}
  - {id: model-c, aliases: [model-c-alias]}
model_aliases: {claude-chat: chat, old-b: model-b}
api_keys:
  - {key: k-all, id: all}
  - {key: k-pool-a, id: pool-a-only, allowed_backends: [pool-a]}
  - {key: k-models, id: some-models, allowed_models: [chat, model-b, model-c]}
model_experiments:
  - name: hidden-exp
    model: chat
    hide_variant_models: %(hide)s
    variants:
      - {id: control, model: model-a, weight: 9}
      - {id: candidate, model: model-b, weight: 1, backends: [pool-b]}
      - {id: parked, model: model-z, weight: 0}
"""


@pytest.fixture(scope="module")
def hidden(stack_factory):
    return stack_factory(CONFIG % {"hide": "true"})


@pytest.fixture(scope="module")
def shown(stack_factory):
    return stack_factory(CONFIG % {"hide": "false"})


def ids(stack, key):
    return sorted(m.id for m in openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0).models.list())


def test_listings_with_and_without_hiding(hidden, shown):
    assert ids(shown, "k-all") == ["chat", "model-a", "model-b", "model-b-alias", "model-c", "model-c-alias", "model-z"]
    assert ids(hidden, "k-all") == ["chat", "model-c", "model-c-alias"]


def test_listings_are_filtered_per_key(hidden, shown):
    assert ids(shown, "k-models") == ["chat", "model-b", "model-c"]
    assert ids(hidden, "k-models") == ["chat", "model-c"]
    assert ids(shown, "k-pool-a") == ["chat", "model-a", "model-c", "model-c-alias", "model-z"]
    ext = httpx.get(hidden.url + "/v1/models/extended", headers={"authorization": "Bearer k-pool-a"}).json()["data"]
    chat = next(e for e in ext if e["id"] == "chat")
    assert chat["backends"] == ["pool-a"] and chat["experiment"] == "hidden-exp"
    ext = httpx.get(hidden.url + "/v1/models/extended", headers={"authorization": "Bearer k-all"}).json()["data"]
    chat = next(e for e in ext if e["id"] == "chat")
    # The union of the positive-weight variants' backends, each narrowed by its pin.
    assert chat["backends"] == ["pool-a", "pool-b"]
    assert next(e for e in ext if e["id"] == "model-c")["metadata"] == {"id": "model-c", "aliases": ["model-c-alias"]}


def test_retrieve(hidden):
    client = openai.OpenAI(base_url=hidden.url + "/v1", api_key="k-all", max_retries=0)
    assert client.models.retrieve("chat").id == "chat"
    for name in ("model-a", "model-b", "model-z", "model-b-alias", "nope"):
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(name)


def test_anthropic_listing(hidden):
    an = anthropic.Anthropic(base_url=hidden.url + "/anthropic", api_key="k-all", max_retries=0)
    page = an.models.list()
    assert sorted(m.id for m in page.data) == ["chat", "model-c", "model-c-alias"]
    assert all(m.display_name == m.id for m in page.data)
    assert an.models.retrieve("chat").id == "chat"
    with pytest.raises(anthropic.NotFoundError):
        an.models.retrieve("model-a")


def _multipart(model: str) -> tuple[bytes, str]:
    b = "----mr-boundary"
    body = (
        f"--{b}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
        f"--{b}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n"
        f"--{b}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n"
        f"Content-Type: image/png\r\n\r\n\x89PNG\r\n--{b}--\r\n"
    ).encode("latin-1")
    return body, f"multipart/form-data; boundary={b}"


def send(stack, ingress: str, model: str, key: str = "k-all") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if ingress == "/v1/images/edits":
        body, ctype = _multipart(model)
        return httpx.post(stack.url + ingress, content=body, headers={**headers, "content-type": ctype})
    if ingress == "/v1/realtime":
        return httpx.get(stack.url + ingress, params={"model": model}, headers=headers)
    payload = {"model": model, "messages": [{"role": "user", "content": "x"}], "input": "x", "prompt": "x",
               "query": "q", "documents": ["d"], "max_tokens": 5}
    return httpx.post(stack.url + ingress, json=payload, headers=headers)


INGRESSES = [
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/anthropic/v1/messages", "/anthropic/v1/messages/count_tokens", "/v1/images/generations",
    "/v1/images/edits", "/v1/rerank", "/embed_sparse", "/v1/realtime",
]
UNKNOWN = "model-q"  # same length as the reserved names, so byte counts line up too


@pytest.mark.parametrize("ingress", INGRESSES)
@pytest.mark.parametrize("reserved", ["model-a", "model-b", "model-z"])
def test_reserved_refusal_is_byte_identical_to_unknown(hidden, ingress, reserved):
    before = metric(hidden, "model_experiment_reserved_refusals_total", experiment="hidden-exp")
    r = send(hidden, ingress, reserved)
    u = send(hidden, ingress, UNKNOWN)
    assert r.status_code == u.status_code == 404
    assert r.headers["content-type"] == u.headers["content-type"] == "application/json"
    assert r.content.replace(reserved.encode(), UNKNOWN.encode()) == u.content
    assert reserved in r.json()["error"]["message"]
    assert sorted(k for k in r.headers if k != "date") == sorted(k for k in u.headers if k != "date")
    assert metric(hidden, "model_experiment_reserved_refusals_total", experiment="hidden-exp") == before + 1


def test_the_same_names_are_served_without_hiding(shown):
    for ingress in INGRESSES:
        if ingress in ("/v1/realtime",):
            continue
        r = send(shown, ingress, "model-a")
        assert r.status_code == 200, (ingress, r.text[:300])


def test_aliases_and_allowed_models_do_not_lift_the_reservation(hidden):
    # A metadata alias of a reserved model, and a model_aliases slot pointing at one.
    assert send(hidden, "/v1/chat/completions", "model-b-alias").status_code == 404
    assert send(hidden, "/v1/responses", "old-b").status_code == 404
    # allowed_models names model-b: still refused, as an unknown model.
    r = send(hidden, "/v1/chat/completions", "model-b", key="k-models")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # A per-key 403 comes first, exactly as it would for an unknown name.
    assert send(hidden, "/v1/chat/completions", "model-a", key="k-models").status_code == 403
    assert send(hidden, "/v1/chat/completions", UNKNOWN, key="k-models").status_code == 403
    # The experiment's own rewrite reaches reserved models, also through model_aliases.
    r = anthropic.Anthropic(base_url=hidden.url + "/anthropic", api_key="k-all", max_retries=0).messages.create(
        model="claude-chat", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert r.model in ("model-a", "model-b")
    # /v1/batches is not covered: it passes through untouched.
    assert send(hidden, "/v1/batches", "model-a").status_code == 404  # the demo engine has no batches route
    assert "model_not_found" not in send(hidden, "/v1/batches", "model-a").text


def test_admin_models_needs_the_token(hidden):
    admin = f"http://{hidden.sidecar_admin[0]}/admin/models"
    assert httpx.get(admin).status_code == 401
    assert httpx.get(admin, headers={"authorization": "Bearer wrong"}).status_code == 401
    data = httpx.get(admin, headers={"authorization": "Bearer adm-secret"}).json()["data"]
    by_id = {d["id"]: d for d in data}
    assert set(by_id) == {"chat", "model-a", "model-b", "model-b-alias", "model-c", "model-c-alias", "model-z"}
    assert by_id["model-z"]["hidden"] and "hidden-exp" in by_id["model-z"]["hidden_reason"]
    assert by_id["model-b-alias"]["alias_of"] == "model-b"
    assert not by_id["chat"]["hidden"]


def test_realtime_websocket_through_envoy(hidden):
    async def run():
        url = hidden.url.replace("http://", "ws://") + "/v1/realtime"
        async with aiohttp.ClientSession(headers={"authorization": "Bearer k-all"}) as session:
            async with session.ws_connect(url, params={"model": "model-c"}) as ws:
                hello = json.loads((await ws.receive()).data)
                await ws.send_str("ping")
                echo = (await ws.receive()).data
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                async with session.ws_connect(url, params={"model": "model-a"}):
                    pass
        return hello, echo, info.value.status

    hello, echo, status = asyncio.run(run())
    assert hello == {"type": "session.created", "session": {"model": "model-c", "engine": "pool-a"}}
    assert echo == "ping"
    assert status == 404


def test_discovered_models_are_served_and_listed(stack_factory):
    """A backend without a models list serves what its own /v1/models reports."""
    s = stack_factory("""
monitor: {models_interval_s: 0.3}
backends:
  - {name: listed, url: "demo://", models: [m-listed]}
  - {name: found, url: "demo://"}
""")
    # The demo engine behind 'found' reports its default model, demo-model.
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
    deadline = time.monotonic() + 15
    while "demo-model" not in {m.id for m in client.models.list()}:
        assert time.monotonic() < deadline, "discovery did not happen"
        time.sleep(0.1)
    r = client.chat.completions.create(model="demo-model", messages=[])
    assert r.choices[0].message.content.startswith("[found] demo-model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-reported", messages=[])


def test_images_edit_experiment_rewrites_the_form_field(shown):
    body, ctype = _multipart("chat")
    r = httpx.post(shown.url + "/v1/images/edits", content=body,
                   headers={"content-type": ctype, "authorization": "Bearer k-all"})
    assert r.status_code == 200
    assert r.json()["model"] in ("model-a", "model-b")
