# The sidecar image: `model-router serve` and nothing more (no Envoy, no
# protoc). The config is mounted at run time, never baked in:
#   docker run -v $PWD/config.yaml:/etc/model-router/config.yaml:ro model-router
#
# The base is pinned by digest (docs/deploy.md says how to move it); the
# dependencies come from requirements.lock, hash-checked, in a layer of their
# own, so a code change rebuilds only the last layer of the build stage.
ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm@sha256:5148c0e4bbb64271bca1d3322360ebf4bfb7564507ae32dd639322e4952a6b16

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/model-router
COPY requirements.lock /src/
RUN /opt/model-router/bin/pip install --require-hashes --only-binary=:all: -r /src/requirements.lock
COPY pyproject.toml README.md /src/
COPY deploy/observability/model-router.rules.yml /src/deploy/observability/
COPY sidecar /src/sidecar
RUN /opt/model-router/bin/pip install --no-deps /src

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin model-router \
 && install -d -o 10001 -g 10001 /var/lib/model-router /var/lib/model-router/envoy
COPY --from=build /opt/model-router /opt/model-router
WORKDIR /var/lib/model-router
USER 10001:10001
ENV PATH=/opt/model-router/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE 50051 9190
ENTRYPOINT ["model-router"]
CMD ["serve", "--config", "/etc/model-router/config.yaml", "--grpc-listen", "0.0.0.0:50051", "--admin-listen", "0.0.0.0:9190"]
