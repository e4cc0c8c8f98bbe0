"""Tenant policies: validation messages, model limits, key resolution, hot reload."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from proxy.policy import (
    BUILTIN_LIMITS,
    MAX_KEPT_ENTRIES,
    ModelLimits,
    Policy,
    PolicyError,
    PolicyRegistry,
    hash_key,
    load_policy_file,
)

REPO = Path(__file__).resolve().parents[1]
ACME_KEY = "sk-tk-acme-0123456789"
BETA_KEY = "sk-tk-beta-0123456789"


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def tenant_file(tenant: str, *keys: str, extra: str = "") -> str:
    lines = [f"tenant: {tenant}", "api_keys:", *[f"  - {hash_key(k)}" for k in keys]]
    return "\n".join(lines) + "\n" + extra if keys else f"tenant: {tenant}\n{extra}"


# -- validation ------------------------------------------------------------------------------


def test_minimal_file_gets_spec_defaults(tmp_path: Path) -> None:
    policy = load_policy_file(write(tmp_path, "acme.yaml", "tenant: acme\n"))
    assert policy.tenant == "acme"
    assert policy.api_keys == []
    assert policy.upstream.api_key_env is None
    assert policy.budget.reserve_output_tokens == 2000
    assert policy.budget.safety_margin_tokens == 500
    assert policy.memory.keep_recent_turns == 3
    assert policy.memory.tool_result_max_tokens == 800
    assert policy.memory.summarizer is None
    assert policy.retry.max_attempts == 3
    assert policy.limits_for("anything") == BUILTIN_LIMITS


def test_shipped_policy_files_are_valid(tmp_path: Path) -> None:
    default = load_policy_file(REPO / "policies" / "default.yaml")
    assert default.allow_unknown_keys and default.upstream.api_key_env is None
    example = Path(shutil.copy(REPO / "policies" / "acme.yaml.example", tmp_path / "acme.yaml"))
    # The example ships a placeholder, not a hash of a published key: copied as it is, the
    # file is refused, naming the field (issue 20 item 16).
    with pytest.raises(PolicyError) as refused:
        load_policy_file(example)
    assert refused.value.field == "api_keys[0]" and "placeholder" in str(refused.value)
    text = example.read_text()
    assert text.count('"<sha256 hex of your proxy key>"') == 1
    assert not re.search(r"\b[0-9a-f]{64}\b", text), "no working key hash is shipped"
    example.write_text(text.replace("<sha256 hex of your proxy key>", hash_key("sk-tk-mine-1")))
    acme = load_policy_file(example)
    assert acme.tools["refund_order"].side_effect
    assert acme.tools["refund_order"].idempotency_key == "refund:{order_id}"
    assert acme.upstream.api_key_env == "ACME_OPENAI_KEY"
    assert acme.api_keys == [hash_key("sk-tk-mine-1")]


@pytest.mark.parametrize(
    ("text", "field", "problem"),
    [
        ("tenant: acme\nmodels: {gpt-4o: [1\n", "(yaml)", "invalid YAML"),
        ("", "(top level)", "expected a mapping with tenant:, got an empty file"),
        ("tenant: other\n", "tenant", "must equal the file name 'acme', got 'other'"),
        ("api_keys: []\n", "tenant", "required field is missing"),
        (
            "tenant: acme\nmemory:\n  keep_recnt_turns: 2\n",
            "memory.keep_recnt_turns",
            "unknown field; did you mean 'keep_recent_turns'?",
        ),
        ("tenant: acme\nbudgett: {}\n", "budgett", "unknown field; did you mean 'budget'?"),
        (
            "tenant: acme\nmodels:\n  gpt-4o: {context_window: -5}\n",
            "models.gpt-4o.context_window",
            "Input should be greater than 0 (got -5)",
        ),
        (
            "tenant: acme\nmodels:\n  gpt-4o: {context_window: 1000, max_output_tokens: 2000}\n",
            "models.gpt-4o.max_output_tokens",
            "2000 exceeds context_window (1000)",
        ),
        (
            "tenant: acme\nmemory:\n  pin_patterns: ['ok', '(unclosed']\n",
            "memory.pin_patterns[1]",
            "invalid regex '(unclosed'",
        ),
        (
            "tenant: acme\napi_keys: [sk-tk-acme-plaintext]\n",
            "api_keys[0]",
            "expected the sha256 hex (64 characters 0-9a-f) of a proxy key, not the key itself",
        ),
        (
            "tenant: acme\ntools:\n  refund_order: {side_effect: true, scope: global}\n",
            "tools.refund_order.scope",
            "Input should be 'tenant' or 'thread' (got 'global')",
        ),
        (
            "tenant: acme\ntools:\n  refund_order: {on_duplicate: ignore}\n",
            "tools.refund_order.on_duplicate",
            "Input should be 'replay' or 'block'",
        ),
        (
            "tenant: acme\ntools:\n  refund_order: {idempotency_key: 'refund:{order_id'}\n",
            "tools.refund_order.idempotency_key",
            "invalid template",
        ),
        (
            "tenant: acme\nupstream: {api_key_env: sk-live-123}\n",
            "upstream.api_key_env",
            "expected the name of an environment variable",
        ),
        ("tenant: acme\nbudget: {target_fill: 1.5}\n", "budget.target_fill", "less than or equal"),
        ("tenant: acme\nretry: {max_attempts: 0}\n", "retry.max_attempts", "greater than or equal"),
        ("tenant: acme\nretry: {max_attempts: '3'}\n", "retry.max_attempts", "valid integer"),
        ("tenant: acme\nallow_unknown_keys: true\n", "allow_unknown_keys", "only has an effect in"),
        (
            "tenant: acme\nretry: {initial_backoff: 2, max_backoff: 1}\n",
            "retry.max_backoff",
            "1 is below initial_backoff (2)",
        ),
        (
            "tenant: acme\nmemory: {summarizer: {max_tokens: 500}}\n",
            "memory.summarizer.model",
            "required field is missing",
        ),
        (
            "tenant: acme\nmemory: {summarizer: {modle: gpt-4o-mini}}\n",
            "memory.summarizer.modle",
            "unknown field; did you mean 'model'?",
        ),
        (
            "tenant: acme\nmemory: {summarizer: {model: m, timeout_seconds: 0}}\n",
            "memory.summarizer.timeout_seconds",
            "greater than 0",
        ),
        (
            "tenant: acme\nmemory: {summarizer: {model: m, high_water: 1.2}}\n",
            "memory.summarizer.high_water",
            "less than or equal",
        ),
        (
            "tenant: acme\nmemory: {summarizer: {enabled: 'yes', model: m}}\n",
            "memory.summarizer",
            "the old 'enabled' flag must be true or false",
        ),
    ],
)
def test_invalid_file_names_file_field_and_problem(
    tmp_path: Path, text: str, field: str, problem: str
) -> None:
    path = write(tmp_path, "acme.yaml", text)
    with pytest.raises(PolicyError) as raised:
        load_policy_file(path)
    error = raised.value
    assert (error.file, error.field) == (str(path), field)
    assert problem in error.problem
    assert str(error) == f"{path}: {field}: {error.problem}"


def test_key_hashes_are_normalised_to_lowercase(tmp_path: Path) -> None:
    text = f"tenant: acme\napi_keys: [{hash_key(ACME_KEY).upper()}]\n"
    assert load_policy_file(write(tmp_path, "acme.yaml", text)).api_keys == [hash_key(ACME_KEY)]


def test_policy_is_frozen(tmp_path: Path) -> None:
    policy = load_policy_file(write(tmp_path, "acme.yaml", "tenant: acme\n"))
    with pytest.raises(ValueError):
        policy.allow_unknown_keys = True  # type: ignore[misc]


# -- model limits and upstream key -----------------------------------------------------------


def limits(window: int) -> ModelLimits:
    return ModelLimits(context_window=window)


def test_limits_for_exact_then_longest_prefix_then_star() -> None:
    policy = Policy(
        tenant="acme",
        models={
            "*": limits(50_000),
            "gpt-4": limits(8_192),
            "gpt-4o": limits(128_000),
            "gpt-4o-mini": limits(16_000),
        },
    )
    assert policy.limits_for("gpt-4o-mini").context_window == 16_000  # exact
    assert policy.limits_for("gpt-4o-2024-08-06").context_window == 128_000  # longest prefix
    assert policy.limits_for("gpt-4o-mini-2024-07-18").context_window == 16_000
    assert policy.limits_for("gpt-4-0613").context_window == 8_192
    assert policy.limits_for("o3").context_window == 50_000  # "*"
    assert policy.limits_for("ft:gpt-4o-mini:acme::abc").context_window == 16_000  # base model
    assert policy.limits_for("openai/gpt-4o-mini").context_window == 16_000  # provider prefix


def test_limits_for_falls_back_to_built_in_without_star() -> None:
    policy = Policy(tenant="acme", models={"gpt-4o": limits(1000)})
    assert policy.limits_for("llama-3") == BUILTIN_LIMITS
    assert BUILTIN_LIMITS == ModelLimits(context_window=128_000, max_output_tokens=16_384)


def test_upstream_key_reads_the_named_env_var(tmp_path: Path) -> None:
    text = "tenant: acme\nupstream: {api_key_env: ACME_OPENAI_KEY}\n"
    policy = load_policy_file(write(tmp_path, "acme.yaml", text))
    assert policy.upstream_key({"ACME_OPENAI_KEY": "sk-provider"}) == "sk-provider"
    with pytest.raises(PolicyError) as raised:
        policy.upstream_key({"ACME_OPENAI_KEY": ""})
    assert raised.value.field == "upstream.api_key_env"
    assert raised.value.file.endswith("acme.yaml")
    assert "ACME_OPENAI_KEY is not set" in raised.value.problem
    assert Policy(tenant="beta").upstream_key({"ACME_OPENAI_KEY": "sk-provider"}) is None


# -- registry --------------------------------------------------------------------------------


@pytest.fixture
def policies(tmp_path: Path) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    write(directory, "acme.yaml", tenant_file("acme", ACME_KEY))
    write(directory, "beta.yml", tenant_file("beta", BETA_KEY))
    return directory


def test_resolve_by_key_hash(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    assert registry.tenants() == ["acme", "beta"]
    assert registry.resolve(ACME_KEY).tenant == "acme"  # type: ignore[union-attr]
    assert registry.resolve(BETA_KEY).tenant == "beta"  # type: ignore[union-attr]
    assert registry.get("beta") is registry.resolve(BETA_KEY)
    assert registry.get("gamma") is None


def test_unknown_key_is_refused_without_a_passthrough_default(policies: Path) -> None:
    write(policies, "default.yaml", "tenant: default\nallow_unknown_keys: false\n")
    registry = PolicyRegistry.load(policies)
    assert registry.resolve("sk-someone-else") is None
    assert registry.resolve(None) is None


def test_unknown_key_goes_to_default_when_it_allows_unknown_keys(policies: Path) -> None:
    write(policies, "default.yaml", "tenant: default\nallow_unknown_keys: true\n")
    registry = PolicyRegistry.load(policies)
    assert registry.resolve("sk-someone-else").tenant == "default"  # type: ignore[union-attr]
    assert registry.resolve(ACME_KEY).tenant == "acme"  # type: ignore[union-attr]


def test_shipped_policies_directory_loads() -> None:
    registry = PolicyRegistry.load(REPO / "policies")
    assert "default" in registry.tenants()
    assert registry.resolve("sk-any-client-key").tenant == "default"  # type: ignore[union-attr]


def test_load_refuses_a_bad_file(policies: Path) -> None:
    write(policies, "gamma.yaml", "tenant: gamma\nmemory: {pin_patterns: ['[']}\n")
    with pytest.raises(PolicyError) as raised:
        PolicyRegistry.load(policies)
    assert raised.value.file == str(policies / "gamma.yaml")
    assert raised.value.field == "memory.pin_patterns[0]"


def test_load_refuses_a_key_listed_by_two_tenants(policies: Path) -> None:
    write(policies, "gamma.yaml", tenant_file("gamma", ACME_KEY))
    with pytest.raises(PolicyError) as raised:
        PolicyRegistry.load(policies)
    assert raised.value.file == str(policies / "gamma.yaml")
    assert raised.value.field == "api_keys[0]"
    assert "already belongs to tenant 'acme'" in raised.value.problem


def test_load_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as raised:
        PolicyRegistry.load(tmp_path / "nope")
    assert "does not exist" in str(raised.value)


def test_load_ignores_other_files(policies: Path) -> None:
    write(policies, "acme.yaml.example", "not: a policy\n")
    write(policies, ".#acme.yaml", "editor lock file\n")
    write(policies, "README.md", "# notes\n")
    assert PolicyRegistry.load(policies).tenants() == ["acme", "beta"]


def test_reload_picks_up_an_edit(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    extra = "models:\n  gpt-4o: {context_window: 32000}\n"
    write(policies, "acme.yaml", tenant_file("acme", ACME_KEY, "sk-tk-acme-second", extra=extra))
    assert registry.reload() == []
    assert registry.get("acme").limits_for("gpt-4o").context_window == 32000  # type: ignore[union-attr]
    assert registry.resolve("sk-tk-acme-second").tenant == "acme"  # type: ignore[union-attr]


def test_reload_keeps_last_good_policy_and_reports_a_bad_edit(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    write(policies, "acme.yaml", tenant_file("acme", ACME_KEY, extra="budget: {oops: 1}\n"))
    with capture_logs() as logs:
        errors = registry.reload()
    assert [(e.file, e.field) for e in errors] == [(str(policies / "acme.yaml"), "budget.oops")]
    assert registry.resolve(ACME_KEY).tenant == "acme"  # type: ignore[union-attr]
    [logged] = [entry for entry in logs if entry["log_level"] == "error"]
    assert logged["file"] == str(policies / "acme.yaml")
    assert logged["field"] == "budget.oops"
    assert registry.reload() == []  # the same bad content is reported once
    assert registry.resolve(ACME_KEY) is not None


def test_reload_after_fixing_a_bad_edit_applies_the_fix(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    write(policies, "acme.yaml", "tenant: acme\nretry: {max_attempts: 0}\n")
    assert len(registry.reload()) == 1
    write(policies, "acme.yaml", tenant_file("acme", ACME_KEY, extra="retry: {max_attempts: 5}\n"))
    assert registry.reload() == []
    assert registry.get("acme").retry.max_attempts == 5  # type: ignore[union-attr]


def test_reload_drops_a_removed_file_and_adds_a_new_one(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    (policies / "beta.yml").unlink()
    write(policies, "gamma.yaml", tenant_file("gamma", "sk-tk-gamma-0123"))
    assert registry.reload() == []
    assert registry.tenants() == ["acme", "gamma"]
    assert registry.resolve(BETA_KEY) is None
    assert registry.resolve("sk-tk-gamma-0123").tenant == "gamma"  # type: ignore[union-attr]


def test_reload_rejects_a_new_file_that_steals_a_key(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    write(policies, "gamma.yaml", tenant_file("gamma", ACME_KEY))
    [error] = registry.reload()
    assert (error.file, error.field) == (str(policies / "gamma.yaml"), "api_keys[0]")
    assert registry.resolve(ACME_KEY).tenant == "acme"  # type: ignore[union-attr]
    assert registry.tenants() == ["acme", "beta"]


def test_reload_survives_the_directory_disappearing(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    shutil.rmtree(policies)
    [error] = registry.reload()
    assert "does not exist" in error.problem
    assert registry.tenants() == ["acme", "beta"]


async def test_watch_reloads_until_cancelled(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    task = asyncio.create_task(registry.watch(0.01))
    write(policies, "gamma.yaml", tenant_file("gamma"))
    for _ in range(500):
        if "gamma" in registry.tenants():
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "gamma" in registry.tenants()


def test_reload_keeps_the_holder_when_a_new_file_claims_its_key_during_its_edit(
    policies: Path,
) -> None:
    """Issue 8 item 17: tenanta.yaml is edited while a new aaa.yaml (sorted first) lists
    tenanta's key. The new file is the bad one; tenanta keeps its key and its edit."""
    write(policies, "tenanta.yaml", tenant_file("tenanta", "sk-tk-tenanta-key"))
    registry = PolicyRegistry.load(policies)
    edit = "retry: {max_attempts: 5}\n"
    write(policies, "tenanta.yaml", tenant_file("tenanta", "sk-tk-tenanta-key", extra=edit))
    write(policies, "aaa.yaml", tenant_file("aaa", "sk-tk-tenanta-key"))
    with capture_logs() as logs:
        [error] = registry.reload()
    assert (error.file, error.field) == (str(policies / "aaa.yaml"), "api_keys[0]")
    assert "tenant 'tenanta'" in error.problem and "tenanta.yaml" in error.problem
    holder = registry.resolve("sk-tk-tenanta-key")
    assert holder is not None and holder.tenant == "tenanta"
    assert holder.retry.max_attempts == 5  # its own edit is applied
    assert registry.tenants() == ["acme", "beta", "tenanta"]
    [logged] = [entry for entry in logs if entry["log_level"] == "error"]
    assert logged["file"] == str(policies / "aaa.yaml")
    assert "tenanta.yaml" in logged["problem"]
    assert logged["event"] == "policy rejected; file not loaded"  # aaa.yaml had none


def test_reload_keeps_the_holder_when_an_edited_tenant_claims_its_key(policies: Path) -> None:
    """The same race between two existing files: acme.yaml (sorted first) is edited to
    list beta's key while beta.yml is edited too; acme's edit is rejected, acme keeps its
    last good policy, beta keeps its key."""
    registry = PolicyRegistry.load(policies)
    write(policies, "acme.yaml", tenant_file("acme", ACME_KEY, BETA_KEY))
    write(policies, "beta.yml", tenant_file("beta", BETA_KEY, extra="retry: {max_attempts: 7}\n"))
    [error] = registry.reload()
    assert (error.file, error.field) == (str(policies / "acme.yaml"), "api_keys[1]")
    assert registry.resolve(BETA_KEY).retry.max_attempts == 7  # type: ignore[union-attr]
    assert registry.resolve(ACME_KEY).tenant == "acme"  # type: ignore[union-attr]
    assert registry.tenants() == ["acme", "beta"]


def test_reload_lets_a_key_move_when_its_holder_gives_it_up(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    write(policies, "beta.yml", tenant_file("beta"))
    write(policies, "aaa.yaml", tenant_file("aaa", BETA_KEY))
    assert registry.reload() == []
    assert registry.resolve(BETA_KEY).tenant == "aaa"  # type: ignore[union-attr]


# -- YAML aliases (issue 8 item 8) ---------------------------------------------------------


def alias_bomb(tenant: str) -> str:
    """404 bytes of 'billion laughs': ten levels of ten aliases, 10^7 leaves."""
    lines = [
        f"tenant: {tenant}",
        'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
    ]
    for level in range(1, 7):
        refs = ",".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append("memory: {pin_patterns: *a6}")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_without_being_expanded(tmp_path: Path) -> None:
    path = write(tmp_path, "bomb.yaml", alias_bomb("bomb"))
    with pytest.raises(PolicyError) as raised:
        load_policy_file(path)
    assert raised.value.field == "(yaml)"
    # Refused at the first anchor, while composing: nothing was built to be expanded.
    assert "found anchor &a0" in raised.value.problem
    assert "line 2" in raised.value.problem
    assert len(str(raised.value)) < 400


def test_an_alias_alone_is_refused_too(tmp_path: Path) -> None:
    from proxy.yamlsafe import load_yaml

    with pytest.raises(Exception) as raised:
        load_yaml("a: *nowhere\n")
    assert "found alias *nowhere" in str(raised.value)


def test_reload_keeps_last_good_policy_on_an_alias_bomb(policies: Path) -> None:
    registry = PolicyRegistry.load(policies)
    write(
        policies, "acme.yaml", tenant_file("acme", ACME_KEY) + alias_bomb("acme").split("\n", 1)[1]
    )
    [error] = registry.reload()
    assert error.field == "(yaml)" and "anchor" in error.problem
    assert registry.resolve(ACME_KEY).tenant == "acme"  # type: ignore[union-attr]


def test_error_messages_quote_a_bounded_part_of_a_value(tmp_path: Path) -> None:
    huge = "y" * 1_000_000
    path = write(tmp_path, "acme.yaml", f"tenant: acme\nupstream: {{base_url: {huge}}}\n")
    with pytest.raises(PolicyError) as raised:
        load_policy_file(path)
    assert raised.value.field == "upstream.base_url"
    assert "yyyy" in raised.value.problem and len(raised.value.problem) < 300
    wrong_type = write(tmp_path, "beta.yaml", f"tenant: beta\nretry: {{max_attempts: [{huge}]}}\n")
    with pytest.raises(PolicyError) as raised:
        load_policy_file(wrong_type)
    assert raised.value.field == "retry.max_attempts" and len(raised.value.problem) < 300


def test_an_integer_python_cannot_build_is_a_yaml_error(tmp_path: Path) -> None:
    path = write(tmp_path, "acme.yaml", f"tenant: acme\nretry: {{max_attempts: {'9' * 5000}}}\n")
    with pytest.raises(PolicyError) as raised:
        load_policy_file(path)
    assert raised.value.field == "(yaml)" and "4300 digits" in raised.value.problem


def test_upstream_deadline_defaults_to_900_seconds_and_must_be_positive(tmp_path: Path) -> None:
    policy = load_policy_file(write(tmp_path, "acme.yaml", "tenant: acme\n"))
    assert policy.upstream.deadline_seconds == 900.0
    text = "tenant: acme\nupstream: {deadline_seconds: 2.5}\n"
    assert load_policy_file(write(tmp_path, "acme.yaml", text)).upstream.deadline_seconds == 2.5
    with pytest.raises(PolicyError) as raised:
        load_policy_file(
            write(tmp_path, "acme.yaml", "tenant: acme\nupstream: {deadline_seconds: 0}\n")
        )
    assert raised.value.field == "upstream.deadline_seconds"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("memory: {summarizer: {enabled: false, model: gpt-4o}}", None),  # the old off form
        ("memory: {summarizer: {enabled: true, model: gpt-4o}}", "gpt-4o"),
        ("memory: {summarizer: {enabled: true}}", "gpt-4o-mini"),  # the old default model
        ("memory: {summarizer: {model: gpt-4.1-mini}}", "gpt-4.1-mini"),
    ],
)
def test_summarizer_is_on_when_present_and_old_files_keep_their_meaning(
    tmp_path: Path, text: str, expected: str | None
) -> None:
    policy = load_policy_file(write(tmp_path, "acme.yaml", f"tenant: acme\n{text}\n"))
    summarizer = policy.memory.summarizer
    assert (summarizer.model if summarizer is not None else None) == expected
    if summarizer is not None:
        assert (summarizer.max_tokens, summarizer.timeout_seconds) == (800, 20.0)
        assert (summarizer.high_water, summarizer.instructions) == (0.8, None)


def test_compaction_mode_is_local_unless_a_tenant_says_upstream(tmp_path: Path) -> None:
    (tmp_path / "acme.yaml").write_text("tenant: acme\ncompaction: {mode: upstream}\n")
    (tmp_path / "globex.yaml").write_text("tenant: globex\n")
    registry = PolicyRegistry.load(tmp_path)
    acme, globex = registry.get("acme"), registry.get("globex")
    assert acme is not None and acme.compaction.mode == "upstream"
    assert globex is not None and globex.compaction.mode == "local"
    (tmp_path / "globex.yaml").write_text("tenant: globex\ncompaction: {mode: openai}\n")
    with pytest.raises(PolicyError, match=r"compaction\.mode"):
        PolicyRegistry.load(tmp_path)


def test_a_models_entry_is_the_same_asked_again_and_for_many_names() -> None:
    """The entry a model's requests read is kept per name (asked several times a
    request): the same answer every time, past the bound of kept names too."""
    policy = Policy.model_validate(
        {
            "tenant": "acme",
            "models": {"*": {"context_window": 1000}, "gpt-4o": {"context_window": 2000}},
        }
    )
    for _ in range(2):
        assert policy.limits_for("gpt-4o-mini").context_window == 2000  # the prefix
        assert policy.limits_for("ft:gpt-4o:org::x").context_window == 2000
        assert policy.limits_for("llama3").context_window == 1000
        assert policy.names_model("gpt-4o") and not policy.names_model("llama3")
    for number in range(MAX_KEPT_ENTRIES + 10):
        assert policy.limits_for(f"model-{number}").context_window == 1000
    assert policy.limits_for("gpt-4o").context_window == 2000
    assert policy._entries["gpt-4o"] == "gpt-4o"  # kept where pydantic keeps it
    assert 0 < len(policy._entries) <= MAX_KEPT_ENTRIES


def test_side_effect_tools_are_the_guarded_ones_only() -> None:
    policy = Policy.model_validate(
        {
            "tenant": "acme",
            "tools": {
                "refund_order": {"side_effect": True},
                "lookup_order": {"side_effect": False},
            },
        }
    )
    assert list(policy.side_effect_tools) == ["refund_order"]
    assert not Policy.model_validate({"tenant": "acme"}).side_effect_tools
