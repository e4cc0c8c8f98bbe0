"""Typed keys for what the application shares between requests (aiohttp AppKey)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web

from proxy.clock import Clock
from proxy.metrics import Metrics
from proxy.policy import Policy, PolicyRegistry
from proxy.server.summaries import BackgroundSummaries
from proxy.settings import Settings
from proxy.store.base import Store
from proxy.threads import ThreadService, WindowCache
from proxy.tracing import Tracing
from proxy.upstream import Upstream

if TYPE_CHECKING:
    from proxy.server.model_budget import LearnedLimits, ProviderCounts

SETTINGS = web.AppKey("settings", Settings)
POLICIES = web.AppKey("policies", PolicyRegistry)
UPSTREAM = web.AppKey("upstream", Upstream)
METRICS = web.AppKey("metrics", Metrics)
STORE = web.AppKey("store", Store)
WINDOWS = web.AppKey("windows", WindowCache)  # hot threads' windows (ThreadService)
# The one way handlers reach threads: the app's store, clock and hot-window cache (set
# with the store, app._store_ctx)
THREADS = web.AppKey("threads", ThreadService)
CLOCK = web.AppKey("clock", Clock)  # every handler and background task reads time here
TRACING = web.AppKey("tracing", Tracing)  # OpenTelemetry spans, or nothing (proxy/tracing.py)
# What the providers taught about their models (proxy/server/model_budget.py)
LEARNED: web.AppKey[LearnedLimits] = web.AppKey("learned")
# Item counts in the provider's tokens (`tokenizer: provider`, proxy/server/model_budget.py)
PROVIDER_COUNTS: web.AppKey[ProviderCounts] = web.AppKey("provider_counts")
OWNER = web.AppKey("owner", str)  # this process instance; marks the responses it runs
# LLM summaries written in the background (absent: no summarizer anywhere in this app)
SUMMARIES = web.AppKey("summaries", BackgroundSummaries)
# The API each tenant's upstream serves Responses through, as learnt (policy upstream.api:
# auto, proxy/server/relay.py `upstream_api`), by (tenant, base URL); None: nothing learnt.
UPSTREAM_APIS: web.AppKey[dict[tuple[str, str], str | None]] = web.AppKey("upstream_apis", dict)
# The output-cap field each tenant's Chat upstream takes, where its answers showed it does
# not take the spec's (proxy/server/chat_upstream.py), by (tenant, base URL); in memory.
CHAT_CAP_FIELDS: web.AppKey[dict[tuple[str, str], str]] = web.AppKey("chat_cap_fields", dict)
ENV: web.AppKey[Mapping[str, str]] = web.AppKey(
    "env"
)  # the process environment, read once at start (policy keys)

# Per-request values set by the middlewares.
REQUEST_ID = web.RequestKey("request_id", str)
LOG_FIELDS = web.RequestKey("log_fields", dict)  # extra fields of the request's log line
TENANT_POLICY = web.RequestKey("tenant_policy", Policy)
# The tenant id every store call of the request uses (auth.store_namespace): the tenant's
# own id, or one namespace per caller key in passthrough mode (SPEC section 1).
NAMESPACE = web.RequestKey("store_namespace", str)

_T = TypeVar("_T")


def request_value(request: web.Request, key: web.RequestKey[_T]) -> _T | None:
    """`request.get(key)` without its exception: aiohttp's `Request.get` and `in` are
    `Mapping`'s, which raise and catch a KeyError for a key not set (about 1 us); this
    reads the dict they read."""
    found: _T | None = request._state.get(key)
    return found
