"""The ``limits:`` section as the request path reads it: each model's rules,
built once per config.

A rule's id names it in Envoy's rate-limit descriptors, in the decision's
metadata (which budgets a request's tokens are charged to) and in Redis keys.
Key ids cannot contain ``/`` and ``*`` is no key id, so ``<key id or *>/<model>``
is unambiguous for any model name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .schema import Config, Limit

# The request headers the sidecar sets for Envoy's rate-limit filter (stripped
# before the upstream, and from clients by the router-namespace rule).
MODEL_HEADER = "x-model-router-limit-model"
KEY_HEADER = "x-model-router-limit-key"
# The same for rates counted by the rate-limit service (``shared``).
SHARED_MODEL_HEADER = "x-model-router-limit-shared-model"
SHARED_KEY_HEADER = "x-model-router-limit-shared-key"
RATE_LIMIT_DOMAIN = "model_router"
# The descriptor entries Envoy builds from them.
MODEL_ENTRY = "model_router_model"
KEY_ENTRY = "model_router_key_id"


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    model: str
    key_id: str | None  # None: every caller of the model together
    rate: tuple[int, int] | None  # (requests, per seconds)
    burst: int  # the request bucket's size (0 without a rate)
    tokens: int | None  # prompt + completion tokens per window
    window_s: int  # the token window; windows start at multiples of it since the epoch (a day: UTC midnight)
    shared: bool = False  # the rate is counted by the rate-limit service, in Redis


def rule_of(lim: Limit) -> Rule:
    rate = lim.rate
    return Rule(
        id=f"{lim.key_id or '*'}/{lim.model}", model=lim.model, key_id=lim.key_id, rate=rate,
        burst=lim.burst or (rate[0] if rate else 0), tokens=lim.tokens, window_s=lim.token_window,
        shared=lim.shared,
    )


def index(config: Config) -> Mapping[str, tuple[Rule, ...]]:
    """model -> its rules, the model-wide one first."""
    by_model: dict[str, list[Rule]] = {}
    for lim in config.limits:
        by_model.setdefault(lim.model, []).append(rule_of(lim))
    return MappingProxyType({m: tuple(sorted(rs, key=lambda r: r.key_id is not None)) for m, rs in by_model.items()})
