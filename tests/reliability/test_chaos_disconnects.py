"""Chaos: a storm of clients vanishing at random points of their requests (issue 8).

Each storm: 40 disconnects over the four kinds of model turn, some before the provider answered, most
while the proxy is relaying a stream, 8 at a time, against an upstream pool of 4
connections. Afterwards every kind of turn must still be served and the pool must be
idle again: one leaked connection per 10 disconnects would already exhaust it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest

from proxy.fake_provider import Reply
from tests.server.conftest import Proxy
from tests.server.hostile import IN_USE, disconnect_mid_stream, metric, settled_metric
from tests.server.test_disconnects_e2e import LONG, PATHS, POOL
from tests.server.test_ledger_e2e import tools_policy

STORM = 40
AT_ONCE = 8


async def one_disconnect(proxy: Proxy, rng: random.Random, n: int) -> None:
    path = PATHS[rng.choice(sorted(PATHS))]
    if rng.random() < 0.25:  # gone while the proxy waits for the provider's headers
        proxy.provider.script.append(Reply(text=LONG, delay=0.05))
        await disconnect_mid_stream(
            proxy.base_url,
            path.route,
            path.body,
            path.headers(n),
            before_headers=rng.uniform(0, 0.08),
        )
    else:  # gone after a random share of the stream
        proxy.provider.script.append(Reply(text=LONG))
        await disconnect_mid_stream(
            proxy.base_url, path.route, path.body, path.headers(n), read=rng.randint(1, 30_000)
        )


@pytest.mark.parametrize("seed", [0, 5, 8])
async def test_a_disconnect_storm_leaves_the_pool_serving(
    make_proxy: Callable[..., Awaitable[Proxy]],
    record_property: Callable[[str, object], None],
    seed: int,
) -> None:
    proxy = await make_proxy(
        acme_extra=tools_policy(),
        settings={"upstream_pool_size": POOL, "upstream_connect_timeout": 3.0},
    )
    rng = random.Random(seed)
    for start in range(0, STORM, AT_ONCE):
        burst = [one_disconnect(proxy, rng, n) for n in range(start, start + AT_ONCE)]
        await asyncio.gather(*burst)
    leaked = await settled_metric(proxy.base_url, IN_USE, 0)
    proxy.provider.script.clear()  # replies of requests that were gone before forwarding
    survived = 0
    for n, (name, path) in enumerate(sorted(PATHS.items())):
        for stream in (False, True):
            proxy.provider.script.append(Reply(text="still serving"))
            assert await path.ask(proxy, STORM + 2 * n + stream, stream) == "still serving", name
            survived += 1
    record_property("disconnects", STORM)
    record_property("ordinary_requests_after", survived)
    print(f"disconnects survived: {STORM}; connections left in use: {leaked:g}")
    assert leaked == 0
    assert await metric(proxy.base_url, IN_USE) == 0
