"""JSON-lines logging and secret redaction: no credential ever reaches the log text."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.tokens import encoding_name_for_model
from proxy.logs import (
    _MAY_HOLD_SECRET_TEXT,
    REDACTED,
    SECRET_TEXT,
    Redactor,
    configure_logging,
    is_secret_key,
    register_secret,
)

PROVIDER_KEY = "sk-proj-Abc123XyZ_provider-secret-value"
PROXY_KEY = "sk-tk-acme-0123456789abcdef"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"
AZURE_KEY = "3f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"  # no recognisable shape: must be registered
BASIC = "dXNlcjpodW50ZXIy"  # base64("user:hunter2")
SECRETS = (PROVIDER_KEY, PROXY_KEY, JWT, AZURE_KEY, BASIC, "hunter2-password", "session=s3cr3t")


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, Redactor]]:
    """Logging configured into a buffer with a private redactor; restored afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    redactor = configure_logging("debug", stream, redactor=Redactor())
    yield stream, redactor
    structlog.reset_defaults()
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_structlog_events_are_json_lines(captured: tuple[io.StringIO, Redactor]) -> None:
    stream, _ = captured
    structlog.get_logger("proxy.test").info("budget", context_tokens=1234, trimmed=[1, 0, 0])
    structlog.get_logger("proxy.test").warning("second")
    first, second = lines(stream)
    assert first["event"] == "budget"
    assert first["level"] == "info"
    assert first["context_tokens"] == 1234
    assert first["trimmed"] == [1, 0, 0]
    assert first["timestamp"].startswith("20") and "T" in first["timestamp"]
    assert second["level"] == "warning"


def test_stdlib_logging_comes_out_as_json(captured: tuple[io.StringIO, Redactor]) -> None:
    stream, _ = captured
    encoding_name_for_model("threadkeeper-test-unknown-model")  # logs a stdlib warning
    [line] = lines(stream)
    assert line["level"] == "warning"
    assert line["logger"] == "proxy.core.tokens"
    assert "threadkeeper-test-unknown-model" in line["event"]


def test_level_filters_both_kinds_of_logger() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        configure_logging("warning", stream, redactor=Redactor())
        structlog.get_logger("proxy.test").info("hidden")
        logging.getLogger("proxy.test").info("hidden too")
        structlog.get_logger("proxy.test").error("shown")
    finally:
        structlog.reset_defaults()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert [line["event"] for line in lines(stream)] == ["shown"]


def test_no_secret_appears_in_any_shape(captured: tuple[io.StringIO, Redactor]) -> None:
    stream, redactor = captured
    redactor.register(AZURE_KEY)
    log = structlog.get_logger("proxy.server")
    log.info("request", headers={"Authorization": f"Bearer {PROXY_KEY}", "X-Thread-Id": "t1"})
    log.info("request", authorization=f"Bearer {JWT}")
    log.info(f"curl -H 'Authorization: Bearer {JWT}' https://api.openai.com/v1/models")
    log.info("upstream", api_key=AZURE_KEY, openai_api_key=AZURE_KEY, access_token=JWT)
    log.info("config", nested={"list": [{"x-api-key": AZURE_KEY}, (f"key {PROVIDER_KEY}",)]})
    log.info("body", body=json.dumps({"model": "gpt-4o", "api_key": AZURE_KEY}))
    log.info("url", url=f"https://example.openai.azure.com/openai?api-key={AZURE_KEY}&x=1")
    log.info("headers", raw=f"Authorization: Basic {BASIC}\r\nCookie: session=s3cr3t".encode())
    log.info("login", password="hunter2-password", Cookie="session=s3cr3t")
    log.warning("provider key %s rejected", PROVIDER_KEY)
    log.info("text mentions %s inside", AZURE_KEY)
    logging.getLogger("aiohttp.access").info("Authorization: Bearer %s", PROXY_KEY)
    try:
        raise RuntimeError(f"upstream said: invalid key {PROVIDER_KEY} / {AZURE_KEY}")
    except RuntimeError:
        log.exception("upstream failed")
        logging.getLogger("proxy.upstream").exception("stdlib saw it too")

    text = stream.getvalue()
    for secret in SECRETS:
        assert secret not in text
    assert len(lines(stream)) == 14
    assert text.count(REDACTED) >= 14


def test_redaction_keeps_what_operators_need(captured: tuple[io.StringIO, Redactor]) -> None:
    stream, _ = captured
    structlog.get_logger("proxy.server").info(
        "budget",
        input_tokens=900,
        max_output_tokens=2000,
        token=7,  # a number under a secret-looking name is not a secret
        idempotency_key="refund:42",
        api_key_env="ACME_OPENAI_KEY",
        header=f"Authorization: Bearer {JWT}",
        note="basic configuration loaded; tokens=3",
    )
    [line] = lines(stream)
    assert line["input_tokens"] == 900
    assert line["max_output_tokens"] == 2000
    assert line["token"] == 7
    assert line["idempotency_key"] == "refund:42"
    assert line["api_key_env"] == "ACME_OPENAI_KEY"
    assert line["header"] == f"Authorization: Bearer {REDACTED}"
    assert line["note"] == "basic configuration loaded; tokens=3"


def test_register_secret_reaches_the_default_redactor() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        configure_logging("info", stream)
        register_secret("vllm-local-key-0f1e2d3c")
        structlog.get_logger("proxy.test").info("using vllm-local-key-0f1e2d3c")
    finally:
        structlog.reset_defaults()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert "0f1e2d3c" not in stream.getvalue()
    assert lines(stream)[0]["event"] == f"using {REDACTED}"


def test_configuring_twice_does_not_duplicate_lines(captured: tuple[io.StringIO, Redactor]) -> None:
    stream, redactor = captured
    configure_logging("debug", stream, redactor=redactor)
    structlog.get_logger("proxy.test").info("once")
    assert len(lines(stream)) == 1


def test_secrets_registered_at_any_time_are_redacted() -> None:
    """Early secrets survive a flood of later ones; a long JWT and a just-registered key too."""
    redactor = Redactor()
    redactor.register(AZURE_KEY)  # a provider key, registered at start
    assert redactor.text(f"k={AZURE_KEY}!") == f"k={REDACTED}!"
    long_jwt = "eyJ" + "a1B2" * 1500
    redactor.register(long_jwt)
    redactor.register("fresh-key-registered-after-use")  # matched before the next recompile
    for number in range(3000):  # far past the registration cap
        redactor.register(f"client-token-{number:06d}")
    text = redactor.text(
        f"{AZURE_KEY} {long_jwt} fresh-key-registered-after-use client-token-000007"
    )
    assert text == " ".join([REDACTED] * 4)


def test_short_values_are_not_registered() -> None:
    redactor = Redactor()
    redactor.register("abc")
    assert redactor.text("abc abcdef") == "abc abcdef"


@given(
    st.text(alphabet=st.sampled_from("abBkKsS-_:= \t\"'eEarRyYcCiI0123456789xXpP/+."), max_size=40)
)
def test_a_text_without_the_prefilters_characters_matches_no_secret_shape(text: str) -> None:
    """The redactor skips SECRET_TEXT's patterns for a text with none of
    _MAY_HOLD_SECRET_TEXT's characters: each of them needs one."""
    if _MAY_HOLD_SECRET_TEXT.search(text) is None:
        assert all(regex.search(text) is None for regex, _ in SECRET_TEXT)
    for shaped in (f"sk-{text}abcdef", f"Bearer {text}x", f"api_key={text}x"):
        if _MAY_HOLD_SECRET_TEXT.search(shaped) is None:
            assert all(regex.search(shaped) is None for regex, _ in SECRET_TEXT)


def test_a_cached_logger_follows_a_reconfiguration() -> None:
    """Loggers are cached on first use; the stream, the redactor and the level are the
    ones configured last, and a line not in ASCII is the stdlib's JSON as before."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    first, second = io.StringIO(), io.StringIO()
    log = structlog.get_logger("proxy.test.cached")
    try:
        configure_logging("info", first, redactor=Redactor())
        log.info("one", text="caf\u00e9", big=2**70, odd={1, 2} - {1})
        redactor = Redactor()
        redactor.register("second-stream-secret")
        configure_logging("warning", second, redactor=redactor)
        log.info("hidden")
        log.warning("two", value="second-stream-secret")
    finally:
        structlog.reset_defaults()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    [one] = first.getvalue().splitlines()
    assert "\\u00e9" in one  # escaped, as json.dumps writes it
    assert json.loads(one)["text"] == "caf\u00e9"
    assert json.loads(one)["big"] == 2**70
    assert json.loads(one)["odd"] == [2]
    [two] = lines(second)
    assert two["event"] == "two"
    assert two["value"] == REDACTED


_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=30)
)
_KEYS = st.sampled_from(["token", "api_key", "count", "note", "Authorization", "x"]) | st.text(
    max_size=8
)
_VALUES = st.recursive(
    _LEAVES | st.just(f"Bearer {JWT}") | st.just(PROVIDER_KEY),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


def _walked(redactor: Redactor, key: Any, value: Any) -> Any:
    """The module docstring's rules, one call a value: what the redactor must give."""
    if value is None or type(value) in (bool, int, float):
        return value
    if isinstance(key, str) and is_secret_key(key):
        return REDACTED
    if isinstance(value, str):
        return redactor.text(value)
    if isinstance(value, dict):
        return {redactor.text(str(k)): _walked(redactor, k, v) for k, v in value.items()}
    return [_walked(redactor, None, item) for item in value]


@given(st.dictionaries(_KEYS, _VALUES, max_size=6))
def test_the_redactor_walks_every_value_by_the_rules(event: dict[str, Any]) -> None:
    redactor = Redactor()
    redactor.register(PROVIDER_KEY)
    assert redactor(None, "info", dict(event)) == {
        key: _walked(redactor, key, value) for key, value in event.items()
    }
