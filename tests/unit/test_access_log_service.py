"""The access-log service accounts a batch a few entries at a time and lets
the event loop run in between: a decision waiting on the loop is not held up
behind a whole batch's accounting."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2

from sidecar.accounting import metering
from sidecar.accounting.entries import Entry
from sidecar.accounting.metering import AccessLogService, Meter

from .test_access_log_golden import batch


class Messages:
    """A stream context whose ``read`` gives ``messages``, then the end."""

    def __init__(self, *messages: als_pb2.StreamAccessLogsMessage) -> None:
        self._left = list(messages)

    async def read(self) -> Any:
        return self._left.pop(0) if self._left else grpc.aio.EOF


class Seen:
    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def observe(self, entry: Entry) -> None:
        self.entries.append(entry)


def test_a_batch_is_accounted_in_steps_with_the_loop_turning_between():
    message = als_pb2.StreamAccessLogsMessage.FromString(batch())
    total = len(message.http_logs.log_entry)
    assert total > 2 * metering.STEP  # (several steps to see)
    seen = Seen()
    service = AccessLogService(Meter(lambda backend, status: None, observers=(seen,)))

    async def main() -> list[int]:
        stream = asyncio.create_task(service.StreamAccessLogs(None, Messages(message)))
        counts = []  # entries accounted each time another task got the loop
        while not stream.done():
            counts.append(len(seen.entries))
            await asyncio.sleep(0)
        await stream
        return counts

    counts = asyncio.run(main())
    assert len(seen.entries) == total  # every entry, once
    steps = sorted(set(counts) | {total})
    assert steps[0] == 0 and len(steps) > 2  # the loop turned while the batch was being accounted
    assert max(b - a for a, b in zip(steps, steps[1:])) <= metering.STEP


def test_a_step_that_fails_loses_neither_the_stream_nor_the_later_steps():
    message = als_pb2.StreamAccessLogsMessage.FromString(batch())
    total = len(message.http_logs.log_entry)
    seen = Seen()
    meter = Meter(lambda backend, status: None, observers=(seen,))
    record = meter.record
    calls = 0

    def failing_first(entries: Any, batch: Any = None) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a step that cannot be accounted")
        record(entries, batch)

    meter.record = failing_first  # type: ignore[method-assign]
    service = AccessLogService(meter)
    reply = asyncio.run(service.StreamAccessLogs(None, Messages(message, message)))
    assert isinstance(reply, als_pb2.StreamAccessLogsResponse)
    assert len(seen.entries) == 2 * total - metering.STEP  # only the first step of the first message is lost


class Arriving:
    """A stream context whose messages arrive when the test says, or on a schedule."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    async def read(self) -> Any:
        return await self.queue.get()


def _observed_service() -> tuple[als_pb2.StreamAccessLogsMessage, int, Seen, AccessLogService]:
    """A batch, its entry count, and a service whose observer sees what it accounts."""
    message = als_pb2.StreamAccessLogsMessage.FromString(batch())
    seen = Seen()
    return message, len(message.http_logs.log_entry), seen, AccessLogService(
        Meter(lambda backend, status: None, observers=(seen,)))


def test_closing_ends_a_busy_stream_after_its_next_batch():
    """Under steady load a stream is never quiet: closing ends it after its
    next batch, not once the load stops."""
    message, total, seen, service = _observed_service()

    async def main() -> int:
        context = Arriving()
        stream = asyncio.create_task(service.StreamAccessLogs(None, context))

        async def steady() -> None:  # a batch every 20 ms, well inside the linger
            while True:
                context.queue.put_nowait(message)
                await asyncio.sleep(0.02)

        feeder = asyncio.create_task(steady())
        while len(seen.entries) < 3 * total:
            await asyncio.sleep(0.01)
        service.close(linger=1.0)
        try:
            await asyncio.wait_for(stream, timeout=5)  # not until the load stops
        finally:
            feeder.cancel()
        return len(seen.entries)

    accounted = asyncio.run(main())
    assert accounted % total == 0  # whole batches only: none cut short


def test_a_batch_arriving_while_closing_is_accounted_and_the_stream_ends_with_it():
    message, total, seen, service = _observed_service()

    async def main() -> None:
        context = Arriving()
        stream = asyncio.create_task(service.StreamAccessLogs(None, context))
        await asyncio.sleep(0.05)  # the stream waits for its next batch
        service.close(linger=30.0)
        await asyncio.sleep(0.05)
        context.queue.put_nowait(message)
        await asyncio.wait_for(stream, timeout=5)  # not the 30 s of quiet

    asyncio.run(main())
    assert len(seen.entries) == total


def test_a_quiet_stream_ends_after_the_linger_once_closing():
    service = AccessLogService(Meter(lambda backend, status: None))

    async def main() -> None:
        stream = asyncio.create_task(service.StreamAccessLogs(None, Arriving()))
        await asyncio.sleep(0.05)
        service.close(linger=0.2)
        await asyncio.wait_for(stream, timeout=5)

    asyncio.run(main())
