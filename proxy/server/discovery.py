"""The window a provider lists for a model the policy does not name (issue 21, item 3).

Asked once per (tenant, upstream, model) and DISCOVERY_TTL_SECONDS (proxy/server/
model_budget.py), with one bounded attempt each, never on every request:

- `GET {base}/models`: vLLM's ModelCard has `max_model_len` (vllm/entrypoints/openai/
  protocol.py), OpenRouter's model `context_length` (and `top_provider.context_length`),
  LM Studio's `max_context_length`;
- then LM Studio's own `GET /api/v1/models` (next to its /v1; lmstudio.ai/docs/developer/
  rest/list): a model's `loaded_instances[].config.context_length` (in force), else its
  `max_context_length`;
- then Ollama's `POST /api/show` (next to its /v1): `model_info["<arch>.context_length"]`,
  and the `num_ctx` in force in `parameters` ("num_ctx 8192" lines), which wins when set.

Whatever it answers (nothing, an error, a timeout) is kept until the TTL: a provider that
lists nothing is never asked again meanwhile, and the policy's "*" window stands."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from proxy.core.budget import Learned
from proxy.server.errors import ApiError
from proxy.server.relay import provider_key, upstream_base
from proxy.server.state import TENANT_POLICY, UPSTREAM
from proxy.upstream import (
    Deadline,
    RetrySettings,
    UpstreamRequest,
    UpstreamUnavailable,
)

if TYPE_CHECKING:
    from proxy.server.model_budget import Key, LearnedLimits

log = structlog.get_logger("threadkeeper.discovery")

TIMEOUT_SECONDS = 3.0  # all the questions of one discovery, their answers read included
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # a model list bigger than this is not read
LISTED_KEYS = ("max_model_len", "context_length", "max_context_length")


async def discover(request: web.Request, model: str, key: Key, limits: LearnedLimits) -> Learned:
    """What is learnt of `model` with the window the provider lists, if it lists one."""
    window = await _listed_window(request, model)
    learned = limits.get(key) or Learned()
    log.info("provider_window_discovered", model=model, window=window)
    if window is not None and window != learned.discovered:
        learned = replace(learned, discovered=window)
        limits.put(key, learned)
    return learned


async def _listed_window(request: web.Request, model: str) -> int | None:
    base = upstream_base(request, request[TENANT_POLICY])
    deadline = Deadline.after(TIMEOUT_SECONDS)  # the request waits this long at most
    models = await _ask(request, "GET", f"{base}/models", None, deadline)
    window = window_in_models(models, model)
    if window is not None:
        return window
    root = base.removesuffix("/v1")
    native = await _ask(request, "GET", f"{root}/api/v1/models", None, deadline)
    window = window_in_lmstudio(native, model)
    if window is not None:
        return window
    shown = await _ask(request, "POST", f"{root}/api/show", {"model": model}, deadline)
    return window_in_show(shown)


async def _ask(request: web.Request, method: str, url: str, body: Any, deadline: Deadline) -> Any:
    """The provider's JSON answer, or None (an error, a timeout, not JSON)."""
    status, answer = await ask_provider(request, method, url, body, deadline)
    return answer if status is not None and status < 400 else None


async def ask_provider(
    request: web.Request, method: str, url: str, body: Any, deadline: Deadline
) -> tuple[int | None, Any]:
    """One bounded question to the tenant's provider, with its credentials: (the status,
    the JSON answer or None when it is not JSON); (None, None) when it never answered."""
    policy = request[TENANT_POLICY]
    try:
        key = provider_key(request, policy)
    except ApiError:  # no provider key: the request itself says so
        return None, None
    headers = {"Accept": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    elif "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    raw = json.dumps(body).encode() if body is not None else None
    if raw is not None:
        headers["Content-Type"] = "application/json"
    question = UpstreamRequest(
        method=method,
        url=url,
        headers=headers,
        body=raw,
        deadline=deadline,
        secrets=(key,) if key is not None else (),
    )
    try:
        answer = await request.app[UPSTREAM].send(question, RetrySettings(max_attempts=1))
        try:
            status = answer.status
            if status >= 400:
                return status, None
            text = await answer.aread()
        finally:
            await answer.aclose()
    except (UpstreamUnavailable, OSError) as exc:
        log.info("provider_unasked", url=url, error=str(exc))
        return None, None
    if len(text) > MAX_ANSWER_BYTES:
        return status, None
    try:
        return status, json.loads(text)
    except (ValueError, RecursionError):
        return status, None


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if value >= 1 else None


def window_in_models(answer: Any, model: str) -> int | None:
    """The listed window of `model` in a `GET /models` answer (`{"data": [...]}`)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    for entry in data if isinstance(data, list) else []:
        if not isinstance(entry, dict) or entry.get("id") != model:
            continue
        for name in LISTED_KEYS:
            found = _positive(entry.get(name))
            if found is not None:
                return found
        top = entry.get("top_provider")
        if isinstance(top, dict):
            return _positive(top.get("context_length"))
    return None


def window_in_lmstudio(answer: Any, model: str) -> int | None:
    """LM Studio's `GET /api/v1/models` (`{"models": [...]}`): the smallest context a
    loaded instance of `model` runs with, else the model's maximum."""
    models = answer.get("models") if isinstance(answer, dict) else None
    for entry in models if isinstance(models, list) else []:
        if not isinstance(entry, dict) or entry.get("key") != model:
            continue
        loaded = entry.get("loaded_instances")
        contexts = [
            _positive(instance["config"].get("context_length"))
            for instance in (loaded if isinstance(loaded, list) else [])
            if isinstance(instance, dict) and isinstance(instance.get("config"), dict)
        ]
        in_force = [c for c in contexts if c is not None]
        if in_force:
            return min(in_force)
        return _positive(entry.get("max_context_length"))
    return None


def window_in_show(answer: Any) -> int | None:
    """Ollama's `/api/show`: the `num_ctx` in force, else the model's context length."""
    if not isinstance(answer, dict):
        return None
    parameters = answer.get("parameters")
    if isinstance(parameters, str):
        for line in parameters.splitlines():
            name, _, value = line.strip().partition(" ")
            if name == "num_ctx" and value.strip().isdigit():
                return _positive(int(value.strip()))
    info = answer.get("model_info")
    if isinstance(info, dict):
        for name, value in info.items():
            if isinstance(name, str) and name.endswith(".context_length"):
                found = _positive(value)
                if found is not None:
                    return found
    return None
