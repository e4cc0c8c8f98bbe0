"""Settings precedence (CLI > env > config file > default) and errors that name the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.settings import Settings, SettingsError, load_settings

NO_FLAGS: dict[str, object] = {
    "host": None,
    "port": None,
    "policies": None,
    "store": None,
    "upstream": None,
    "config": None,
}


@pytest.fixture(autouse=True)
def _empty_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory so the repo's config/threadkeeper.yaml is not picked up."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_built_in_defaults_without_any_source() -> None:
    settings = load_settings(NO_FLAGS, {})
    assert settings == Settings()
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.store_url == "sqlite:///./threadkeeper.db"
    assert settings.upstream_url == "https://api.openai.com/v1"
    assert settings.policies_dir == Path("./policies")
    assert settings.config_file is None


def test_cli_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "tk.yaml",
        "host: 10.0.0.1\nport: 7000\nstore: sqlite:///file.db\nlog_level: warning\n",
    )
    env = {
        "THREADKEEPER_CONFIG": str(config),
        "THREADKEEPER_PORT": "7100",
        "THREADKEEPER_STORE": "postgresql://u@db:5432/tk",
    }
    settings = load_settings({**NO_FLAGS, "port": 7200}, env)
    assert settings.port == 7200  # CLI over env and file
    assert settings.store_url == "postgresql://u@db:5432/tk"  # env over file
    assert settings.host == "10.0.0.1"  # file over default
    assert settings.log_level == "warning"
    assert settings.upstream_url == Settings().upstream_url  # default
    assert settings.config_file == config


def test_every_flag_and_env_var_is_read(tmp_path: Path) -> None:
    flags = {
        "host": "0.0.0.0",
        "port": "9001",
        "policies": str(tmp_path / "p"),
        "store": "sqlite:///x.db",
        "upstream": "http://localhost:8000/v1/",
        "config": None,
    }
    settings = load_settings(flags, {})
    assert (settings.host, settings.port) == ("0.0.0.0", 9001)
    assert settings.policies_dir == tmp_path / "p"
    assert settings.store_url == "sqlite:///x.db"
    assert settings.upstream_url == "http://localhost:8000/v1"
    env = {
        "THREADKEEPER_HOST": "::1",
        "THREADKEEPER_PORT": "9002",
        "THREADKEEPER_POLICIES": "/etc/tk/policies",
        "THREADKEEPER_STORE": "postgresql://tk@db/tk",
        "THREADKEEPER_UPSTREAM_URL": "https://example.openai.azure.com/openai/v1",
        "THREADKEEPER_MAX_BODY_BYTES": "1024",
        "THREADKEEPER_LOG_LEVEL": "DEBUG",
    }
    settings = load_settings(NO_FLAGS, env)
    assert settings == Settings(
        host="::1",
        port=9002,
        policies_dir=Path("/etc/tk/policies"),
        store_url="postgresql://tk@db/tk",
        upstream_url="https://example.openai.azure.com/openai/v1",
        max_body_bytes=1024,
        log_level="debug",
    )


def test_default_config_file_is_read_when_present(tmp_path: Path) -> None:
    write_config(
        tmp_path / "config" / "threadkeeper.yaml",
        "upstream:\n  connect_timeout: 3\n  read_timeout: 60.5\n  pool_size: 7\n"
        "policy_reload_interval: 0.5\nmax_body_bytes: 4096\n",
    )
    settings = load_settings(NO_FLAGS, {})
    assert settings.config_file == Path("config/threadkeeper.yaml")
    assert settings.upstream_connect_timeout == 3.0
    assert settings.upstream_read_timeout == 60.5
    assert settings.upstream_pool_size == 7
    assert settings.policy_reload_interval == 0.5
    assert settings.max_body_bytes == 4096


def test_cli_config_beats_env_config(tmp_path: Path) -> None:
    from_cli = write_config(tmp_path / "a.yaml", "port: 1111\n")
    from_env = write_config(tmp_path / "b.yaml", "port: 2222\n")
    settings = load_settings({"config": str(from_cli)}, {"THREADKEEPER_CONFIG": str(from_env)})
    assert settings.port == 1111


def test_empty_env_var_counts_as_unset() -> None:
    assert load_settings(NO_FLAGS, {"THREADKEEPER_PORT": ""}).port == 8080


def test_repo_config_file_matches_built_in_defaults() -> None:
    repo_config = Path(__file__).resolve().parents[1] / "config" / "threadkeeper.yaml"
    settings = load_settings({"config": str(repo_config)}, {})
    assert settings == Settings(config_file=repo_config)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({}, {"THREADKEEPER_PORT": "abc"}, "THREADKEEPER_PORT: expected an integer, got 'abc'"),
        ({"port": "70000"}, {}, "--port: expected a port between 0 and 65535, got 70000"),
        ({"store": "mysql://db/x"}, {}, "--store: expected sqlite:///path or postgresql://"),
        ({}, {"THREADKEEPER_UPSTREAM_URL": "api.openai.com"}, "THREADKEEPER_UPSTREAM_URL: "),
        ({}, {"THREADKEEPER_MAX_BODY_BYTES": "-1"}, "THREADKEEPER_MAX_BODY_BYTES: expected"),
        ({}, {"THREADKEEPER_LOG_LEVEL": "loud"}, "THREADKEEPER_LOG_LEVEL: expected one of"),
        ({"config": "missing.yaml"}, {}, "--config: config file 'missing.yaml' does not exist"),
        ({}, {"THREADKEEPER_CONFIG": "nope.yaml"}, "THREADKEEPER_CONFIG: config file"),
    ],
)
def test_bad_flag_or_env_value_names_its_source(
    flags: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings({**NO_FLAGS, **flags}, env)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: eighty\n", "tk.yaml: port: expected an integer, got 'eighty'"),
        (
            "upstream:\n  read_timeout: -5\n",
            "tk.yaml: upstream.read_timeout: expected a number > 0",
        ),
        ("prot: 80\n", "tk.yaml: prot: unknown setting"),
        ("upstream:\n  pool: 3\n", "tk.yaml: upstream.pool: unknown setting"),
        ("upstream: https://x\n", "tk.yaml: upstream: expected a mapping"),
        ("websocket: 5\n", "tk.yaml: websocket: expected a mapping (max_message_bytes"),
        ("websocket:\n  idle: 3\n", "tk.yaml: websocket.idle: unknown setting"),
        ("port: [1\n", "tk.yaml: invalid YAML"),
        ("- 1\n- 2\n", "tk.yaml: expected a mapping of settings, got list"),
    ],
)
def test_bad_config_file_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    config = write_config(tmp_path / "tk.yaml", text)
    with pytest.raises(SettingsError) as raised:
        load_settings({"config": str(config)}, {})
    assert str(raised.value).startswith(f"{tmp_path}/{message}")


def test_bad_file_value_is_ignored_when_a_higher_source_overrides_it(tmp_path: Path) -> None:
    """Only the value actually used is validated: a flag can rescue a broken file entry."""
    config = write_config(tmp_path / "tk.yaml", "port: eighty\n")
    assert load_settings({"config": str(config), "port": 81}, {}).port == 81


def test_config_file_alias_bomb_is_refused_without_being_expanded(tmp_path: Path) -> None:
    """Issue 8 item 8: a 'billion laughs' config file is refused at its first anchor."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{n}: &a{n} [{','.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 7)]
    config = write_config(tmp_path / "tk.yaml", "\n".join([*lines, "host: *a6"]) + "\n")
    with pytest.raises(SettingsError) as raised:
        load_settings({"config": str(config)}, {})
    message = str(raised.value)
    assert message.startswith(f"{config}: invalid YAML")
    assert "found anchor &a0" in message and len(message) < 600


def test_config_error_quotes_a_bounded_part_of_a_value(tmp_path: Path) -> None:
    config = write_config(tmp_path / "tk.yaml", f"port: {'9' * 5000}x\n")
    with pytest.raises(SettingsError) as raised:
        load_settings({"config": str(config)}, {})
    message = str(raised.value)
    assert message.startswith(f"{config}: port: expected an integer, got '9999")
    assert len(message) < 300


def test_metrics_token_and_store_timeouts_from_every_source(tmp_path: Path) -> None:
    assert Settings().metrics_token is None
    assert (Settings().store_connect_timeout, Settings().store_command_timeout) == (5.0, 10.0)
    config = write_config(
        tmp_path / "tk.yaml",
        "metrics_token: from-file\nstore_connect_timeout: 1.5\nstore_command_timeout: 3\n",
    )
    from_file = load_settings({"config": str(config)}, {})
    assert from_file.metrics_token == "from-file"
    assert (from_file.store_connect_timeout, from_file.store_command_timeout) == (1.5, 3.0)
    env = {
        "THREADKEEPER_METRICS_TOKEN": "from-env",
        "THREADKEEPER_STORE_CONNECT_TIMEOUT": "2",
        "THREADKEEPER_STORE_COMMAND_TIMEOUT": "4",
    }
    from_env = load_settings({"config": str(config)}, env)
    assert (from_env.metrics_token, from_env.store_connect_timeout) == ("from-env", 2.0)
    assert from_env.store_command_timeout == 4.0
    assert load_settings({"metrics-token": "from-flag"}, env).metrics_token == "from-flag"
    with pytest.raises(SettingsError, match="THREADKEEPER_STORE_COMMAND_TIMEOUT: expected"):
        load_settings({}, {"THREADKEEPER_STORE_COMMAND_TIMEOUT": "0"})


def test_operator_token_from_every_source(tmp_path: Path) -> None:
    assert Settings().operator_token is None, "the inspector is off by default"
    config = write_config(tmp_path / "tk.yaml", "operator_token: op-file\n")
    assert load_settings({"config": str(config)}, {}).operator_token == "op-file"
    env = {"THREADKEEPER_OPERATOR_TOKEN": "op-env"}
    assert load_settings({"config": str(config)}, env).operator_token == "op-env"
    assert load_settings({"operator-token": "op-flag"}, env).operator_token == "op-flag"
    with pytest.raises(SettingsError, match="THREADKEEPER_OPERATOR_TOKEN: expected"):
        load_settings({}, {"THREADKEEPER_OPERATOR_TOKEN": "  "})


def test_provider_body_cap_and_client_header_timeout_come_from_the_environment() -> None:
    env = {
        "THREADKEEPER_MAX_PROVIDER_BODY_BYTES": "1_048_576",
        "THREADKEEPER_CLIENT_HEADER_TIMEOUT": "2.5",
    }
    settings = load_settings(NO_FLAGS, env)
    assert (settings.max_provider_body_bytes, settings.client_header_timeout) == (1048576, 2.5)
    with pytest.raises(SettingsError, match="THREADKEEPER_CLIENT_HEADER_TIMEOUT: expected"):
        load_settings(NO_FLAGS, {"THREADKEEPER_CLIENT_HEADER_TIMEOUT": "0"})
    with pytest.raises(SettingsError, match="THREADKEEPER_MAX_PROVIDER_BODY_BYTES: expected"):
        load_settings(NO_FLAGS, {"THREADKEEPER_MAX_PROVIDER_BODY_BYTES": "lots"})


def test_thread_cache_bytes_from_file_and_environment(tmp_path: Path) -> None:
    assert Settings().thread_cache_bytes == 16 * 1024 * 1024
    config = write_config(tmp_path / "tk.yaml", "thread_cache_bytes: 1_000\n")
    assert load_settings({"config": str(config)}, {}).thread_cache_bytes == 1000
    env = {"THREADKEEPER_THREAD_CACHE_BYTES": "0"}  # 0: no cache
    assert load_settings({"config": str(config)}, env).thread_cache_bytes == 0
    with pytest.raises(SettingsError, match="THREADKEEPER_THREAD_CACHE_BYTES: expected"):
        load_settings({}, {"THREADKEEPER_THREAD_CACHE_BYTES": "-1"})


def test_workers_from_every_source(tmp_path: Path) -> None:
    assert Settings().workers == 1
    config = write_config(tmp_path / "tk.yaml", "workers: 3\n")
    assert load_settings({"config": str(config)}, {}).workers == 3
    env = {"THREADKEEPER_WORKERS": "4"}
    assert load_settings({"config": str(config)}, env).workers == 4
    assert load_settings({"config": str(config), "workers": "2"}, env).workers == 2
    with pytest.raises(SettingsError, match="THREADKEEPER_WORKERS: expected an integer > 0"):
        load_settings({}, {"THREADKEEPER_WORKERS": "0"})
    with pytest.raises(SettingsError, match="--workers: expected an integer"):
        load_settings({"workers": "many"}, {})


def test_the_compaction_key_is_32_bytes_of_base64_and_never_shown() -> None:
    import base64

    key = bytes(range(32))
    for written in (base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode()):
        settings = load_settings({}, {"THREADKEEPER_COMPACTION_KEY": written})
        assert settings.compaction_key == key
        assert written not in repr(settings) and "compaction_key" not in repr(settings)
    for bad in ("abc", base64.b64encode(b"short").decode(), "not base64 at all!"):
        with pytest.raises(SettingsError, match="THREADKEEPER_COMPACTION_KEY: must be 32 bytes"):
            load_settings({}, {"THREADKEEPER_COMPACTION_KEY": bad})


def test_summary_retention_defaults_to_30_days_and_reads_env_and_file(tmp_path: Path) -> None:
    assert load_settings(NO_FLAGS, {}).summary_retention_seconds == 30 * 86_400
    env = {"THREADKEEPER_SUMMARY_RETENTION_SECONDS": "3600"}
    assert load_settings(NO_FLAGS, env).summary_retention_seconds == 3600
    config = write_config(tmp_path / "c.yaml", "summary_retention_seconds: 60\n")
    assert load_settings({"config": str(config)}, {}).summary_retention_seconds == 60
    with pytest.raises(SettingsError, match="THREADKEEPER_SUMMARY_RETENTION_SECONDS: expected"):
        load_settings(NO_FLAGS, {"THREADKEEPER_SUMMARY_RETENTION_SECONDS": "0"})


def test_inspector_cookie_secure_and_trusted_proxies_from_file_and_environment(
    tmp_path: Path,
) -> None:
    assert (Settings().inspector_cookie_secure, Settings().trusted_proxies) == ("auto", ())
    config = write_config(
        tmp_path / "tk.yaml",
        "inspector_cookie_secure: always\ntrusted_proxies: [10.0.0.0/8, '::1', 192.168.1.7/24]\n",
    )
    read = load_settings({"config": str(config)}, {})
    assert read.inspector_cookie_secure == "always"
    assert read.trusted_proxies == ("10.0.0.0/8", "::1/128", "192.168.1.0/24")
    env = {
        "THREADKEEPER_INSPECTOR_COOKIE_SECURE": "Never",
        "THREADKEEPER_TRUSTED_PROXIES": "127.0.0.1, 172.16.0.0/12",
    }
    read = load_settings({"config": str(config)}, env)
    assert read.inspector_cookie_secure == "never"
    assert read.trusted_proxies == ("127.0.0.1/32", "172.16.0.0/12")
    with pytest.raises(
        SettingsError, match="THREADKEEPER_INSPECTOR_COOKIE_SECURE: expected one of"
    ):
        load_settings({}, {"THREADKEEPER_INSPECTOR_COOKIE_SECURE": "sometimes"})
    with pytest.raises(SettingsError, match="THREADKEEPER_TRUSTED_PROXIES: expected an IP"):
        load_settings({}, {"THREADKEEPER_TRUSTED_PROXIES": "10.0.0.1, nginx"})


def test_response_retention_defaults_to_30_days_and_reads_env_and_file(tmp_path: Path) -> None:
    assert load_settings(NO_FLAGS, {}).response_retention_seconds == 30 * 86_400
    env = {"THREADKEEPER_RESPONSE_RETENTION_SECONDS": "3600"}
    assert load_settings(NO_FLAGS, env).response_retention_seconds == 3600
    config = write_config(tmp_path / "c.yaml", "response_retention_seconds: 60\n")
    assert load_settings({"config": str(config)}, {}).response_retention_seconds == 60
    with pytest.raises(SettingsError, match="THREADKEEPER_RESPONSE_RETENTION_SECONDS: expected"):
        load_settings(NO_FLAGS, {"THREADKEEPER_RESPONSE_RETENTION_SECONDS": "-1"})


def test_websocket_limits_from_file_and_environment(tmp_path: Path) -> None:
    defaults = load_settings(NO_FLAGS, {})
    assert defaults.websocket_max_message_bytes == 16 * 1024 * 1024
    assert defaults.websocket_idle_timeout == 600
    assert defaults.websocket_max_concurrent_responses == 4
    assert defaults.websocket_max_lifetime == 3600
    config = write_config(
        tmp_path / "c.yaml",
        "websocket:\n  max_message_bytes: 1000\n  idle_timeout: 5\n  max_concurrent_responses: 2\n"
        "  max_lifetime: 120\n",
    )
    settings = load_settings({"config": str(config)}, {})
    assert settings.websocket_max_message_bytes == 1000
    assert settings.websocket_idle_timeout == 5
    assert settings.websocket_max_concurrent_responses == 2
    assert settings.websocket_max_lifetime == 120
    env = {
        "THREADKEEPER_WEBSOCKET_MAX_MESSAGE_BYTES": "2000",
        "THREADKEEPER_WEBSOCKET_IDLE_TIMEOUT": "7.5",
        "THREADKEEPER_WEBSOCKET_MAX_CONCURRENT_RESPONSES": "3",
        "THREADKEEPER_WEBSOCKET_MAX_LIFETIME": "90.5",
    }
    settings = load_settings({"config": str(config)}, env)
    assert settings.websocket_max_message_bytes == 2000
    assert settings.websocket_idle_timeout == 7.5
    assert settings.websocket_max_concurrent_responses == 3
    assert settings.websocket_max_lifetime == 90.5
    with pytest.raises(SettingsError, match="THREADKEEPER_WEBSOCKET_MAX_LIFETIME"):
        load_settings(NO_FLAGS, {"THREADKEEPER_WEBSOCKET_MAX_LIFETIME": "0"})
    with pytest.raises(SettingsError, match="THREADKEEPER_WEBSOCKET_MAX_CONCURRENT_RESPONSES"):
        load_settings(NO_FLAGS, {"THREADKEEPER_WEBSOCKET_MAX_CONCURRENT_RESPONSES": "0"})
