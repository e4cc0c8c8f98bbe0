"""The `serving` log line: what a started proxy serves, for an operator reading its log.

One line per start (the supervisor's with several workers): the store, the upstreams, the
tenants, the workers and where the inspector is. It holds no secret: the store URL loses
its password (and any credential-like query parameter), the upstreams name the
environment variable of a provider key, never the key, and tokens appear only as whether
they are set.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from proxy.logs import REDACTED, SECRET_KEY
from proxy.policy import PolicyRegistry
from proxy.settings import Settings

INSPECTOR_PATH = "/threadkeeper/ui/"


def safe_url(url: str) -> str:
    """The URL without its password or credential-like query values (`sslpassword=`...)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if has_password else f"{user}@{host}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = [
        (name, REDACTED if SECRET_KEY.search(name.lower().replace("-", "_")) else value)
        for name, value in pairs
    ]
    if netloc == parts.netloc and query == pairs:
        return url  # as given: urlunsplit would write sqlite:////x as sqlite://x
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="[]")))


def _url_host(host: str) -> str:
    """The host as a URL writes it: a wildcard address becomes 127.0.0.1 (a local reader's
    way in), an IPv6 address gets brackets."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else quote(host, safe=".-")


def serving_fields(settings: Settings, policies: PolicyRegistry, port: int) -> dict[str, Any]:
    """The fields of the `serving` line (port: the bound one, which `--port 0` picks)."""
    tenants = []
    upstreams = {"*": safe_url(settings.upstream_url)}
    for name in policies.tenants():
        policy = policies.get(name)
        if policy is None:  # reloaded away meanwhile
            continue
        tenants.append(
            {
                "tenant": name,
                "keys": len(policy.api_keys),
                "passthrough": policy.allow_unknown_keys,
                "provider_key": (
                    f"env {policy.upstream.api_key_env}"
                    if policy.upstream.api_key_env
                    else "the client's Authorization"
                ),
            }
        )
        if policy.upstream.base_url is not None:
            upstreams[name] = safe_url(policy.upstream.base_url)
    base = f"http://{_url_host(settings.host)}:{port}"
    return {
        "url": f"{base}/v1",
        "host": settings.host,
        "port": port,
        "store": safe_url(settings.store_url),
        "upstreams": upstreams,
        "tenants": tenants,
        "policies": str(settings.policies_dir),
        "workers": settings.workers,
        "inspector": f"{base}{INSPECTOR_PATH}" if settings.operator_token else "off",
        "metrics": f"{base}/metrics",
        "metrics_auth": settings.metrics_token is not None,
    }
