"""Process settings, read once at the edge (SPEC section 1).

Each setting comes from the first source that gives it: CLI flag > environment variable >
config file > built-in default. The config file is `--config` / `THREADKEEPER_CONFIG`, else
`./config/threadkeeper.yaml` when it exists. Relative paths (policies directory, SQLite
file) are relative to the working directory, whichever source names them.

    settings = load_settings({"port": 9000}, os.environ)

A bad value raises `SettingsError` naming where it came from, e.g.
`THREADKEEPER_PORT: expected an integer, got 'abc'`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from proxy.yamlsafe import load_yaml, shown

DEFAULT_CONFIG_FILE = Path("config/threadkeeper.yaml")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
STORE_SCHEMES = ("sqlite", "postgresql", "postgres")


class SettingsError(ValueError):
    """A setting is invalid; the message starts with the flag, env var or file it came from."""


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    policies_dir: Path = Path("./policies")
    store_url: str = "sqlite:///./threadkeeper.db"
    upstream_url: str = "https://api.openai.com/v1"
    config_file: Path | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_provider_body_bytes: int = 64 * 1024 * 1024  # what is buffered of a provider answer
    client_header_timeout: float = 60.0  # seconds for a request's headers, and a JSON body
    # Responses WebSocket mode (proxy/server/websocket.py): the largest client message
    # (bytes; larger closes the socket with 1009), seconds a socket may sit with no message
    # and no response running, and responses running at once on one socket (lanes);
    # seconds a socket lives at most (OpenAI's 60 minutes): then it closes once its
    # running responses end.
    websocket_max_message_bytes: int = 16 * 1024 * 1024
    websocket_idle_timeout: float = 600.0
    websocket_max_concurrent_responses: int = 4
    websocket_max_lifetime: float = 3600.0
    upstream_connect_timeout: float = 10.0
    upstream_read_timeout: float = 600.0
    upstream_pool_size: int = 100
    policy_reload_interval: float = 2.0
    log_level: str = "info"
    metrics_token: str | None = None  # when set, GET /metrics needs it as a bearer token
    store_connect_timeout: float = 5.0  # seconds to get a store connection (SQLite: its turn)
    store_command_timeout: float = 10.0  # seconds one store statement may take
    # Hot threads' windows kept in memory per process (bytes of item JSON; 0: none).
    thread_cache_bytes: int = 16 * 1024 * 1024
    workers: int = 1  # serving processes on the one port (proxy/server/workers.py)
    # The key of threadkeeper's compaction items (32 bytes, base64); None: the one the
    # store creates once (proxy/server/compaction.py).
    compaction_key: bytes | None = dataclasses.field(default=None, repr=False)
    # Keep an explain record per model request (GET /threadkeeper/v1/requests/{id}).
    explain: bool = True
    explain_retention_seconds: float = 7 * 86_400.0
    # LLM summaries unused for this long are purged (proxy/server/summaries.py).
    summary_retention_seconds: float = 30 * 86_400.0
    # Stored responses are purged this long after they were created, as OpenAI's 30 days
    # (proxy/server/response_routes.py).
    response_retention_seconds: float = 30 * 86_400.0
    # A background stream's events are kept this long for resumption (starting_after),
    # and a replica polls the store this often for a cancel of the background responses
    # it runs and for the events of those other replicas run (proxy/server/background.py).
    background_event_retention_seconds: float = 86_400.0
    background_poll_seconds: float = 0.5
    # When set, the thread inspector is served at /threadkeeper/ui/ (proxy/server/inspector.py).
    operator_token: str | None = None
    # The inspector cookie's Secure flag: auto (the request came over https, directly or
    # as a trusted proxy's X-Forwarded-Proto says), always, never.
    inspector_cookie_secure: str = "auto"
    # Reverse proxies (IPs or CIDR networks) whose X-Forwarded-For and X-Forwarded-Proto
    # the inspector believes (client address of its sign-in throttle; the cookie's Secure).
    trusted_proxies: tuple[str, ...] = ()


# -- value parsers: each returns the typed value or raises ValueError(problem) -----------


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {shown(value)}")
    return value.strip()


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {shown(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {shown(value)}")


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {shown(value)}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {shown(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {shown(value)}")
    return number


def _port(value: Any) -> int:
    port = _integer(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"expected a port between 0 and 65535, got {port}")
    return port


def _positive_int(value: Any) -> int:
    number = _integer(value)
    if number <= 0:
        raise ValueError(f"expected an integer > 0, got {number}")
    return number


def _non_negative_int(value: Any) -> int:
    number = _integer(value)
    if number < 0:
        raise ValueError(f"expected an integer >= 0, got {number}")
    return number


def _positive_number(value: Any) -> float:
    number = _number(value)
    if number <= 0:
        raise ValueError(f"expected a number > 0, got {number:g}")
    return number


def compaction_key(value: Any) -> bytes:
    """A 32-byte key written as base64 (standard or URL-safe alphabet)."""
    text = _text(value).strip()
    try:
        key = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("must be 32 bytes written as base64") from None
    if len(key) != 32:
        raise ValueError(f"must be 32 bytes written as base64, not {len(key)} bytes")
    return key


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {shown(value)}")


def _directory(value: Any) -> Path:
    return Path(_text(value) if not isinstance(value, Path) else str(value))


def _store_url(value: Any) -> str:
    url = _text(value)
    scheme = urlsplit(url).scheme
    if scheme not in STORE_SCHEMES:
        raise ValueError(
            f"expected sqlite:///path or postgresql://user@host:port/db, got {shown(url)}"
        )
    return url


def _http_url(value: Any) -> str:
    url = _text(value)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s) URL, got {shown(url)}")
    return url.rstrip("/")


def _log_level(value: Any) -> str:
    level = _text(value).lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {shown(value)}")
    return level


COOKIE_SECURE = ("auto", "always", "never")


def _cookie_secure(value: Any) -> str:
    choice = _text(value).lower()
    if choice not in COOKIE_SECURE:
        raise ValueError(f"expected one of {', '.join(COOKIE_SECURE)}, got {shown(value)}")
    return choice


def _networks(value: Any) -> tuple[str, ...]:
    """IP addresses or CIDR networks, as a YAML list or one comma-separated string."""
    entries = value.split(",") if isinstance(value, str) else value
    if not isinstance(entries, list | tuple):
        raise ValueError(f"expected a list of IP addresses or networks, got {shown(value)}")
    networks = []
    for entry in entries:
        text = entry.strip() if isinstance(entry, str) else entry
        if text == "":
            continue
        try:
            networks.append(str(ipaddress.ip_network(str(text), strict=False)))
        except ValueError:
            raise ValueError(f"expected an IP address or network, got {shown(entry)}") from None
    return tuple(networks)


@dataclass(frozen=True)
class _Field:
    """Where one setting can come from, and how its raw value is checked."""

    name: str
    parse: Callable[[Any], Any]
    file_key: str  # dotted path in the config file
    env: str | None = None
    cli: str | None = None


FIELDS: tuple[_Field, ...] = (
    _Field("host", _text, "host", "THREADKEEPER_HOST", "host"),
    _Field("port", _port, "port", "THREADKEEPER_PORT", "port"),
    _Field("policies_dir", _directory, "policies", "THREADKEEPER_POLICIES", "policies"),
    _Field("store_url", _store_url, "store", "THREADKEEPER_STORE", "store"),
    _Field("upstream_url", _http_url, "upstream_url", "THREADKEEPER_UPSTREAM_URL", "upstream"),
    _Field("max_body_bytes", _positive_int, "max_body_bytes", "THREADKEEPER_MAX_BODY_BYTES"),
    _Field(
        "max_provider_body_bytes",
        _positive_int,
        "max_provider_body_bytes",
        "THREADKEEPER_MAX_PROVIDER_BODY_BYTES",
    ),
    _Field(
        "client_header_timeout",
        _positive_number,
        "client_header_timeout",
        "THREADKEEPER_CLIENT_HEADER_TIMEOUT",
    ),
    _Field(
        "websocket_max_message_bytes",
        _positive_int,
        "websocket.max_message_bytes",
        "THREADKEEPER_WEBSOCKET_MAX_MESSAGE_BYTES",
    ),
    _Field(
        "websocket_idle_timeout",
        _positive_number,
        "websocket.idle_timeout",
        "THREADKEEPER_WEBSOCKET_IDLE_TIMEOUT",
    ),
    _Field(
        "websocket_max_concurrent_responses",
        _positive_int,
        "websocket.max_concurrent_responses",
        "THREADKEEPER_WEBSOCKET_MAX_CONCURRENT_RESPONSES",
    ),
    _Field(
        "websocket_max_lifetime",
        _positive_number,
        "websocket.max_lifetime",
        "THREADKEEPER_WEBSOCKET_MAX_LIFETIME",
    ),
    _Field("log_level", _log_level, "log_level", "THREADKEEPER_LOG_LEVEL"),
    _Field("upstream_connect_timeout", _positive_number, "upstream.connect_timeout"),
    _Field("upstream_read_timeout", _positive_number, "upstream.read_timeout"),
    _Field("upstream_pool_size", _positive_int, "upstream.pool_size"),
    _Field("policy_reload_interval", _positive_number, "policy_reload_interval"),
    _Field("metrics_token", _text, "metrics_token", "THREADKEEPER_METRICS_TOKEN", "metrics-token"),
    _Field(
        "store_connect_timeout",
        _positive_number,
        "store_connect_timeout",
        "THREADKEEPER_STORE_CONNECT_TIMEOUT",
    ),
    _Field(
        "store_command_timeout",
        _positive_number,
        "store_command_timeout",
        "THREADKEEPER_STORE_COMMAND_TIMEOUT",
    ),
    _Field(
        "thread_cache_bytes",
        _non_negative_int,
        "thread_cache_bytes",
        "THREADKEEPER_THREAD_CACHE_BYTES",
    ),
    _Field("workers", _positive_int, "workers", "THREADKEEPER_WORKERS", "workers"),
    _Field("compaction_key", compaction_key, "compaction_key", "THREADKEEPER_COMPACTION_KEY"),
    _Field("explain", _boolean, "explain", "THREADKEEPER_EXPLAIN"),
    _Field(
        "explain_retention_seconds",
        _positive_number,
        "explain_retention_seconds",
        "THREADKEEPER_EXPLAIN_RETENTION_SECONDS",
    ),
    _Field(
        "summary_retention_seconds",
        _positive_number,
        "summary_retention_seconds",
        "THREADKEEPER_SUMMARY_RETENTION_SECONDS",
    ),
    _Field(
        "response_retention_seconds",
        _positive_number,
        "response_retention_seconds",
        "THREADKEEPER_RESPONSE_RETENTION_SECONDS",
    ),
    _Field(
        "background_event_retention_seconds",
        _positive_number,
        "background.event_retention_seconds",
        "THREADKEEPER_BACKGROUND_EVENT_RETENTION_SECONDS",
    ),
    _Field(
        "background_poll_seconds",
        _positive_number,
        "background.poll_seconds",
        "THREADKEEPER_BACKGROUND_POLL_SECONDS",
    ),
    _Field(
        "operator_token",
        _text,
        "operator_token",
        "THREADKEEPER_OPERATOR_TOKEN",
        "operator-token",
    ),
    _Field(
        "inspector_cookie_secure",
        _cookie_secure,
        "inspector_cookie_secure",
        "THREADKEEPER_INSPECTOR_COOKIE_SECURE",
    ),
    _Field("trusted_proxies", _networks, "trusted_proxies", "THREADKEEPER_TRUSTED_PROXIES"),
)
FILE_KEYS = {field.file_key for field in FIELDS}


def load_settings(cli: Mapping[str, Any], env: Mapping[str, str]) -> Settings:
    """Settings from CLI flags (None = not given), the environment and the config file."""
    config_file = config_file_path(cli, env)
    file_values = read_config_file(config_file) if config_file else {}
    values: dict[str, Any] = {"config_file": config_file}
    for field in FIELDS:
        found = _raw_value(field, cli, env, file_values, config_file)
        if found is not None:
            source, raw = found
            values[field.name] = _parsed(field, source, raw)
    return Settings(**values)


def config_file_path(cli: Mapping[str, Any], env: Mapping[str, str]) -> Path | None:
    """The config file to read: named by flag or env (must exist), else the default if present."""
    for source, raw in (
        ("--config", cli.get("config")),
        ("THREADKEEPER_CONFIG", env.get("THREADKEEPER_CONFIG")),
    ):
        if raw is None or raw == "":
            continue
        path = Path(raw)
        if not path.is_file():
            raise SettingsError(f"{source}: config file {str(path)!r} does not exist")
        return path
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's settings flattened to dotted keys; unknown keys are errors (typos)."""
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: cannot read config file: {exc}") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    flat = _flattened(path, data)
    unknown = sorted(set(flat) - FILE_KEYS)
    if unknown:
        allowed = ", ".join(sorted(FILE_KEYS))
        raise SettingsError(f"{path}: {unknown[0]}: unknown setting (allowed: {allowed})")
    return flat


# The config file's nested sections, and what each holds (for the error of a non-mapping).
SECTIONS = {
    "upstream": "(connect_timeout, read_timeout, pool_size); the provider URL is upstream_url",
    "websocket": "(max_message_bytes, idle_timeout, max_concurrent_responses, max_lifetime)",
}


def _flattened(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    flat = {key: value for key, value in data.items() if key not in SECTIONS}
    for section, holds in SECTIONS.items():
        nested = data.get(section)
        if nested is None:
            continue
        if not isinstance(nested, dict):
            raise SettingsError(f"{path}: {section}: expected a mapping {holds}")
        flat.update({f"{section}.{key}": value for key, value in nested.items()})
    return flat


def _raw_value(
    field: _Field,
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_file: Path | None,
) -> tuple[str, Any] | None:
    """(source label, raw value) from the first source that sets this field."""
    if field.cli is not None and cli.get(field.cli) is not None:
        return f"--{field.cli}", cli[field.cli]
    if field.env is not None and env.get(field.env, "") != "":
        return field.env, env[field.env]
    if field.file_key in file_values and file_values[field.file_key] is not None:
        return f"{config_file}: {field.file_key}", file_values[field.file_key]
    return None


def _parsed(field: _Field, source: str, raw: Any) -> Any:
    try:
        return field.parse(raw)
    except ValueError as exc:
        raise SettingsError(f"{source}: {exc}") from None
