# The sidecar image: `model-router serve` and nothing more (no Envoy, no
# protoc). The config is mounted at run time, never baked in:
#   docker run -v $PWD/config.yaml:/etc/model-router/config.yaml:ro model-router
FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin model-router \
 && install -d -o 10001 -g 10001 /var/lib/model-router /var/lib/model-router/envoy
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /var/lib/model-router
USER 10001:10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE 50051 9190
ENTRYPOINT ["model-router"]
CMD ["serve", "--config", "/etc/model-router/config.yaml", "--grpc-listen", "0.0.0.0:50051", "--admin-listen", "0.0.0.0:9190"]
