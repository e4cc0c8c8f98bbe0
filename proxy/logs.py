"""Structured logs: one JSON object per line, secrets never written.

    configure_logging("info")                  # once, at start
    register_secret(os.environ["ACME_OPENAI_KEY"])
    structlog.get_logger(__name__).info("upstream request", route="/v1/responses")

structlog events and stdlib `logging` records (aiohttp, proxy.core.tokens' warnings) go
through the same formatter, so both come out as JSON and both pass the redactor.

Redaction is by key and by value. A key named like a credential (authorization, api_key,
token, secret, password, cookie...) has its whole value replaced unless the value is a
number (so `context_tokens=1234` is still logged). Any string anywhere, nested dicts and
lists included, has bearer/basic credentials, OpenAI-style keys (sk-..., sk-proj-...),
`api_key=...`-style pairs and every registered secret replaced by "[redacted]".
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

import orjson
import structlog
from structlog.typing import EventDict, WrappedLogger

REDACTED = "[redacted]"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# Key names (lowercased, "-" and "." read as "_") whose values are credentials: the name
# ends in one of these words, so "x_api_key" is a secret and "api_key_env" is not.
SECRET_KEY = re.compile(
    r"(^|_)(authorization|api_?key|apikey|token|secret|secret_key|private_key|password|"
    r"passwd|cookie|credentials?)$"
)
# Credential-looking parts of any string.
SECRET_TEXT = (
    # "Bearer xyz" (headers, curl lines, exception messages)
    (re.compile(r"(?i)\b(bearer)(\s+)[A-Za-z0-9._~+/=-]+"), rf"\1\2{REDACTED}"),
    # "Basic dXNlcjpwYXNz": base64 has a lowercase letter followed by an uppercase letter or
    # digit somewhere, an English word after "basic" does not
    (
        re.compile(r"(?i:\b(basic)(\s+))(?=[A-Za-z0-9+/]*[a-z][A-Z0-9+/])[A-Za-z0-9+/]{8,}=*"),
        rf"\1\2{REDACTED}",
    ),
    # OpenAI-style keys: sk-..., sk-proj-..., sk-svcacct-..., proxy keys like sk-tk-...
    (re.compile(r"\bsk-[A-Za-z0-9_-]{6,}"), REDACTED),
    # api_key=..., "api-key": "...", password: ... inside a dumped body, URL or header list
    (
        re.compile(
            r"(?i)(\b(?:authorization|cookie|api[_-]?key|apikey|access[_-]?token|token|secret|"
            r"password|passwd)"
            r"[\"']?\s*[:=]\s*[\"']?)(?!(?:bearer|basic)\s)([^\"'\s,&;}]+)"
        ),
        rf"\1{REDACTED}",
    ),
)
# Every pattern of SECRET_TEXT needs one of these characters (a space after "bearer" or
# "basic", the dash of "sk-", the ":" or "=" after a key's name): a text without any, an
# id say, is not searched by each of them.
_MAY_HOLD_SECRET_TEXT = re.compile(r"[\s:=-]")
# Registered secrets shorter than this are ignored: they would blank out ordinary text.
MIN_SECRET_LENGTH = 6
# Past this many, new secrets are not registered (the first ones, provider keys registered
# at start, are never pushed out); bearer tokens and sk- keys are still caught by shape.
MAX_REGISTERED_SECRETS = 1024
# The combined pattern is rebuilt at most this often; newer secrets are matched one by one
# until then, so a stream of new tokens cannot make every log line recompile it.
RECOMPILE_SECONDS = 1.0
# Texts up to this long are remembered after redaction, at most this many at a time.
SEEN_MAX_LENGTH = 200
SEEN_MAX_ENTRIES = 4096
# Values that are never redacted, whatever their name (context_tokens=1234 stays).
_PLAIN = frozenset({int, float, bool, type(None)})


class Redactor:
    """A structlog processor that removes credentials; holds the registered secrets."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()
        self._compiled: re.Pattern[str] | None = None
        self._compiled_secrets: frozenset[str] = frozenset()
        self._compiled_at = -math.inf
        self._pending: tuple[str, ...] = ()  # registered since the last compile, longest first
        self._lock = threading.Lock()
        # Redacted forms of texts seen recently: field names, routes, models and tenants
        # repeat on every log line. Cleared whenever the set of secrets changes.
        self._seen: dict[str, str] = {}

    def register(self, value: str) -> None:
        """Never log `value` (a provider key read from env, a proxy key seen on a request)."""
        if not isinstance(value, str) or len(value) < MIN_SECRET_LENGTH:
            return
        if value in self._secrets or len(self._secrets) >= MAX_REGISTERED_SECRETS:
            return
        with self._lock:
            self._secrets.add(value)
            self._pending = _longest_first(self._secrets - self._compiled_secrets)
            self._seen = {}

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        value = self.value
        plain = _PLAIN  # tested here too: most fields are numbers, no call a field
        return {
            key: entry if type(entry) in plain else value(key, entry)
            for key, entry in event_dict.items()
        }

    def value(self, key: Any, value: Any) -> Any:
        """`value` with credentials removed; `key` is the name it is logged under.

        Only strings are redacted (numbers, booleans and None pass as they are, even under
        a secret-looking name); containers are rebuilt only to reach the strings in them."""
        kind = type(value)
        if kind in _PLAIN:
            return value
        if key.__class__ is str and is_secret_key(key):
            if isinstance(value, bool | int | float):
                return value
            return REDACTED
        if kind is str:
            return self.text(value)
        if kind is dict or isinstance(value, Mapping):
            text = self.text
            seen = self._seen  # text's cache, read here first: keys repeat on every line
            entry = self.value
            plain = _PLAIN
            return {
                (seen.get(k) or text(k) if k.__class__ is str else text(str(k))): v
                if type(v) in plain
                else entry(k, v)
                for k, v in value.items()
            }
        if kind is list or isinstance(value, tuple | set | frozenset):
            entry = self.value
            plain = _PLAIN
            return [item if type(item) in plain else entry(None, item) for item in value]
        if isinstance(value, bool | int | float):
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, bytes | bytearray):
            return self.text(bytes(value).decode("utf-8", errors="replace"))
        return self.text(str(value))

    def text(self, text: str) -> str:
        seen = self._seen
        cached = seen.get(text)
        if cached is not None:
            return cached
        redacted = self._redact(text)
        if len(text) <= SEEN_MAX_LENGTH:
            if len(seen) >= SEEN_MAX_ENTRIES:
                seen.clear()
            seen[text] = redacted
        return redacted

    def _redact(self, text: str) -> str:
        compiled, pending = self._registered()
        if compiled is not None:
            text = compiled.sub(REDACTED, text)
        for secret in pending:
            text = text.replace(secret, REDACTED)
        if _MAY_HOLD_SECRET_TEXT.search(text) is not None:
            for regex, replacement in SECRET_TEXT:
                text = regex.sub(replacement, text)
        return text

    def _registered(self) -> tuple[re.Pattern[str] | None, tuple[str, ...]]:
        """The compiled pattern and the secrets it does not cover yet."""
        if self._pending and time.monotonic() - self._compiled_at >= RECOMPILE_SECONDS:
            with self._lock:
                secrets = frozenset(self._secrets)
                self._compiled = _secrets_pattern(secrets)
                self._compiled_secrets = secrets
                self._compiled_at = time.monotonic()
                self._pending = ()
        return self._compiled, self._pending


def _longest_first(secrets: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(secrets, key=len, reverse=True))


def _trie_pattern(words: Iterable[str]) -> str:
    """One regex for many literals, shared prefixes merged, so matching is not O(words)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}
    return _trie_node_pattern(trie)


def _trie_node_pattern(node: dict[str, Any]) -> str:
    branches = []
    for char, child in node.items():
        if not char:
            continue
        run = char
        while len(child) == 1 and "" not in child:  # a chain: no recursion per character
            ((char, child),) = child.items()
            run += char
        branches.append(re.escape(run) + _trie_node_pattern(child))
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
    return f"(?:{body})?" if "" in node else body


def _secrets_pattern(secrets: Iterable[str]) -> re.Pattern[str]:
    try:
        return re.compile(_trie_pattern(secrets))
    except (RecursionError, re.error):  # pathological nesting: plain alternation instead
        return re.compile("|".join(map(re.escape, _longest_first(secrets))))


@functools.lru_cache(maxsize=4096)  # field names repeat on every line
def is_secret_key(key: str) -> bool:
    return SECRET_KEY.search(key.lower().replace("-", "_").replace(".", "_")) is not None


# The process's redactor. Logging itself is process-wide (structlog's configuration and
# the root logger), so this one object is shared by it; tests may build their own.
DEFAULT_REDACTOR = Redactor()


def register_secret(value: str) -> None:
    DEFAULT_REDACTOR.register(value)


class _JsonLinesHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler configure_logging installed, so calling it again replaces it; it
    holds the redactor, and writes structlog's lines as they are (no LogRecord)."""

    def __init__(self, stream: TextIO, redactor: Redactor) -> None:
        super().__init__(stream)
        self.redactor = redactor

    def write_line(self, line: str) -> None:
        """One rendered line, as `emit` would write it (the same lock, flushed)."""
        with self.lock:  # type: ignore[union-attr]
            self.stream.write(line + self.terminator)
            self.flush()


def _installed() -> _JsonLinesHandler | None:
    for handler in logging.root.handlers:
        if isinstance(handler, _JsonLinesHandler):
            return handler
    return None


class _LineLogger:
    """What structlog's events are written by: the rendered line goes to the handler
    configure_logging installed (looked up on every line, so a cached logger follows a
    reconfiguration), straight, without the stdlib's LogRecord and formatter on the way.
    Without that handler (it was removed) the line goes to the stdlib logger of the name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stdlib = logging.getLogger(name)

    def _write(self, level: int, line: str) -> None:
        handler = _installed()
        if handler is not None:
            handler.write_line(line)
        else:
            self.stdlib.log(level, line)

    def debug(self, line: str) -> None:
        self._write(logging.DEBUG, line)

    def info(self, line: str) -> None:
        self._write(logging.INFO, line)

    def warning(self, line: str) -> None:
        self._write(logging.WARNING, line)

    def error(self, line: str) -> None:
        self._write(logging.ERROR, line)

    def critical(self, line: str) -> None:
        self._write(logging.CRITICAL, line)

    msg = info
    exception = error
    fatal = critical


def _line_logger(*args: Any) -> _LineLogger:
    """structlog's logger_factory: `structlog.get_logger(name)`'s logger."""
    return _LineLogger(args[0] if args and isinstance(args[0], str) else "")


_METHOD_LEVELS = {**LEVELS, "exception": logging.ERROR, "fatal": logging.CRITICAL}


def _enabled(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """The level filter: the stdlib logger of the name decides, as for stdlib records."""
    if not logger.stdlib.isEnabledFor(_METHOD_LEVELS.get(method_name, logging.INFO)):
        raise structlog.DropEvent
    return event_dict


def _redacted(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """The installed handler's redactor (the process's when none is installed)."""
    handler = _installed()
    redactor = handler.redactor if handler is not None else DEFAULT_REDACTOR
    return redactor(logger, method_name, event_dict)


def render_json(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> str:
    """The line: orjson's rendering when it is plain ASCII, else the stdlib's (which
    escapes non-ASCII text and lone surrogates as before); both are the same JSON."""
    try:
        line = orjson.dumps(event_dict, default=_fallback).decode()
    except (TypeError, orjson.JSONEncodeError):
        line = ""
    if line and line.isascii():
        return line
    return json.dumps(event_dict, default=_fallback)


def _fallback(value: Any) -> Any:
    """What structlog's JSONRenderer writes for a value JSON has no form for."""
    structured = getattr(value, "__structlog__", None)
    return structured() if callable(structured) else repr(value)


def configure_logging(
    level: str = "info", stream: TextIO | None = None, redactor: Redactor | None = None
) -> Redactor:
    """Send structlog and stdlib logging to `stream` (default stdout) as redacted JSON lines.

    structlog's events are rendered by its processors and written by `_LineLogger`;
    stdlib records (aiohttp, proxy.core.tokens' warnings) go through the handler's
    formatter, with the same processors."""
    redactor = redactor or DEFAULT_REDACTOR
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
    ]
    # The proxy's own clock, stamped after the redactor: a new text on every line that
    # no secret can be in, and whose ":" and "-" would send it through every pattern.
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            _enabled,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.format_exc_info,
            _redacted,
            stamp,
            render_json,
        ],
        logger_factory=_line_logger,
        wrapper_class=structlog.stdlib.BoundLogger,
        # Loggers are built once, not on every call. Safe across reconfiguration: the
        # level is the stdlib logger's, the stream and the redactor the installed
        # handler's, each looked up on every line.
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redactor,
            stamp,
            render_json,
        ],
    )
    handler = _JsonLinesHandler(stream or sys.stdout, redactor)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _JsonLinesHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    return redactor
