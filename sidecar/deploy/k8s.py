"""Kubernetes manifests for a config: the sidecar and the routes to its backends.

``model-router k8s --config FILE`` writes them. The routes come from the same
table as the Envoy bootstrap's header-match routes
(:func:`sidecar.deploy.envoy.backend_routes`), so a backend added to the config
and the route that reaches it cannot drift apart. The gateway recipes (Istio,
Envoy Gateway) are in :mod:`sidecar.deploy.k8s_gateways`. Nothing here is on the
request path.

Files (each a list of documents):

- ``sidecar.yaml``: the config as a Secret (it may carry keys), the sidecar
  Deployment, its Service and PodDisruptionBudget, and a Deployment and
  Service per ``demo://`` backend;
- ``monitoring.yaml``: the ServiceMonitor and PrometheusRule
  (:mod:`sidecar.deploy.k8s_monitoring`);
- ``routes.yaml``: the HTTPRoute (one rule per backend matching the routing
  header, then a catch-all rule with no backend) and an ExternalName Service
  per backend outside the cluster;
- ``istio.yaml`` and ``envoy-gateway.yaml``: see :mod:`sidecar.deploy.k8s_gateways`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..config import address
from ..config.schema import DEFAULT_RETIRE_AFTER, Config
from ..contract import RESPONSE_HEADER
from ..routing.snapshot import BACKEND_HEADER
from . import k8s_access
from .envoy import backend_routes

GRPC_PORT = 50051
ADMIN_PORT = 9190
DEMO_PORT = 8000
CONFIG_DIR = "/etc/model-router"
DATA_DIR = "/var/lib/model-router"  # writable (an emptyDir): usage records may go here
LABEL = "app.kubernetes.io/name"
# Seconds a terminating pod keeps serving before the sidecar drains: longer
# than the gateways take to drop the endpoint (EDS push) and than the
# readiness probe's period times its failure threshold (2 s x 2).
PRE_STOP_S = 10


class K8sError(ValueError):
    """A config the manifests cannot express (the message names the field)."""


@dataclass(frozen=True)
class Options:
    namespace: str = "model-router"
    name: str = "model-router"
    image: str = "model-router:0.1.0"
    replicas: int = 2
    gateway: str = "model-router"  # the Gateway the HTTPRoute attaches to (parentRef)
    gateway_namespace: str | None = None  # default: the router's namespace
    backend_urls: dict[str, str] = field(default_factory=dict)  # replaces backend URLs, as envoy-config does
    monitoring_namespace: str = "monitoring"  # may scrape the admin port (NetworkPolicy)


@dataclass(frozen=True)
class BackendRef:
    """Where a backend lives, as a Service a route can name."""

    backend: str
    service: str
    namespace: str | None  # None: the router's namespace
    port: int
    host: str  # the host the backend expects (external backends only differ from the Service)
    external: bool  # outside the cluster: reached through an ExternalName Service
    tls: bool
    demo: bool


_SERVICE_HOST = re.compile(r"^(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(\.(?P<ns>[a-z0-9-]+)\.svc(\.cluster\.local)?)?$")


def service_name(backend: str) -> str:
    """The ExternalName Service standing for an external backend."""
    return f"backend-{backend}"


def backend_ref(name: str, url: str) -> BackendRef:
    """A backend URL as a Service reference: ``http://NAME:PORT`` or
    ``http://NAME.NS.svc[.cluster.local]:PORT`` is a Service in the cluster;
    any other host name is external; ``demo://`` is a demo engine deployed
    beside the router."""
    if url == "demo://":
        return BackendRef(name, name, None, DEMO_PORT, name, False, False, True)
    host, port, tls, _ = address.split_url(url)
    m = _SERVICE_HOST.match(host)
    if m:
        return BackendRef(name, m["name"], m["ns"], port, host, False, tls, False)
    if re.fullmatch(r"[\d.]+|\[?[0-9a-fA-F:]+\]?", host):
        raise K8sError(f"backends '{name}'.url: {host} is an IP address; give the backend a Service name "
                       "(--backend-url NAME=http://SERVICE:PORT)")
    return BackendRef(name, service_name(name), None, port, host, True, tls, False)


def backend_refs(config: Config, urls: dict[str, str]) -> dict[str, BackendRef]:
    return {b.name: backend_ref(b.name, urls.get(b.name, b.url)) for b in config.backends}


def _meta(name: str, opts: Options, component: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace,
            "labels": {LABEL: opts.name, "app.kubernetes.io/component": component}, **extra}


def _selector(opts: Options, component: str) -> dict[str, Any]:
    return {LABEL: opts.name, "app.kubernetes.io/component": component}


_SECURITY = {
    "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}


def _container(name: str, opts: Options, args: list[str], ports: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": opts.image, "imagePullPolicy": "IfNotPresent", "args": args, "ports": ports,
            "securityContext": _SECURITY, **extra}


def _sidecar(config: Config, config_text: str, opts: Options, refs: dict[str, BackendRef]) -> list[dict[str, Any]]:
    secret = f"{opts.name}-config"
    # One process on one port: at its bound it goes unready, drains and exits 0,
    # and the kubelet starts the container again (after its restart backoff), so
    # unless the config sets a bound the pod's is larger than the supervisor's.
    args = ["serve", "--config", f"{CONFIG_DIR}/config.yaml", "--workers", "1", "--no-supervisor",
            "--grpc-listen", f"0.0.0.0:{GRPC_PORT}", "--admin-listen", f"0.0.0.0:{ADMIN_PORT}"]
    if "max_requests_per_worker" not in config.server.model_fields_set:
        args += ["--max-requests-per-worker", str(DEFAULT_RETIRE_AFTER)]
    for r in refs.values():
        if r.demo:
            args += ["--backend-url", f"{r.backend}=http://{r.service}:{r.port}"]
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    container = _container(
        "sidecar", opts, args,
        [{"name": "grpc", "containerPort": GRPC_PORT}, {"name": "http-admin", "containerPort": ADMIN_PORT}],
        # Serving gRPC health before it takes traffic, ready (config loaded,
        # not draining) to stay in the Service, alive while /healthz answers.
        startupProbe={"grpc": {"port": GRPC_PORT}, "periodSeconds": 1, "failureThreshold": 60},
        readinessProbe={"httpGet": {"path": "/readyz", "port": "http-admin"}, "periodSeconds": 2, "failureThreshold": 2},
        livenessProbe={"httpGet": {"path": "/healthz", "port": "http-admin"}, "periodSeconds": 10, "failureThreshold": 3},
        resources={"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
        env=[{"name": "MODEL_ROUTER_LOG_LEVEL", "value": "INFO"}, *secret_env(config_text, opts)],
        lifecycle=_pre_stop(),
        volumeMounts=[{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                      {"name": "data", "mountPath": DATA_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
    )
    grpc_secret = k8s_access.wire(config, config_text, opts, container)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(opts.name, opts, "sidecar"),
        "spec": {
            "replicas": opts.replicas,
            "selector": {"matchLabels": _selector(opts, "sidecar")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                # A changed config rolls the pods (the sidecar also reloads a changed file).
                "metadata": {"labels": _selector(opts, "sidecar"), "annotations": {"model-router/config-sha256": digest}},
                "spec": {
                    "automountServiceAccountToken": False,
                    # In-flight streams finish within drain_timeout_s after SIGTERM.
                    "terminationGracePeriodSeconds": PRE_STOP_S + config.server.drain_timeout_s + 10,
                    "securityContext": {"runAsNonRoot": True, "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "config", "secret": {"secretName": secret}},
                                {"name": "data", "emptyDir": {}}, {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(opts.name, opts, "sidecar"),
        "spec": {"selector": _selector(opts, "sidecar"), "ports": [
            # h2c: Envoy Gateway and Istio speak HTTP/2 (gRPC) to this port.
            {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"},
            {"name": "http-admin", "port": ADMIN_PORT, "targetPort": "http-admin"},
        ]},
    }
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(secret, opts, "sidecar"), "type": "Opaque",
         "stringData": {"config.yaml": config_text}},
        deployment, service,
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(opts.name, opts, "sidecar"),
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(opts, "sidecar")}}},
        k8s_access.network_policy(opts, _selector(opts, "sidecar"), GRPC_PORT, ADMIN_PORT, opts.monitoring_namespace),
        *grpc_secret,
    ]


def env_secret(opts: Options) -> str:
    """The Secret (made by the operator) holding the config's ``${ENV}`` values."""
    return f"{opts.name}-env"


def env_references(config_text: str) -> dict[str, bool]:
    """Every ``${NAME}`` the config refers to, and whether it has a default."""
    from ..config.schema import _ENV_RE

    found: dict[str, bool] = {}
    for m in _ENV_RE.finditer(config_text):
        found[m.group(1)] = found.get(m.group(1), True) and m.group(2) is not None
    return found


def secret_env(config_text: str, opts: Options) -> list[dict[str, Any]]:
    """The pod's environment for the config's ``${ENV}`` references, each from
    the env Secret; a reference without a default is required (the pod waits
    for the Secret rather than start with a config it cannot load)."""
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": env_secret(opts), "key": name,
                                                          **({"optional": True} if default else {})}}}
            for name, default in sorted(env_references(config_text).items())]


def _pre_stop() -> dict[str, Any]:
    # Native sleep (Kubernetes >= 1.30): no shell in the image is needed.
    return {"preStop": {"sleep": {"seconds": PRE_STOP_S}}}


def refuse_unenforced(config: Config) -> None:
    """What a gateway's Envoy cannot do for this config is refused here, not
    left silently undone: rates and token budgets (Envoy's rate-limit filters
    and streamed usage are only in the product's bootstrap) and the response
    rename (its response processor rides on the bootstrap's upstream filter)."""
    for i, lim in enumerate(config.limits):
        if lim.requests_per_second or lim.requests_per_minute or lim.tokens:
            raise K8sError(f"limits[{i}]: request rates and token budgets are enforced by filters only the "
                           "product's own Envoy bootstrap has (model-router envoy-config); a gateway would "
                           "admit every request. Remove limits: for a gateway deployment")
    for e in config.model_experiments:
        if e.response_model == "client":
            raise K8sError(f"model_experiments '{e.name}'.response_model: client needs the response processor "
                           "only the product's own Envoy bootstrap has; a gateway would answer with the "
                           "upstream model. Use response_model: upstream")
        if e.shadows:
            raise K8sError(f"model_experiments '{e.name}'.variants: the shadow arm '{e.shadows[0].id}' needs the "
                           "shadow cluster and its upstream filter (which puts the arm's model in the copy) that "
                           "only the product's own Envoy bootstrap has; a gateway's RequestMirror would send the "
                           "live model. Remove the shadow arm for a gateway deployment")


def backend_tls_policies(opts: Options, refs: dict[str, BackendRef]) -> list[dict[str, Any]]:
    """Gateway API: TLS from the gateway to every ``https://`` backend,
    checked against the system's CAs for the backend's own host name."""
    return [{
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "BackendTLSPolicy",
        "metadata": _meta(r.service, opts, "backend", **({"namespace": r.namespace} if r.namespace else {})),
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": r.service}],
                 "validation": {"wellKnownCACertificates": "System", "hostname": r.host}},
    } for r in refs.values() if r.tls]


def _demo_engines(config: Config, opts: Options, refs: dict[str, BackendRef]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for b in config.backends:
        r = refs[b.name]
        if not r.demo:
            continue
        component = f"demo-{b.name}"
        args = ["demo-engine", "--host", "0.0.0.0", "--port", str(DEMO_PORT), "--name", b.name]
        for m in b.models or ["demo-model"]:
            args += ["--model", m]
        container = _container(
            "engine", opts, args, [{"name": "http", "containerPort": DEMO_PORT}],
            readinessProbe={"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
            resources={"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
            volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}],
        )
        out += [
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(r.service, opts, component),
             "spec": {"replicas": 1, "selector": {"matchLabels": _selector(opts, component)},
                      "template": {"metadata": {"labels": _selector(opts, component)}, "spec": {
                          "automountServiceAccountToken": False, "containers": [container],
                          "volumes": [{"name": "tmp", "emptyDir": {}}]}}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": _meta(r.service, opts, component),
             "spec": {"selector": _selector(opts, component),
                      "ports": [{"name": "http", "port": DEMO_PORT, "targetPort": "http"}]}},
        ]
    return out


def httproute(config: Config, opts: Options, refs: dict[str, BackendRef]) -> list[dict[str, Any]]:
    """One rule per backend: the routing header's value, exactly, to that
    backend's Service; the routing headers removed before the request goes
    upstream. The last rule (no header match) is the one a request takes
    before the sidecar has decided: the gateway runs the ext_proc filter on
    it, and a request still on it afterwards gets no backend (Gateway API:
    500)."""
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": opts.gateway}
    if opts.gateway_namespace:
        parent["namespace"] = opts.gateway_namespace
    strip = {"type": "RequestHeaderModifier", "requestHeaderModifier": {"remove": [BACKEND_HEADER, RESPONSE_HEADER]}}
    timeout = config.envoy.upstream_timeout_s
    rules: list[dict[str, Any]] = []
    externals: list[dict[str, Any]] = []
    for value, cluster in backend_routes(config):
        r = refs[cluster]
        ref: dict[str, Any] = {"kind": "Service", "name": r.service, "port": r.port}
        if r.namespace:
            ref["namespace"] = r.namespace
        filters = [strip]
        if r.external:
            filters.append({"type": "URLRewrite", "urlRewrite": {"hostname": r.host}})
            externals.append({
                "apiVersion": "v1", "kind": "Service", "metadata": _meta(r.service, opts, "backend"),
                "spec": {"type": "ExternalName", "externalName": r.host,
                         "ports": [{"name": "https" if r.tls else "http", "port": r.port}]},
            })
        rules.append({
            "matches": [{"path": {"type": "PathPrefix", "value": "/"},
                         "headers": [{"type": "Exact", "name": BACKEND_HEADER, "value": value}]}],
            "filters": filters,
            "backendRefs": [ref],
            "timeouts": {"request": f"{timeout}s"},
        })
    rules.append({"matches": [{"path": {"type": "PathPrefix", "value": "/"}}]})
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": _meta(opts.name, opts, "routes"),
        "spec": {"parentRefs": [parent], "rules": rules},
    }
    return [route, *externals, *backend_tls_policies(opts, refs)]


def manifests(config: Config, config_text: str, opts: Options) -> dict[str, list[dict[str, Any]]]:
    """Every file's documents, by file name."""
    from .k8s_gateways import envoy_gateway, istio, istio_cluster, istio_tls
    from .k8s_monitoring import monitoring

    if config.fallback_chains and config.fallback_attempts:
        raise K8sError("fallback_attempts: moving a failed attempt to the next hop needs Envoy's composite "
                       "clusters, which only the product's own bootstrap has; set fallback_attempts: 0 "
                       "(fallback_chains still apply when the sidecar decides)")
    refuse_unenforced(config)
    refs = backend_refs(config, opts.backend_urls)
    try:
        files = {
            "sidecar.yaml": _sidecar(config, config_text, opts, refs) + _demo_engines(config, opts, refs),
            "routes.yaml": httproute(config, opts, refs),
            "istio.yaml": k8s_access.with_secret(config, istio(config, opts), istio_cluster(opts))
            + istio_tls(config, opts),
            "monitoring.yaml": monitoring(opts),
        }
    except k8s_access.AccessError as exc:
        raise K8sError(str(exc)) from None
    if config.server.grpc_auth.secret is None:
        # Envoy Gateway's EnvoyExtensionPolicy cannot send gRPC metadata: with
        # a secret, only the Istio recipe reaches the sidecar.
        files["envoy-gateway.yaml"] = envoy_gateway(config, opts)
    return files


class _Dumper(yaml.SafeDumper):
    """Writes a shared value out in full each time: no anchors in manifests."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render(docs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, default_flow_style=False) for d in docs)
