# The gateway image: the same package README.md installs (pip install of this repository).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
RUN pip install '.[otel]' && useradd --system --uid 10001 gateway \
    && mkdir -p /app/data /app/logs && chown gateway /app/data /app/logs && chmod 700 /app/data
# The embedded Redis keeps its pins here (redis.data_dir = "data/valkey"); compose uses Valkey.
VOLUME /app/data
USER gateway
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"
ENTRYPOINT ["vllm-gateway"]
CMD ["serve", "--config", "/etc/vllm-gateway/config.toml"]
