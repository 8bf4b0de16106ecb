"""Bodies whose JSON would take the event loop seconds to build are refused
before they are parsed; the rest are read as before."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sidecar.payload.json_budget import MAX_MEMBERS, Budget, count_members

from .test_bad_input import check_error


def members(n: int, spaced: bool = False) -> bytes:
    sep = b'" :' if spaced else b'":'
    return b'{"model":"m","messages":[],' + b",".join(b'"k%x' % i + sep + b"1" for i in range(n)) + b"}"


def judge(*bodies: bytes) -> list[bool]:
    budget = Budget()

    async def run() -> list[bool]:
        return [await budget.within(b) for b in bodies]

    try:
        return asyncio.run(run())
    finally:
        budget.close()


def test_bodies_are_judged_by_their_object_members():
    colons = b'{"model":"m","messages":[{"role":"user","content":"' + b"12:30:45 " * (MAX_MEMBERS // 2) + b'"}]}'
    embedded = b'{"model":"m","x":"' + b'{\\"a\\":1,' * (MAX_MEMBERS + 10) + b'"}'
    assert judge(
        members(100),
        members(MAX_MEMBERS + 1),  # counted exactly, off the loop
        members(MAX_MEMBERS + 1, spaced=True),
        colons,  # colons in text: counted exactly, and within
        embedded,  # keys inside a string are text
        b"--boundary\r\n" + b":" * (MAX_MEMBERS + 1),  # not JSON at all
    ) == [True, False, False, True, True, True]


def test_the_exact_count_covers_every_depth():
    assert count_members(b'{"a": {"b": [1, {"c": 2, "d": 3}]}, "e": []}') == 5
    assert count_members(b"not json") == 0


@pytest.mark.integration
def test_a_body_of_too_many_members_is_refused_in_the_family_shape(stack_factory):
    stack = stack_factory('backends: [{name: pool, url: "demo://", models: [m]}]\n')
    for path, family in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        r = httpx.post(stack.url + path, content=members(MAX_MEMBERS + 1),
                       headers={"content-type": "application/json"}, timeout=60)
        doc = check_error(r.status_code, r.headers, r.content, family)
        assert r.status_code == 400 and "object members" in doc["error"]["message"], doc
    ok = httpx.post(stack.url + "/v1/chat/completions", content=members(1000),
                    headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200, ok.text
