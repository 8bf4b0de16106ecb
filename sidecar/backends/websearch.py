"""The :online variant: a router-managed web-search tool loop.

For a buffered ``model:online`` chat completion the sidecar itself calls the
chosen backend with a ``web_search`` function tool added, runs every search
the model asks for against the configured provider, feeds the results back
as tool messages, and repeats until the model answers (or the iteration cap
forces a last call without the tool). The client gets one ordinary chat
completion: the requested model name, usage summed over every call, and the
sources as ``url_citation`` annotations.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from .. import errors, metrics
from ..config.schema import WebSearch
from ..errors import Reply
from ..routing.snapshot import BackendInfo

log = logging.getLogger("model_router.websearch")

TOOL_NAME = "web_search"
TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Search the web for current information. Returns result titles, URLs and snippets.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The search query."}},
            "required": ["query"],
        },
    },
}


class SearchError(Exception):
    """The provider failed; the message is safe to show to the client."""


class UpstreamError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


@dataclass
class Source:
    url: str
    title: str


@dataclass
class Result:
    title: str
    url: str
    snippet: str


def _dig(data: Any, path: str) -> Any:
    for part in path.split(".") if path else ():
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def parse_results(cfg: WebSearch, payload: Any) -> list[Result]:
    items = _dig(payload, cfg.results_path)
    if not isinstance(items, list):
        raise SearchError(f"the provider's answer has no result list at '{cfg.results_path}'")
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        url = item.get(cfg.url_field)
        if not isinstance(url, str) or not url:
            continue
        title = item.get(cfg.title_field)
        snippet = item.get(cfg.snippet_field)
        out.append(Result(str(title) if title else url, url, str(snippet) if snippet else ""))
        if len(out) >= cfg.results:
            break
    return out


async def search(session: aiohttp.ClientSession, cfg: WebSearch, query: str) -> list[Result]:
    headers = {"accept": "application/json"}
    if cfg.api_key:
        name = cfg.api_key_header
        headers[name] = f"Bearer {cfg.api_key}" if name.lower() == "authorization" else cfg.api_key
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    try:
        if cfg.method == "GET" or cfg.provider == "searxng":
            params = {cfg.query_field: query}
            if cfg.provider == "searxng":
                params["format"] = "json"
            if cfg.count_field:
                params[cfg.count_field] = str(cfg.results)
            ctx = session.get(cfg.url, params=params, headers=headers, timeout=timeout)
        else:
            body: dict[str, Any] = {cfg.query_field: query}
            if cfg.count_field:
                body[cfg.count_field] = cfg.results
            ctx = session.post(cfg.url, data=orjson.dumps(body), headers={**headers, "content-type": "application/json"},
                               timeout=timeout)
        async with ctx as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise SearchError(f"the search provider answered HTTP {resp.status}")
    except TimeoutError:
        raise SearchError(f"the search provider did not answer within {cfg.timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise SearchError(f"the search provider could not be reached ({type(exc).__name__})") from None
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise SearchError("the search provider's answer is not JSON") from None
    return parse_results(cfg, payload)


def _format(results: list[Result]) -> str:
    if not results:
        return "No results."
    return "\n\n".join(f"[{i}] {r.title}\n{r.url}\n{r.snippet}" for i, r in enumerate(results, 1))


@dataclass
class Loop:
    """One :online request's state."""

    cfg: WebSearch
    backend: BackendInfo
    path: str
    headers: dict[str, str]
    request: dict[str, Any]
    requested: str
    usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
    sources: list[Source] = field(default_factory=list)
    iterations: int = 0

    async def call(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
        b = self.backend
        url = f"{'https' if b.tls else 'http'}://{b.host}:{b.port}"
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        self.iterations += 1
        metrics.WEB_SEARCH_ITERATIONS.inc()
        try:
            async with session.post(url + self.path, data=orjson.dumps(body), headers=self.headers, timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise UpstreamError(504, f"the model did not answer within {self.cfg.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(502, f"the model's backend could not be reached ({type(exc).__name__})") from None
        if status != 200:
            raise UpstreamError(502, f"the model's backend answered HTTP {status}")
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(502, "the model's backend answered with something that is not JSON") from None
        usage = data.get("usage") if isinstance(data, dict) else None
        if isinstance(usage, dict):
            for k in self.usage:
                v = usage.get(k)
                if isinstance(v, int):
                    self.usage[k] += v
        if not isinstance(data, dict) or not data.get("choices"):
            raise UpstreamError(502, "the model's backend answered without choices")
        return data

    async def run(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        messages = list(self.request.get("messages") or [])
        client_tools = [t for t in (self.request.get("tools") or []) if not _is_ours(t)]
        base = {k: v for k, v in self.request.items() if k not in ("stream", "stream_options")}
        for _ in range(self.cfg.max_iterations):
            body = dict(base, messages=messages, tools=client_tools + [TOOL])
            data = await self.call(session, body)
            message = data["choices"][0].get("message") or {}
            calls = message.get("tool_calls") or []
            ours = [c for c in calls if _call_name(c) == TOOL_NAME]
            if not ours:
                return data
            if len(ours) != len(calls):
                # The client's own tools were called too: hand those back untouched.
                message["tool_calls"] = [c for c in calls if _call_name(c) != TOOL_NAME]
                return data
            messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": ours})
            found = await asyncio.gather(*(self._run_search(session, c) for c in ours))
            for call, results in zip(ours, found):
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": _format(results)})
        # The cap was reached: one last call without the search tool.
        body = dict(base, messages=messages)
        if client_tools:
            body["tools"] = client_tools
        else:
            body.pop("tools", None)
            body.pop("tool_choice", None)
        return await self.call(session, body)

    async def _run_search(self, session: aiohttp.ClientSession, call: dict[str, Any]) -> list[Result]:
        args = (call.get("function") or {}).get("arguments")
        try:
            query = orjson.loads(args).get("query") if isinstance(args, str) else None
        except (orjson.JSONDecodeError, AttributeError):
            query = None
        if not isinstance(query, str) or not query.strip():
            return []
        metrics.WEB_SEARCHES.inc()
        try:
            results = await search(session, self.cfg, query.strip())
        except SearchError:
            metrics.WEB_SEARCH_ERRORS.inc()
            raise
        known = {s.url for s in self.sources}
        for r in results:
            if r.url not in known:
                self.sources.append(Source(r.url, r.title))
                known.add(r.url)
        return results

    def finish(self, data: dict[str, Any]) -> dict[str, Any]:
        data["model"] = self.requested
        data["usage"] = dict(self.usage)
        message = data["choices"][0].setdefault("message", {})
        content = message.get("content") if isinstance(message.get("content"), str) else ""
        if self.sources:
            message["annotations"] = list(message.get("annotations") or []) + [
                {"type": "url_citation",
                 "url_citation": {"url": s.url, "title": s.title, "start_index": 0, "end_index": len(content)}}
                for s in self.sources
            ]
        return data


def _is_ours(tool: Any) -> bool:
    return isinstance(tool, dict) and (tool.get("function") or {}).get("name") == TOOL_NAME


def _call_name(call: Any) -> str | None:
    return (call.get("function") or {}).get("name") if isinstance(call, dict) else None


async def run(
    session: aiohttp.ClientSession, cfg: WebSearch, backend: BackendInfo, path: str,
    headers: dict[str, str], request: dict[str, Any], requested: str,
) -> Reply:
    """Run the loop and build the client's answer (or a clear error)."""
    loop = Loop(cfg, backend, path, headers, request, requested)
    started = time.monotonic()
    try:
        data = await asyncio.wait_for(loop.run(session), timeout=cfg.deadline_s)
    except SearchError as exc:
        metrics.WEB_SEARCH_REQUESTS.labels("provider_error").inc()
        return errors.error("bad_gateway", f"Web search failed: {exc}.", "openai")
    except UpstreamError as exc:
        metrics.WEB_SEARCH_REQUESTS.labels("upstream_error").inc()
        kind: errors.Kind = "gateway_timeout" if exc.status == 504 else "bad_gateway"
        return errors.error(kind, f"The :online request failed: {exc}.", "openai")
    except TimeoutError:
        metrics.WEB_SEARCH_REQUESTS.labels("deadline").inc()
        return errors.error(
            "gateway_timeout", f"The :online request did not finish within {cfg.deadline_s:g} s.", "openai"
        )
    metrics.WEB_SEARCH_REQUESTS.labels("success").inc()
    log.debug("online loop: %d calls, %d sources, %.3f s", loop.iterations, len(loop.sources), time.monotonic() - started)
    return Reply(200, orjson.dumps(loop.finish(data)))
