"""The :online variant's web-search loop, through real Envoy."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from aiohttp import web

from sidecar.devstack.stack import free_port

from ..conftest import clear_demo_requests, demo_requests, metric

pytestmark = pytest.mark.integration


class SearchStub:
    """A SearXNG-compatible search API on loopback that records its queries."""

    def __init__(self):
        self.port = free_port()
        self.queries: list[str] = []
        self.mode = "ok"  # ok | slow | fail
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def handle(self, request: web.Request) -> web.Response:
        q = request.query.get("q", "")
        self.queries.append(q)
        if self.mode == "slow":
            await asyncio.sleep(3)
        if self.mode == "fail":
            return web.json_response({"error": "boom"}, status=500)
        assert request.query.get("format") == "json"
        n = len(self.queries)
        return web.json_response({"results": [
            {"url": f"https://example.org/{n}/a", "title": f"Result A{n}", "content": f"about {q}"},
            {"url": f"https://example.org/{n}/b", "title": f"Result B{n}", "content": "more"},
            {"url": f"https://example.org/{n}/c", "title": "beyond the configured count", "content": ""},
        ]})

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/search", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def start(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


CONFIG = """
proxy: {variant_suffixes: {enabled: true}}
web_search: {enabled: true, url: "http://127.0.0.1:%d/search", results: 2, max_iterations: 2, timeout_s: 1, deadline_s: 20}
backends:
  - {name: local, url: "demo://", models: [base]}
  - {name: hosted, url: "demo://", commercial: true, models: [hosted-model]}
"""


@pytest.fixture(scope="module")
def search():
    s = SearchStub().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stack(stack_factory, search):
    s = stack_factory(CONFIG % search.port)
    s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=30)
    return s


@pytest.fixture(autouse=True)
def reset(search, stack):
    search.queries.clear()
    search.mode = "ok"
    clear_demo_requests(stack)


def generated_tokens(stack) -> float:
    text = httpx.get(stack.demo_urls["local"] + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


def test_search_once_then_answer(stack, search):
    before = generated_tokens(stack)
    searches = metric(stack, "model_router_web_searches_total")
    raw = stack.oa.chat.completions.with_raw_response.create(
        model="base:online", messages=[{"role": "user", "content": "[search:1] latest envoy release"}])
    r = raw.parse()
    assert raw.headers["x-continuum-model-variant"] == "online"
    assert r.model == "base:online"
    assert search.queries == ["[search:1] latest envoy release #1"]
    content = r.choices[0].message.content
    assert "https://example.org/1/a" in content and "https://example.org/1/c" not in content
    cites = [a.url_citation for a in r.choices[0].message.annotations]
    assert [(c.url, c.title) for c in cites] == [("https://example.org/1/a", "Result A1"), ("https://example.org/1/b", "Result B1")]
    seen = demo_requests(stack, "local")
    assert len(seen) == 2
    assert [t["function"]["name"] for t in seen[0]["json"]["tools"]] == ["web_search"]
    assert seen[0]["json"]["model"] == "base" and "stream" not in seen[0]["json"]
    assert seen[1]["json"]["messages"][-1]["role"] == "tool"
    # Usage sums both calls: the engine's own counter saw the same completion tokens.
    assert r.usage.completion_tokens == generated_tokens(stack) - before
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens > 2 * len("[search:1] latest envoy release".split())
    assert metric(stack, "model_router_web_searches_total") == searches + 1


def test_iteration_cap_ends_a_model_that_keeps_searching(stack, search):
    r = stack.oa.chat.completions.create(model="base:online", messages=[{"role": "user", "content": "[search:99] loop"}])
    assert len(search.queries) == 2
    seen = demo_requests(stack, "local")
    assert len(seen) == 3
    assert "tools" not in seen[2]["json"]  # the last call has no search tool to call
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].message.annotations) == 4


def test_client_tool_calls_are_returned_untouched(stack, search):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    r = stack.oa.chat.completions.create(model="base:online", tools=tools,
                                         messages=[{"role": "user", "content": "[client-tool] weather?"}])
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].function.arguments == '{"city":"Paris"}'
    assert search.queries == []
    sent = demo_requests(stack, "local")[0]["json"]["tools"]
    assert [t["function"]["name"] for t in sent] == ["get_weather", "web_search"]


def test_streaming_and_commercial_backends_are_refused(stack, search):
    with pytest.raises(openai.NotFoundError) as info:
        list(stack.oa.chat.completions.create(model="base:online", stream=True, messages=[]))
    assert info.value.body["code"] == "unsupported_model_variant"
    with pytest.raises(openai.NotFoundError) as info:
        stack.oa.chat.completions.create(model="hosted-model:online", messages=[])
    assert info.value.body["code"] == "unsupported_model_variant" and "hosted-model:online" in info.value.body["message"]
    assert demo_requests(stack, "local") == [] and demo_requests(stack, "hosted") == []


@pytest.mark.parametrize("mode, fragment", [("fail", "answered HTTP 500"), ("slow", "did not answer within 1 s")])
def test_provider_failure_is_a_clear_502(stack, search, mode, fragment):
    search.mode = mode
    errors_before = metric(stack, "model_router_web_search_provider_errors_total")
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=30,
                   json={"model": "base:online", "messages": [{"role": "user", "content": "[search:1] x"}]})
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_error" and "Web search failed" in err["message"] and fragment in err["message"]
    assert metric(stack, "model_router_web_search_provider_errors_total") == errors_before + 1


def test_disabled_web_search_refuses(stack_factory):
    s = stack_factory("""
proxy: {variant_suffixes: {enabled: true}}
backends: [{name: local, url: "demo://", models: [base]}]
""")
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": "base:online", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_model_variant"
