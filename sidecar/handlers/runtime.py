"""What the handlers read from the serving process, as a protocol.

``serve.runtime.Runtime`` provides it; a unit test can hand the handlers any
object with these members and drive them without a server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import aiohttp

    from ..accounting.budgets import Budgets
    from ..accounting.metering import Sink
    from ..routing.selection import BackendView
    from ..routing.snapshot import Snapshot


class HandlerRuntime(Protocol):
    """The current config, the monitor's view and the process-wide services a request uses."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def budgets(self) -> Budgets: ...

    def backend_states(self) -> Mapping[str, BackendView]: ...

    def count_request(self) -> None: ...

    def report_response(self, backend: str, status: int | None) -> None: ...

    def http_session(self) -> aiohttp.ClientSession: ...

    def usage_sink(self) -> Sink | None: ...

    def exports_traces(self) -> bool:
        """Whether spans are exported; the answer changes only with the snapshot's config."""
        ...
