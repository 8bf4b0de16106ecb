"""The ext_proc handler's read of Envoy's next message when Envoy drops the stream.

An engine killed mid-stream makes Envoy reset the response and cancel the gRPC
call while the handler waits, with a silence limit, for the next message. The
read left behind must not end as an exception nobody retrieves (asyncio logs
``Task exception was never retrieved`` for it).
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from sidecar.handlers.extproc import _SILENT, _next


class Messages:
    """Envoy's message stream: blocks until ``end`` is set, then ends."""

    def __init__(self, ignores_cancel: bool) -> None:
        self.end = asyncio.Event()
        self.ignores_cancel = ignores_cancel

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            await self.end.wait()
        except asyncio.CancelledError:
            if not self.ignores_cancel:
                raise
        raise StopAsyncIteration


def unretrieved(ignores_cancel: bool) -> list[str]:
    seen: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx["message"]))
        messages = Messages(ignores_cancel)
        handler = asyncio.create_task(_next(messages, timeout=30.0))
        await asyncio.sleep(0.01)
        handler.cancel()  # gRPC cancels Process: Envoy dropped the stream
        with pytest.raises(asyncio.CancelledError):
            await handler
        messages.end.set()  # the stream's end reaches the read left behind
        for _ in range(5):
            await asyncio.sleep(0)
        del handler, messages
        gc.collect()

    asyncio.run(main())
    gc.collect()
    return seen


@pytest.mark.parametrize("ignores_cancel", [False, True])
def test_a_cancelled_read_leaves_no_unretrieved_exception(ignores_cancel):
    assert not [m for m in unretrieved(ignores_cancel) if "never retrieved" in m]


def test_a_silent_stream_and_its_end_are_still_told_apart():
    async def main():
        silent = Messages(ignores_cancel=False)
        assert await _next(silent, timeout=0.01) is _SILENT
        ended = Messages(ignores_cancel=False)
        ended.end.set()
        assert await _next(ended, timeout=5.0) is None

    asyncio.run(main())
