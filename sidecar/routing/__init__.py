"""The request path's decisions, pure and free of gRPC: who calls, which model
and arm, which backend, and what the answer must carry."""

from .affinity import follow_up
from .choose import fallback_hops
from .context import Caller, Request, authenticate, presented_key
from .decide import decide
from .passthrough import passthrough
from .reservation import reserved_by
from .route import Fallback, ResponsePlan, Route, upstream_auth
from .selection import admissible

__all__ = [
    "Caller", "Fallback", "Request", "ResponsePlan", "Route", "admissible", "authenticate", "decide",
    "fallback_hops", "follow_up", "passthrough", "presented_key", "reserved_by", "upstream_auth",
]
