"""Envoy's global rate-limit service (``envoy.service.ratelimit.v3``), served
by the sidecar and counted in Redis: the request rates of ``shared`` limits,
one count for every Envoy and sidecar replica.

Envoy's ``envoy.filters.http.ratelimit`` filter asks it about a request whose
decision named a shared limit (the ``x-model-router-limit-shared-*`` headers);
other requests never reach it. Each rate counts in fixed windows of its
period (a second or a minute), one Redis key per rule and window. A Redis
error answers OK: a limit never fails a request because Redis is away
(``model_router_redis_errors_total{feature="ratelimit"}`` counts it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2

from ..config.limits import KEY_ENTRY, MODEL_ENTRY, RATE_LIMIT_DOMAIN, Rule
from ..routing.snapshot import Snapshot
from ..stores import shared_store

log = logging.getLogger("model_router.ratelimit")

_R = rls_pb2.RateLimitResponse
_UNIT = {1: _R.RateLimit.SECOND, 60: _R.RateLimit.MINUTE}


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self, snapshot: Callable[[], Snapshot], clock: Callable[[], float] = time.time) -> None:
        self.snapshot = snapshot
        self.clock = clock

    async def ShouldRateLimit(self, request: rls_pb2.RateLimitRequest, context: object) -> rls_pb2.RateLimitResponse:
        snap = self.snapshot()
        rules = {(r.model, r.key_id): r for rs in snap.limits.values() for r in rs if r.shared and r.rate}
        matched: list[Rule | None] = []
        for d in request.descriptors:
            entries = {e.key: e.value for e in d.entries}
            matched.append(rules.get((entries.get(MODEL_ENTRY, ""), entries.get(KEY_ENTRY))))
        settings = snap.config.redis
        if request.domain != RATE_LIMIT_DOMAIN or settings is None or not any(matched):
            return _R(overall_code=_R.OK, statuses=[_R.DescriptorStatus(code=_R.OK) for _ in matched])
        now = self.clock()
        hits = request.hits_addend or 1
        try:
            pipe = shared_store.client(settings).pipeline(transaction=False)
            for rule in matched:
                if rule is not None and rule.rate is not None:
                    per = rule.rate[1]
                    k = shared_store.key(settings, "rate", rule.id, str(int(now // per)))
                    pipe.incrby(k, hits)
                    pipe.expire(k, per + 5)
            counts = iter((await pipe.execute())[::2])
        except Exception as exc:
            shared_store.REDIS_ERRORS.labels("ratelimit").inc()
            log.debug("ratelimit: redis failed: %s", exc)
            return _R(overall_code=_R.OK, statuses=[_R.DescriptorStatus(code=_R.OK) for _ in matched])
        statuses = []
        for rule in matched:
            if rule is None or rule.rate is None:
                statuses.append(_R.DescriptorStatus(code=_R.OK))
                continue
            count = int(next(counts))
            limit, per = rule.rate
            reset = (int(now // per) + 1) * per - now
            statuses.append(_R.DescriptorStatus(
                code=_R.OVER_LIMIT if count > limit else _R.OK,
                current_limit=_R.RateLimit(requests_per_unit=limit, unit=_UNIT[per]),
                limit_remaining=max(0, limit - count),
                duration_until_reset=duration_pb2.Duration(seconds=int(reset), nanos=int((reset % 1) * 1e9)),
            ))
        over = any(s.code == _R.OVER_LIMIT for s in statuses)
        return _R(overall_code=_R.OVER_LIMIT if over else _R.OK, statuses=statuses)
