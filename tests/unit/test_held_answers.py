"""A request whose final answer comes after a long wait gets Envoy's
permission to wait first.

Envoy waits ``message_timeout`` for each answer unless the sidecar sends
``override_message_timeout`` (within the filter's ``max_message_timeout``,
which the decision filter names in the stream's gRPC metadata). A refusal the
JSON budget holds, and an ``:online`` search, can take longer than that: the
permission must reach Envoy before the wait starts, not with the answer.
"""

from __future__ import annotations

import asyncio

import orjson

from sidecar.config.schema import parse
from sidecar.contract import MAX_WAIT_METADATA
from sidecar.handlers.extproc import Processor
from sidecar.payload.json_budget import HOLD_PATIENCE_S
from sidecar.routing import snapshot

from .test_dispatch import KEYED, Runtime, _messages, _stream


class HeldBudget:
    """A JSON budget that finds every body too big and notes when it holds a refusal."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        self.events = events

    async def excess(self, body: bytes) -> str | None:
        return "more than 3 JSON object members"

    async def hold(self, size: int, patience: float) -> None:
        self.events.append(("hold", patience))

    def close(self) -> None:
        pass


class Context:
    """The gRPC call's context as the handler reads it."""

    def __init__(self, max_wait_ms: int | None) -> None:
        self.metadata = [] if max_wait_ms is None else [(MAX_WAIT_METADATA, str(max_wait_ms))]

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata


def held(max_wait_ms: int | None) -> list[tuple[str, object]]:
    """What happened, in order: each answer as it left the handler, and the hold."""
    snap = snapshot.build(parse(KEYED, env={}).config)
    processor = Processor(Runtime(snap))
    events: list[tuple[str, object]] = []
    processor.requests.json_budget = HeldBudget(events)  # type: ignore[assignment]
    body = orjson.dumps({"model": "m", "messages": [], "a": 1, "b": 2})
    messages = _messages("POST", "/v1/chat/completions", {"authorization": "Bearer sk-all"}, body)

    async def run() -> None:
        async for answer in processor.Process(_stream(messages), Context(max_wait_ms)):
            if answer.HasField("override_message_timeout"):
                events.append(("wait longer", answer.override_message_timeout.seconds))
            elif answer.HasField("immediate_response"):
                events.append(("refused", answer.immediate_response.status.code))
            else:
                events.append(("answer", answer.WhichOneof("response")))

    asyncio.run(run())
    return events


def test_a_held_refusal_asks_envoy_to_wait_before_it_is_held():
    assert held(max_wait_ms=120_000) == [
        ("answer", "request_headers"),
        ("wait longer", int(HOLD_PATIENCE_S) + 5),
        ("hold", HOLD_PATIENCE_S),
        ("refused", 400),
    ]


def test_without_a_longer_wait_allowed_the_refusal_is_held_within_the_message_timeout():
    events = held(max_wait_ms=None)
    assert [e[0] for e in events] == ["answer", "hold", "refused"]
    patience = events[1][1]
    assert isinstance(patience, float) and 0 < patience <= 5000 / 2000  # half the default message timeout
