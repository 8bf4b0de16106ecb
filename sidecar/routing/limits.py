"""The limits stage: which of the configured limits a request falls under,
and whether a spent token budget refuses it. Pure: the budgets' state comes
in with the request.

A limit keys on the client-facing model the key gate judges (after
``model_aliases``; for a suffixed name, its base id; a name served literally
keeps its own). Request rates are Envoy's to enforce: the stage only names
the descriptor (model, and key id when a rule is the key's own). Token
budgets are enforced here, from the counters the access log fills.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .. import errors
from ..config.limits import KEY_HEADER, MODEL_HEADER, SHARED_KEY_HEADER, SHARED_MODEL_HEADER, Rule
from ..decision import Decision, Fields, encode
from ..errors import Reply
from .route import Meta
from .snapshot import Snapshot

# rule id -> (window index, tokens spent in that window), as the budget counters last saw it
Spent = Mapping[str, tuple[int, int]]
# Output tokens assumed for a request that sets no cap of its own (max_tokens,
# max_completion_tokens, max_output_tokens).
DEFAULT_OUTPUT_ESTIMATE = 1024
_OUTPUT_CAPS = ("max_output_tokens", "max_completion_tokens", "max_tokens")
_MAX_CHOICES = 128
MAX_OUTPUT_ESTIMATE = 1 << 20  # a cap a client may write is no measure of what it used


def estimate(body: bytes, data: Mapping[str, Any] | None) -> tuple[int, int]:
    """What a request may cost before its usage is known: (prompt, completion).

    The prompt is taken as one token per four bytes of the body; the
    completion as the request's own output cap (times ``n``), or
    :data:`DEFAULT_OUTPUT_ESTIMATE` without one. It is what a budget
    reserves up front, and what a request whose usage never arrives (a stream
    cut before its usage event, a background create) is charged.
    """
    prompt = -(-len(body) // 4)
    cap = DEFAULT_OUTPUT_ESTIMATE
    choices = 1
    if data is not None:
        for name in _OUTPUT_CAPS:
            v = data.get(name)
            if type(v) is int and v > 0:  # (not a bool, nor another subclass)
                cap = v
                break
        n = data.get("n")
        if type(n) is int and 1 <= n <= _MAX_CHOICES:
            choices = n
    return prompt, min(cap * choices, MAX_OUTPUT_ESTIMATE)


@dataclass(frozen=True, slots=True)
class BudgetState:
    rule: Rule
    spent: int
    reset_at: float  # unix time the window ends

    @property
    def remaining(self) -> int:
        return max(0, (self.rule.tokens or 0) - self.spent)


@dataclass(frozen=True, slots=True)
class LimitPlan:
    """What a routed request carries for its limits."""

    model: str
    headers: tuple[tuple[str, str], ...]  # request headers Envoy's rate-limit filter reads
    budgets: tuple[str, ...]  # rule ids this request's tokens are charged to
    tightest: BudgetState | None  # the budget with the fewest tokens left
    now: float
    request_limit: int | None = None  # the smallest request allowance among the rates that apply
    reserve: int = 0  # tokens held on each budget from the decision until the request's entry settles them

    def decision(self) -> Decision:
        return Decision.of(self.fields())

    def fields(self) -> Fields:
        """:meth:`decision`'s keyword arguments."""
        m: Fields = {"limit_model": self.model}
        if self.request_limit is not None:
            # Envoy counts; these complete its figures into OpenAI's header values.
            m.update({"x_rl_unit": "s", "x_rl_limit": str(self.request_limit)})
        if self.budgets:
            m["budgets"] = self.budgets
            m["reserved"] = (self.reserve, self.now)  # the amount, and the time whose windows hold it
        if self.tightest is not None:
            m.update(token_headers(self.tightest, self.now))
        return m

    def metadata(self) -> Meta:
        """:meth:`decision`, encoded."""
        return encode(self.fields())


def applicable(snap: Snapshot, model: str, key_id: str | None) -> tuple[Rule, ...]:
    """The model-wide limit and the key's own, when configured."""
    return tuple(r for r in snap.limits.get(model, ()) if r.key_id is None or r.key_id == key_id)


def window_of(rule: Rule, now: float) -> int:
    return int(now // rule.window_s)


def budget_state(rule: Rule, spent: Spent, now: float) -> BudgetState:
    window = window_of(rule, now)
    seen = spent.get(rule.id)
    used = seen[1] if seen is not None and seen[0] == window else 0
    return BudgetState(rule, used, (window + 1) * rule.window_s)


def plan(rules: tuple[Rule, ...], model: str, key_id: str | None, spent: Spent, now: float,
         cost: int = 0) -> LimitPlan | BudgetState:
    """The plan for a request under ``rules`` that may cost ``cost`` tokens
    (what its budgets reserve, at most the largest of them), or the spent
    budget that refuses it."""
    headers: list[tuple[str, str]] = []
    for shared, model_header, key_header in ((False, MODEL_HEADER, KEY_HEADER),
                                             (True, SHARED_MODEL_HEADER, SHARED_KEY_HEADER)):
        rated = [r for r in rules if r.rate is not None and r.shared == shared]
        if rated:
            headers.append((model_header, model))
            if key_id is not None and any(r.key_id == key_id for r in rated):
                headers.append((key_header, key_id))
    states = [budget_state(r, spent, now) for r in rules if r.tokens is not None]
    for s in states:
        if s.remaining <= 0:
            return s
    tightest = min(states, key=lambda s: s.remaining) if states else None
    # A local bucket allows its burst at once; a shared window its rate.
    allowances = [r.rate[0] if r.shared else r.burst for r in rules if r.rate is not None]
    reserve = min(cost, max(s.rule.tokens or 0 for s in states)) if states else 0
    return LimitPlan(model, tuple(headers), tuple(s.rule.id for s in states), tightest, now,
                     min(allowances) if allowances else None, reserve)


def reservation(decision: Decision | Mapping[str, Any]) -> tuple[int, float] | None:
    """A decision's reservation (tokens, the time whose windows hold it), read
    back from its metadata; None when it reserved nothing."""
    return (decision if isinstance(decision, Decision) else Decision.decode(decision)).reserved


def duration(seconds: float) -> str:
    """A span as OpenAI's rate-limit headers write it: ``20ms``, ``59s``, ``6m0s``, ``1h0m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    return f"{m}m{s}s" if m else f"{s}s"


def token_headers(state: BudgetState, now: float) -> Fields:
    return {
        "x_ratelimit_limit_tokens": str(state.rule.tokens),
        "x_ratelimit_remaining_tokens": str(state.remaining),
        "x_ratelimit_reset_tokens": duration(state.reset_at - now),
    }


def _window_words(seconds: int) -> str:
    if seconds == 86400:
        return "day (UTC)"
    return duration(seconds)


def refusal(state: BudgetState, model: str, family: str, now: float) -> Reply:
    """429 in the ingress's shape: which model, which budget, when it resets."""
    rule = state.rule
    reset = datetime.fromtimestamp(state.reset_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    whose = "this API key's token budget" if rule.key_id is not None else "the token budget"
    reply = errors.error(
        "rate_limited",
        f"Rate limit reached for the model '{model}': {whose} of {rule.tokens} tokens per "
        f"{_window_words(rule.window_s)} is spent. It resets at {reset} (in {duration(state.reset_at - now)}).",
        family,
        param="model",
    )
    headers = (
        ("retry-after", str(max(1, math.ceil(state.reset_at - now)))),
        *((k.replace("_", "-"), str(v)) for k, v in encode(token_headers(state, now)).items()),
    )
    return Reply(reply.status, reply.body, headers,
                 meta=Decision(limit_refused="tokens", limit_model=model, client_model=model))
