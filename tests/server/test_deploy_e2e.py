"""Deploying (issue 20 item 16): the image keeps its store on a volume and its healthcheck
probes readiness on the configured port; `serve` says in its log what it serves (store,
upstreams, tenants, workers, inspector) and no secret."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.fake_provider import FakeProvider
from proxy.server.startup import safe_url

from .conftest import PROVIDER_KEY, write_policies
from .test_crash_recovery import Server, free_port, running

REPO = Path(__file__).parent.parent.parent
OPERATOR = "op-secret-token-for-the-deploy-test"
METRICS = "metrics-secret-token-for-the-deploy-test"


def dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


def instruction(name: str) -> list[str]:
    return [line[len(name) :].strip() for line in dockerfile() if line.startswith(name + " ")]


def healthcheck_command() -> str:
    (check,) = instruction("HEALTHCHECK")
    return check.split(" CMD ", 1)[1]


def test_the_image_keeps_its_store_on_a_volume() -> None:
    assert instruction("VOLUME") == ["/data"]
    env = " ".join(instruction("ENV"))
    assert "THREADKEEPER_STORE=sqlite:////data/threadkeeper.db" in env
    # the docs' docker run mounts it
    runs = re.findall(r"`docker run [^`]+`", (REPO / "docs" / "operating.md").read_text())
    assert runs and all(re.search(r"-v \S+:/data\b", run) for run in runs), runs


async def run_healthcheck(port: int) -> int:
    """The image's HEALTHCHECK command, as Docker runs it (a shell), on THREADKEEPER_PORT."""
    env = {**os.environ, "THREADKEEPER_PORT": str(port)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    process = await asyncio.create_subprocess_exec(
        "sh", "-c", healthcheck_command(), env=env, stderr=subprocess.DEVNULL
    )
    return await asyncio.wait_for(process.wait(), timeout=60)


@asynccontextmanager
async def health_server(ready: bool) -> AsyncIterator[int]:
    """A server whose /healthz says up and whose /readyz says `ready`."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        return web.json_response({}, status=200 if ready else 503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_the_healthcheck_probes_readiness_on_the_configured_port() -> None:
    async with health_server(ready=True) as port:
        assert await run_healthcheck(port) == 0
    async with health_server(ready=False) as port:
        assert await run_healthcheck(port) != 0  # up but not ready is unhealthy
    assert await run_healthcheck(free_port()) != 0  # nothing there


def test_safe_url_drops_passwords() -> None:
    assert safe_url("postgresql://tk:hunter2@db:5432/tk?sslmode=require") == (
        "postgresql://tk:[redacted]@db:5432/tk?sslmode=require"
    )
    assert safe_url("postgresql://db/tk?user=tk&password=hunter2") == (
        "postgresql://db/tk?user=tk&password=[redacted]"
    )
    assert safe_url("sqlite:////data/threadkeeper.db") == "sqlite:////data/threadkeeper.db"
    assert safe_url("https://u:p@llm.example/v1") == "https://u:[redacted]@llm.example/v1"


def serving_line(server: Server) -> dict[str, Any]:
    lines = [
        json.loads(line)
        for line in server.log.read_text(errors="replace").splitlines()
        if line.startswith("{")
    ]
    found = [line for line in lines if line.get("event") == "serving"]
    assert len(found) == 1, server.output()
    return found[0]


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_logs_what_it_serves_and_no_secret(
    tmp_path: Path, provider: FakeProvider, workers: int
) -> None:
    write_policies(tmp_path / "policies")  # acme (api_key_env ACME_OPENAI_KEY) and default
    (tmp_path / "policies" / "vllm.yaml").write_text(
        "tenant: vllm\nupstream: {base_url: 'http://gpu:s3cret-pass@10.0.0.7:8000/v1'}\n"
    )
    assert provider.base_url is not None
    server = Server(
        tmp_path,
        provider.base_url,
        args=["--workers", str(workers), "--operator-token", OPERATOR, "--metrics-token", METRICS],
    )
    with running(server):
        await server.wait_ready()
        line = serving_line(server)
        healthy = await run_healthcheck(server.port)
    assert healthy == 0
    base = f"http://127.0.0.1:{server.port}"
    assert line["store"] == server.store_url
    assert line["upstreams"] == {
        "*": provider.base_url.rstrip("/"),
        "vllm": "http://gpu:[redacted]@10.0.0.7:8000/v1",
    }
    tenants = {t["tenant"]: t for t in line["tenants"]}
    assert set(tenants) == {"acme", "default", "vllm"}
    assert tenants["acme"]["provider_key"] == "env ACME_OPENAI_KEY"
    assert tenants["default"]["passthrough"] is True
    assert (line["workers"], line["port"], line["url"]) == (workers, server.port, f"{base}/v1")
    assert line["inspector"] == f"{base}/threadkeeper/ui/"
    assert line["metrics_auth"] is True
    log = server.log.read_text(errors="replace")
    for secret in (OPERATOR, METRICS, PROVIDER_KEY, "s3cret-pass"):
        assert secret not in log


async def test_without_an_operator_token_the_inspector_is_off(
    tmp_path: Path, provider: FakeProvider
) -> None:
    write_policies(tmp_path / "policies")
    assert provider.base_url is not None
    server = Server(tmp_path, provider.base_url)
    with running(server):
        await server.wait_ready()
        line = serving_line(server)
    assert line["inspector"] == "off" and line["metrics_auth"] is False
    assert shlex.split(healthcheck_command())[0] == "python"
