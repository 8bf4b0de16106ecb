"""Bodies whose JSON would take the event loop seconds to build are refused
before they are parsed, at a bounded rate; the rest are read as before."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sidecar.payload.json_budget import MAX_MEMBERS, MAX_VALUES, REFUSED_BYTES_PER_SECOND, Budget

from .test_bad_input import check_error


def members(n: int, spaced: bool = False) -> bytes:
    sep = b'" :' if spaced else b'":'
    return b'{"model":"m","messages":[],' + b",".join(b'"k%x' % i + sep + b"1" for i in range(n)) + b"}"


def judge(*bodies: bytes) -> list[str | None]:
    budget = Budget()

    async def run() -> list[str | None]:
        return [await budget.excess(b) for b in bodies]

    try:
        return asyncio.run(run())
    finally:
        budget.close()


def test_bodies_are_judged_by_what_their_parse_would_build():
    colons = b'{"model":"m","messages":[{"role":"user","content":"' + b"12:30:45 " * (MAX_MEMBERS // 2) + b'"}]}'
    embedded = b'{"model":"m","x":"' + b'{\\"a\\":1,' * (MAX_MEMBERS + 10) + b'"}'
    empty_arrays = b'{"model":"m","x":[' + b",".join([b"[]"] * (MAX_VALUES // 2)) + b"]}"
    too_many = f"more than {MAX_MEMBERS} JSON object members"
    assert judge(
        members(100),
        members(MAX_MEMBERS + 1),  # counted exactly, off the loop
        members(MAX_MEMBERS + 1, spaced=True),
        colons,  # colons in text: counted exactly, and within
        embedded,  # keys inside a string are text
        empty_arrays,  # one member, but a million values
        b'{"model":"m","x":"' + b"[" * (2 * MAX_VALUES) + b'"}',  # brackets in text
        b"--boundary\r\n" + b":" * (MAX_MEMBERS + 1),  # not JSON at all
    ) == [None, too_many, too_many, None, None, f"more than {MAX_VALUES} JSON values", None, None]


def test_refusals_are_held_one_at_a_time_for_their_size():
    holds: list[tuple[str, float]] = []
    release = asyncio.Event()

    async def hold(seconds: float) -> None:
        holds.append(("start", seconds))
        await release.wait()
        holds.append(("end", seconds))

    budget = Budget(hold=hold)

    async def run() -> None:
        tasks = [asyncio.create_task(budget.hold(size)) for size in (1000, 3000)]
        deadline = time.monotonic() + 60
        # Until the second refusal waits for the first's hold to end (or starts its own).
        while len(holds) < 2 and not budget._refusals._waiters:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, holds
            await asyncio.sleep(0.01)
        assert holds == [("start", 1000 / REFUSED_BYTES_PER_SECOND)], holds
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert holds == [("start", 1000 / REFUSED_BYTES_PER_SECOND), ("end", 1000 / REFUSED_BYTES_PER_SECOND),
                     ("start", 3000 / REFUSED_BYTES_PER_SECOND), ("end", 3000 / REFUSED_BYTES_PER_SECOND)]


def test_a_refusal_is_held_no_longer_than_its_patience():
    async def forever(seconds: float) -> None:
        await asyncio.Event().wait()

    budget = Budget(hold=forever)

    async def run() -> None:
        await asyncio.wait_for(budget.hold(10**9, patience=0.05), 60)

    asyncio.run(run())  # returns: the hold gave up at its patience


@pytest.mark.integration
def test_a_body_of_too_many_members_is_refused_in_the_family_shape(stack_factory):
    stack = stack_factory('backends: [{name: pool, url: "demo://", models: [m]}]\n')
    for path, family in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        r = httpx.post(stack.url + path, content=members(MAX_MEMBERS + 1),
                       headers={"content-type": "application/json"}, timeout=60)
        doc = check_error(r.status_code, r.headers, r.content, family)
        assert r.status_code == 400 and "object members" in doc["error"]["message"], doc
    r = httpx.post(stack.url + "/v1/chat/completions", content=b'{"model":"m","x":[' + b",".join([b"[]"] * MAX_VALUES) + b"]}",
                   headers={"content-type": "application/json"}, timeout=60)
    doc = check_error(r.status_code, r.headers, r.content, "openai")
    assert r.status_code == 400 and f"more than {MAX_VALUES} JSON values" in doc["error"]["message"], doc
    ok = httpx.post(stack.url + "/v1/chat/completions", content=members(1000),
                    headers={"content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_body_no_longer_than_either_bound_is_within_and_one_byte_more_is_counted():
    members_bound, values_bound = Budget(max_members=10, max_values=1000), Budget(max_members=1000, max_values=20)

    async def run() -> list[str | None]:
        return [await members_bound.excess(b"{" + b":" * 9), await members_bound.excess(b"{" + b":" * 10),
                await values_bound.excess(b"[" * 19), await values_bound.excess(b"[" * 20)]

    try:  # 10 and 11 bytes: 9 and 10 members; 19 and 20 bytes: 20 and 21 values
        assert asyncio.run(run()) == [None, None, None, "more than 20 JSON values"]
        assert asyncio.run(members_bound.excess(b"{" + b":" * 11)) == "more than 10 JSON object members"
    finally:
        members_bound.close()
        values_bound.close()
