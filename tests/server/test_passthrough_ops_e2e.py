"""Other /v1 paths pass through; health, readiness, metrics; redacted logs."""

from __future__ import annotations

import io
import json

import pytest

from proxy.logs import configure_logging
from tests.server.conftest import PROVIDER_KEY, TENANT_KEY


async def test_models_and_embeddings_pass_through(proxy) -> None:
    client = proxy.client()
    models = await client.models.list()
    assert [m async for m in models]
    embedding = await client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert embedding.data[0].embedding
    assert proxy.provider.requests[-1].path == "/v1/embeddings"


async def test_arbitrary_path_method_query_and_body_pass_through(proxy) -> None:
    async with proxy.http() as http:
        response = await http.request(
            "PATCH",
            "/v1/some/thing?x=1&y=two",
            content=b"raw-bytes",
            headers={"Authorization": f"Bearer {TENANT_KEY}", "X-Custom": "kept"},
        )
    assert response.status_code == 200
    seen = proxy.provider.requests[-1]
    assert seen.method == "PATCH"
    assert seen.path == "/v1/some/thing"
    assert seen.raw == b"raw-bytes"
    assert seen.headers["X-Custom"] == "kept"
    assert seen.headers["Authorization"] == f"Bearer {PROVIDER_KEY}"


async def test_health_ready_metrics(proxy) -> None:
    client = proxy.client()
    await client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}]
    )
    async with proxy.http() as http:
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200
        metrics = (await http.get("/metrics")).text
    assert (
        'threadkeeper_requests_total{route="chat.completions",status="200",tenant="acme"} 1.0'
        in metrics
    )
    assert "threadkeeper_upstream_latency_seconds" in metrics
    assert "threadkeeper_context_tokens" in metrics
    assert PROVIDER_KEY not in metrics and TENANT_KEY not in metrics


async def test_logs_carry_budget_and_never_secrets(proxy) -> None:
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        client = proxy.client()
        await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Debug": f"Bearer {TENANT_KEY}"},
        )
        bad = proxy.client(api_key="sk-unknown-client-key-123456")
        await bad.models.list()
    finally:
        text = stream.getvalue()
        configure_logging("info")
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    request_lines = [
        line
        for line in lines
        if line.get("event") == "request" and line.get("route") == "chat.completions"
    ]
    assert request_lines
    line = request_lines[-1]
    assert line["tenant"] == "acme" and line["model"] == "gpt-4o" and line["status"] == 200
    assert line["budget"]["window"] == 16000
    assert "usage_input_tokens" in line
    for secret in (TENANT_KEY, PROVIDER_KEY, "sk-unknown-client-key-123456"):
        assert secret not in text


async def test_unexpected_exception_is_a_logged_500_and_the_server_keeps_serving(
    proxy, monkeypatch
) -> None:
    from proxy.server import turn

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(turn, "project_context", broken)
    monkeypatch.setattr(turn, "whole_fit", broken)  # a history that fits is not projected
    async with proxy.http() as http:
        headers = {"Authorization": f"Bearer {TENANT_KEY}"}
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error"
        request_id = response.headers["x-threadkeeper-request-id"]
        assert request_id in error["message"]
        assert "boom" not in error["message"]
        monkeypatch.undo()
        again = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert again.status_code == 200


async def test_metrics_token_guards_metrics(make_proxy) -> None:
    """Issue 8 item 18: with `metrics_token` set, /metrics is a 401 without that bearer."""
    proxy = await make_proxy(settings={"metrics_token": "metrics-secret-1"})
    async with proxy.http() as http:
        await http.post(
            "/v1/conversations", json={}, headers={"Authorization": f"Bearer {TENANT_KEY}"}
        )
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {TENANT_KEY}"},  # a tenant key is not the metrics token
            {"Authorization": "Basic metrics-secret-1"},
        ):
            refused = await http.get("/metrics", headers=headers)
            assert refused.status_code == 401, headers
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert "acme" not in refused.text
        allowed = await http.get("/metrics", headers={"Authorization": "Bearer metrics-secret-1"})
        assert allowed.status_code == 200 and 'tenant="acme"' in allowed.text
        assert (await http.get("/healthz")).status_code == 200  # probes stay open
        assert (await http.get("/readyz")).status_code == 200


FLOWS = {
    "chat": ("chat.completions", {}, {}),
    "chat threaded": ("chat.completions", {}, {"X-Thread-Id": "t-log"}),
    "responses stateless": ("responses", {"store": False}, {}),
    "responses stored": ("responses", {}, {}),
}


@pytest.mark.parametrize("flow", list(FLOWS))
async def test_every_flow_logs_its_budget(proxy, flow: str) -> None:
    """Each flow's request log line carries the budget breakdown (issue 9, drift bug 2:
    stateless Responses requests logged none)."""
    route, extra_body, headers = FLOWS[flow]
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        client = proxy.client()
        if route == "responses":
            await client.responses.create(
                model="gpt-4o", input="hi", extra_body=extra_body, extra_headers=headers
            )
        else:
            await client.chat.completions.create(
                model="gpt-4o",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers=headers,
            )
    finally:
        text = stream.getvalue()
        configure_logging("info")
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    request_lines = [
        line for line in lines if line.get("event") == "request" and line.get("route") == route
    ]
    assert len(request_lines) == 1
    line = request_lines[0]
    assert line["status"] == 200
    assert line["budget"]["window"] == 16000
    assert line["trimmed_blocks"] == []
    assert line["rebuilt"] is False
