"""A request the provider refuses with a 4xx is the request's own fault: the client gets
the provider's error and the store is left as it was (a Responses turn used to leave an
`incomplete` response row behind, which the OpenAPI fuzz test caught now and then)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from proxy.fake_provider import FakeProvider, Reply
from tests.reliability.storecheck import diff, snapshot

from .conftest import TENANT_KEY, Proxy

AUTH = {"Authorization": f"Bearer {TENANT_KEY}"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 404, 422])  # a 429 or 5xx stays incomplete
async def test_a_provider_4xx_on_a_stored_response_leaves_the_store_unchanged(
    make_proxy: Callable[..., Awaitable[Proxy]],
    provider: FakeProvider,
    tmp_path: Path,
    status: int,
    stream: bool,
) -> None:
    store = tmp_path / "refusal.db"
    proxy = await make_proxy(store_url=f"sqlite:///{store}")
    async with proxy.http() as http:
        first = await http.post(
            "/v1/responses", json={"model": "gpt-4o", "input": "Hello"}, headers=AUTH
        )
        assert first.status_code == 200
        before = snapshot(store)
        provider.script += [Reply(status=status, text="Unknown shell_call 'sc_1'.")] * 3
        body = {
            "model": "gpt-4o",
            "input": "Run it.",
            "previous_response_id": first.json()["id"],
            "stream": stream,
        }
        refused = await http.post("/v1/responses", json=body, headers=AUTH)
    assert refused.status_code == status
    assert refused.json()["error"]["message"] == "Unknown shell_call 'sc_1'."
    after = snapshot(store)
    assert after == before, diff(before, after)
