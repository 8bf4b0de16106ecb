"""The names that cross Envoy: what the router and its Envoy configuration must
spell the same way.

- Dynamic metadata namespaces: the decision the sidecar writes on a request
  (read back by the response stream, the access log and the generated Envoy
  config), the usage the response stream reports, Envoy's own replies and the
  rate-limit descriptors.
- Header names the router owns on requests and responses.
- The health-check timings Envoy uses for the sidecar's endpoints, which the
  serving process matches when it drains.
"""

from __future__ import annotations

# Dynamic metadata namespaces.
NAMESPACE = "model_router"  # the decision; also the rate-limit filter's and Envoy's own replies'
USAGE_NAMESPACE = "model_router_usage"  # what the response stream measured
REPLY_NAMESPACE = NAMESPACE

# Request headers in these namespaces belong to the router: Envoy drops any
# client copy before the first filter, so none reaches the sidecar or a backend...
ROUTER_HEADER_PREFIXES = ("x-model-router-", "x-continuum-")
# ...except these, which an operator sends to ask for a request's decision
# trace: they reach the sidecar, which acts on them only with the admin
# token, and never a backend.
EXPLAIN_HEADER = "x-model-router-explain"
ADMIN_TOKEN_HEADER = "x-model-router-admin-token"
CLIENT_ROUTER_HEADERS = (EXPLAIN_HEADER, ADMIN_TOKEN_HEADER)
BACKEND_HEADER = "x-model-router-backend"
CACHE_HEADER = "x-model-router-cache"  # hit | miss | bypass, on answers the response cache could serve
RESPONSE_HEADER = "x-model-router-response"  # asks Envoy's upstream filter to open a response stream
SHADOW_HEADER = "x-model-router-shadow"  # the shadow cluster Envoy mirrors this request to
ATTEMPT_HEADER = "x-envoy-attempt-count"  # Envoy's count of tries on one request (fallback hops)
# Response headers the router sets on a request; upstream copies are dropped.
ATTRIBUTION_HEADERS = (
    "x-continuum-experiment", "x-continuum-experiment-variant",
    "x-continuum-model-variant", "x-continuum-model-variant-applied", "x-continuum-fallback-model",
    EXPLAIN_HEADER, CACHE_HEADER,
)

# gRPC metadata on the decision filter's streams: the longest Envoy waits for
# one answer when the sidecar asks for more time (its ``max_message_timeout``,
# in ms). Envoy Gateway cannot set that limit, and its streams carry no such
# entry: there the sidecar never keeps Envoy past ``message_timeout``.
MAX_WAIT_METADATA = "x-model-router-max-wait-ms"

# How often Envoy asks each sidecar endpoint whether it serves; a draining
# worker waits a little longer than this before it stops taking streams.
HEALTH_INTERVAL_S = 1
HEALTH_FAILURES = 2  # answers missed or NOT_SERVING before Envoy stops sending streams
