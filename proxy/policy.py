"""Tenant policies: one YAML file per tenant, validated at load (SPEC section 1).

    registry = PolicyRegistry.load(Path("policies"))   # refuses to start on any bad file
    policy = registry.resolve(bearer_token)              # None -> 401
    limits = policy.limits_for("gpt-4o-2024-08-06")

Every error names the file, the field and the problem (`PolicyError`). On reload a bad
file keeps its last good policy in force and the error is logged; the server never goes
down for a policy edit.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import re
import string
import threading
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import structlog
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.core.tokens import EXPECTED_SHA256, TiktokenVocabulary, Tokenizer, get_encoding
from proxy.native_tokenizers import MISTRAL_VERSIONS, TokenizerError, load_native
from proxy.periodic import every
from proxy.yamlsafe import load_yaml, shown

log = structlog.get_logger(__name__)

DEFAULT_TENANT = "default"
POLICY_SUFFIXES = (".yaml", ".yml")
PROVIDER_TOKENIZER = "provider"
BUILTIN_CONTEXT_WINDOW = 128_000
BUILTIN_MAX_OUTPUT_TOKENS = 16_384
MAX_KEPT_ENTRIES = 4096  # model names whose entry a Policy keeps (_entry_for)


class PolicyError(ValueError):
    """A policy file is invalid: str() is "file: field: problem"."""

    def __init__(self, file: str | Path, field: str, problem: str) -> None:
        self.file = str(file)
        self.field = field
        self.problem = problem
        super().__init__(f"{self.file}: {field}: {problem}")


def hash_key(token: str) -> str:
    """The sha256 hex that policy files list instead of the proxy key itself."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


# -- field checks --------------------------------------------------------------------------


def _key_hash(value: str) -> str:
    if value.startswith("<") and value.endswith(">"):
        raise ValueError(
            f"{value} is a placeholder: replace it with the sha256 hex of a proxy key"
            " (policies/acme.yaml.example says how to make one)"
        )
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError(
            "expected the sha256 hex (64 characters 0-9a-f) of a proxy key, not the key itself"
        )
    return value


def _lowercase(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regex {shown(value)}: {exc}") from None
    return value


def _env_var_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(
            "expected the name of an environment variable that holds the provider key"
            " (e.g. ACME_OPENAI_KEY), never the key itself"
        )
    return value


def _http_url(value: str) -> str:
    if not re.match(r"https?://[^/\s]+", value):
        raise ValueError(f"expected an http(s) URL, got {shown(value)}")
    return value.rstrip("/")


def _key_template(value: str) -> str:
    """Idempotency keys are rendered with str.format from the call's JSON arguments."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
    except ValueError as exc:
        raise ValueError(f"invalid template {shown(value)}: {exc}") from None
    if any(name == "" or name.isdigit() for name in fields):
        raise ValueError(f"invalid template {shown(value)}: placeholders must name an argument")
    return value


def _tokenizer_spec(value: str) -> str:
    """The form of `tokenizer:`; hf: files are read (and a missing one refused) by
    _load_tokenizers, once the policy validated."""
    kind, colon, rest = value.partition(":")
    if value == PROVIDER_TOKENIZER:
        return value
    if kind == "tiktoken" and colon:
        if rest not in EXPECTED_SHA256:
            known = ", ".join(EXPECTED_SHA256)
            raise ValueError(f"unknown tiktoken encoding {shown(rest)} (bundled: {known})")
        return value
    if kind == "mistral" and colon:
        if rest not in MISTRAL_VERSIONS:
            known = ", ".join(MISTRAL_VERSIONS)
            raise ValueError(f"unknown mistral version {shown(rest)} (shipped: {known})")
        return value
    if kind == "hf" and colon and rest.strip():
        return value
    raise ValueError(
        f"expected tiktoken:<encoding>, hf:<path>, mistral:<version> or provider, got {shown(value)}"
    )


KeyHash = Annotated[str, BeforeValidator(_lowercase), AfterValidator(_key_hash)]
Regex = Annotated[str, AfterValidator(_regex)]
Tenant = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class _Frozen(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )


# -- the schema (SPEC section 1) -----------------------------------------------------------


class ModelLimits(_Frozen):
    context_window: int = Field(gt=0)
    """The model's context window W in tokens: the budget every request is rebuilt under."""
    max_output_tokens: int | None = Field(default=None, gt=0)
    """The model's output cap; the output reserve never exceeds it."""
    tokenizer: Annotated[str, AfterValidator(_tokenizer_spec)] | None = None
    """How this model's tokens are counted: tiktoken:<encoding>, hf:<tokenizer.json or model directory, relative to this file>, mistral:<version>, or provider (the provider's own /tokenize or /responses/input_tokens, each item once, the calibrated estimate when it cannot tell; see "Token counting" above); absent, tiktoken for OpenAI model names, the tokenizer mistral-common maps a Mistral API name to (mistral-large-2407, codestral-latest...), else the o200k_base estimate."""

    @field_validator("max_output_tokens")
    @classmethod
    def _output_fits_window(cls, value: int | None, info: ValidationInfo) -> int | None:
        window = info.data.get("context_window")
        if value is not None and window is not None and value > window:
            raise ValueError(f"{value} exceeds context_window ({window})")
        return value


BUILTIN_LIMITS = ModelLimits(
    context_window=BUILTIN_CONTEXT_WINDOW, max_output_tokens=BUILTIN_MAX_OUTPUT_TOKENS
)


class UpstreamPolicy(_Frozen):
    base_url: Annotated[str, AfterValidator(_http_url)] | None = None
    """Where this tenant's requests go; absent, the server's --upstream URL."""
    api_key_env: Annotated[str, AfterValidator(_env_var_name)] | None = None
    """The environment variable holding the provider key (its name, never the key); absent, the client's own Authorization is forwarded."""
    # The longest one client request may spend with the provider, every exchange it makes
    # together (retries, ledger continuations, headers, the last byte of the body).
    deadline_seconds: float = Field(default=900.0, gt=0)
    """The longest one client request may spend with the provider, retries and continuations included (then a 504, or an error event in a stream)."""
    count_timeout_seconds: float = Field(default=2.0, gt=0, le=60)
    """With `tokenizer: provider`: the longest a turn waits for the provider's counts of its new items (then the calibrated estimate counts them)."""
    api: Literal["responses", "chat", "auto"] = "auto"
    """Which API the provider serves Responses turns through: `responses` (its /v1/responses), `chat` (translated to /v1/chat/completions, for Ollama, llama.cpp, TGI...), or `auto`: /v1/responses until the provider answers it 404 or 405, then `chat`, remembered in the store."""


class BudgetPolicy(_Frozen):
    reserve_output_tokens: int = Field(default=2000, ge=0)
    """The output reserve O when a request sets no max_output_tokens / max_tokens."""
    safety_margin_tokens: int = Field(default=500, ge=0)
    """The margin epsilon kept free for counting differences."""
    # share of the budget a sticky cut trims down to (SPEC section 5, cache-aware trimming)
    target_fill: float = Field(default=0.65, gt=0, le=1)
    """When trimming is needed, the history is cut down to this share of its budget (lower when recent turns are large, to leave room for two more like them) and the cut is kept, so later turns send the same prefix (prompt caching)."""


class SummarizerPolicy(_Frozen):
    """An LLM writes the summaries (proxy/summarizer.py), through the tenant's own upstream,
    off the request path (a compaction's on its own, bounded by timeout_seconds); absent,
    the deterministic digest is the only one."""

    model: str = Field(min_length=1)
    """The model that writes summaries, through this tenant's own upstream."""
    max_tokens: int = Field(default=800, gt=0)  # the rendered summary's size
    """The largest rendered summary the model may write. The call asks for at most twice this (the JSON around it), and an answer counted over twice that is refused unread (outcome invalid). What is kept of the model's words, stored and sealed in a compaction, is what this many tokens render; only the deterministic entries the guard adds (bounded by the extractor) come on top."""
    timeout_seconds: float = Field(default=20.0, gt=0)  # one summary, retries included
    """The longest one summary call may take, retries included; past it the deterministic digest stands."""
    instructions: str | None = Field(default=None, min_length=1)  # added to the prompt
    """Extra instructions added to the summarizer's prompt."""
    # A stateful thread whose history fills this share of its budget gets its next cut's
    # summary written in the background, before the cut needs it.
    high_water: float = Field(default=0.8, gt=0, le=1)
    """A thread whose history fills this share of its budget gets its next cut's summary written in the background, before the cut needs it."""


def _legacy_summarizer(value: Any) -> Any:
    """`{enabled: false, model: m}` (the old form) is no summarizer; `enabled: true` is
    `{model: m}`. Any other mapping is the current form."""
    if not isinstance(value, dict) or "enabled" not in value:
        return value
    rest = {k: v for k, v in value.items() if k != "enabled"}
    if value["enabled"] is False:
        return None
    if value["enabled"] is True:
        return {"model": "gpt-4o-mini", **rest}
    raise ValueError(
        "the old 'enabled' flag must be true or false; write `summarizer: {model: ...}` "
        "to turn the LLM summarizer on, or leave summarizer out"
    )


class MemoryPolicy(_Frozen):
    keep_recent_turns: int = Field(default=3, ge=0)
    """Recent closed turns never summarized while they fit. Their large tool results are compressed like any other closed turn's when the history outgrows its budget (the current turn's never)."""
    tool_result_max_tokens: int = Field(default=800, gt=0)
    """Older tool results above this size are compressed (errors, ids and values kept)."""
    pin_patterns: list[Regex] = Field(default_factory=list)
    """Regexes; user messages that match are kept verbatim like system text."""
    # Summary blocks are appended, one per cut, so the prefix repeats; above this share of
    # the history budget the chain is consolidated into one block (proxy/core/projection.py).
    summary_chain_max_share: float = Field(default=0.3, gt=0, le=1)
    """Summary blocks are appended, one per cut; above this share of the history budget the chain is consolidated into one block."""
    keep_opening_share: float = Field(default=0.4, ge=0, lt=1)
    """At a thread's first cut, its opening turns (not summarized, up to this share of the history budget, a tool result compressed before kept in that form) stay ahead of the summaries from then on, as the request before sent them: the task and rules as said, and a stable prefix the provider's prompt cache keeps across later cuts. Given up (summarized) only when a request would not fit otherwise. 0 turns it off."""
    summarizer: Annotated[SummarizerPolicy | None, BeforeValidator(_legacy_summarizer)] = None
    """An LLM writes the summaries, off the request path (a compaction's on its request, at most timeout_seconds); absent, the deterministic digest."""


class CompactionPolicy(_Frozen):
    """OpenAI's compaction (`POST /responses/compact`, `context_management`): `local`
    serves it here for any provider (proxy/server/compaction.py); `upstream` passes the
    requests and compaction items through untouched (a tenant whose provider is OpenAI)."""

    mode: Literal["local", "upstream"] = "local"
    """`local` serves OpenAI's compaction here for any provider; `upstream` passes compaction requests and items through untouched."""

    @property
    def local(self) -> bool:
        """Compaction is the proxy's (mode `local`), not the provider's."""
        return self.mode == "local"


class ToolPolicy(_Frozen):
    side_effect: bool = False
    """The tool changes the world (a refund, a payment): the ledger never hands the same call out twice."""
    idempotency_key: Annotated[str, AfterValidator(_key_template)] | None = None
    """A template rendered from the call's JSON arguments, e.g. refund:{order_id}; absent, a sha256 of the arguments' canonical JSON."""
    scope: Literal["tenant", "thread"] = "tenant"
    """Where a key is unique: the whole tenant, or one thread."""
    on_duplicate: Literal["replay", "block"] = "replay"
    """A repeated call gets the recorded result (replay) or an 'already done' answer (block)."""


class RetryPolicy(_Frozen):
    max_attempts: int = Field(default=3, ge=1)  # total tries, the first included
    """Provider attempts per request, the first included (429, 5xx, timeouts, connection errors)."""
    max_seconds: float = Field(default=30.0, gt=0)
    """No retry starts after this many seconds."""
    initial_backoff: float = Field(default=0.5, ge=0)
    """The first wait between attempts, growing exponentially with jitter (the provider's Retry-After wins)."""
    max_backoff: float = Field(default=8.0, ge=0)
    """The longest wait between attempts."""

    @field_validator("max_backoff")
    @classmethod
    def _backoff_ordered(cls, value: float, info: ValidationInfo) -> float:
        initial = info.data.get("initial_backoff")
        if initial is not None and value < initial:
            raise ValueError(f"{value:g} is below initial_backoff ({initial:g})")
        return value


class IdempotencyPolicy(_Frozen):
    retention_seconds: int = Field(default=86_400, gt=0)
    """How long an Idempotency-Key's stored answer is kept."""
    max_replays: int = Field(default=3, ge=0)
    """How many rounds a turn is continued upstream while the model only repeats calls the ledger withholds (answered with the recorded result)."""


class BackgroundPolicy(_Frozen):
    max_running: int = Field(default=16, ge=0)
    """Background responses (`background: true`) of this tenant running at once; one more is refused with a 429 until one ends (0: background mode is off)."""
    max_events: int = Field(default=100_000, gt=0)
    """Stream events kept per background response for resumption (`starting_after`); a stream that outgrows it ends `failed`."""


def _default_models() -> dict[str, ModelLimits]:
    return {"*": BUILTIN_LIMITS}


class Policy(_Frozen):
    tenant: Tenant
    """The tenant id; must equal the file name without .yaml."""
    api_keys: list[KeyHash] = Field(default_factory=list)
    """sha256 hex of the proxy keys that map to this tenant (never the keys)."""
    allow_unknown_keys: bool = False
    """Only in default.yaml: tokens that match no file are served as this tenant (passthrough mode, each key its own namespace)."""
    upstream: UpstreamPolicy = Field(default_factory=UpstreamPolicy)
    """Where requests go and with which key."""
    models: dict[str, ModelLimits] = Field(default_factory=_default_models)
    """Context window and output cap per model: exact name, then the longest prefix, then "*"."""
    budget: BudgetPolicy = Field(default_factory=BudgetPolicy)
    """The token budget: output reserve, margin, and how deep a cut goes."""
    memory: MemoryPolicy = Field(default_factory=MemoryPolicy)
    """What is kept verbatim, compressed and summarized when a thread outgrows its window."""
    compaction: CompactionPolicy = Field(default_factory=CompactionPolicy)
    """OpenAI's compaction API, served locally or passed through."""
    tools: dict[str, ToolPolicy] = Field(default_factory=dict)
    """Side-effecting tools, by function name."""
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    """Provider retries."""
    idempotency: IdempotencyPolicy = Field(default_factory=IdempotencyPolicy)
    """Idempotency-Key records and tool-result replays."""
    background: BackgroundPolicy = Field(default_factory=BackgroundPolicy)
    """Background responses (`background: true`): run by the proxy, polled, cancelled, resumed."""

    _source: str = PrivateAttr(default="")
    # models key -> its loaded tokenizer (tiktoken:, hf:, mistral:), by _load_tokenizers
    _tokenizers: dict[str, Tokenizer] = PrivateAttr(default_factory=dict)
    # model name -> the models key its requests read (_entry_for): asked several times a
    # request, and the policy is frozen. Model names come from clients: bounded.
    _entries: dict[str, str | None] = PrivateAttr(default_factory=dict)

    @field_validator("allow_unknown_keys")
    @classmethod
    def _unknown_keys_only_on_default(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("tenant", DEFAULT_TENANT) != DEFAULT_TENANT:
            raise ValueError(
                f"only has an effect in {DEFAULT_TENANT}.yaml"
                " (the tenant for tokens that match no file)"
            )
        return value

    @property
    def source(self) -> str:
        """The file this policy was read from (for error messages)."""
        return self._source or f"{self.tenant}.yaml"

    @property
    def side_effect_tools(self) -> dict[str, ToolPolicy]:
        """The tools the side-effect ledger guards (SPEC 6), by function name."""
        return {name: tool for name, tool in self.tools.items() if tool.side_effect}

    def limits_for(self, model: str) -> ModelLimits:
        """Exact name, then the longest key that prefixes it, then "*", then built-in.

        A fine-tuned model ("ft:gpt-4o-mini:org::id") or one with a provider prefix
        ("openai/gpt-4o") falls back to the entry of the plain model name.
        """
        key = self._entry_for(model)
        return self.models[key] if key is not None else BUILTIN_LIMITS

    def tokenizer_for(self, model: str) -> Tokenizer | None:
        """The tokenizer the model's entry names (the entry limits_for picks), loaded with
        the policy; None when the entry names none."""
        key = self._entry_for(model)
        return self._private()["_tokenizers"].get(key) if key is not None else None

    def counts_with_provider(self, model: str) -> bool:
        """Whether the model's entry says `tokenizer: provider` (proxy/server/model_budget.py)."""
        key = self._entry_for(model)
        return key is not None and self.models[key].tokenizer == PROVIDER_TOKENIZER

    def names_model(self, model: str) -> bool:
        """Whether an entry other than "*" matches the model (its window is then the
        policy's, whatever the provider lists)."""
        return self._entry_for(model) not in (None, "*")

    def _entry_for(self, model: str) -> str | None:
        entries: dict[str, str | None] = self._private()["_entries"]
        if model in entries:
            return entries[model]
        if len(entries) >= MAX_KEPT_ENTRIES:
            entries.clear()
        entry = entries[model] = self._find_entry(model)
        return entry

    def _private(self) -> dict[str, Any]:
        """The private attributes' values, read where pydantic keeps them. `self._entries`
        finds its value through BaseModel.__getattr__ after a failed lookup, which also
        asks the PrivateAttr for a `__get__`: two AttributeErrors raised, about 5 us, on
        a path that asks the policy about the model several times a request."""
        private = self.__pydantic_private__
        assert private is not None  # set by pydantic on every model with private attributes
        return private

    def _find_entry(self, model: str) -> str | None:
        for name in _model_names(model):
            if name in self.models:
                return name
            prefixes = [key for key in self.models if key != "*" and name.startswith(key)]
            if prefixes:
                return max(prefixes, key=len)
        return "*" if "*" in self.models else None

    def upstream_key(self, env: Mapping[str, str]) -> str | None:
        """The provider key from the configured env var; None = forward the client's own."""
        name = self.upstream.api_key_env
        if name is None:
            return None
        key = env.get(name, "").strip()
        if not key:
            raise PolicyError(
                self.source, "upstream.api_key_env", f"environment variable {name} is not set"
            )
        return key


def policy_schema() -> dict[str, Any]:
    """JSON Schema of a policy file, generated from the models that validate it, so an
    editor (yaml-language-server) checks a file as it is typed by the same rules."""
    schema = Policy.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "threadkeeper tenant policy",
        **{key: value for key, value in schema.items() if key != "title"},
    }


def _model_names(model: str) -> list[str]:
    names = [model]
    if model.startswith("ft:") and model.count(":") >= 2:
        names.append(model.split(":")[1])
    if "/" in model:
        names.append(model.rsplit("/", 1)[-1])
    return names


# -- loading one file ------------------------------------------------------------------------


def load_policy_file(path: Path) -> Policy:
    """The validated policy in `path`; any problem -> PolicyError(file, field, problem)."""
    return policy_from_text(path, _read_text(path))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(path, "(file)", f"cannot read: {exc}") from None


def policy_from_text(path: Path, text: str) -> Policy:
    """The policy in `text`; its first problem raises PolicyError."""
    policy, problems = policy_problems(path, text)
    if policy is None:
        raise problems[0]
    return policy


def policy_problems(path: Path, text: str) -> tuple[Policy | None, list[PolicyError]]:
    """The policy in `text`, or every problem with it, one per field (the tenant's first,
    then misspelt fields: they say what to fix)."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        return None, [PolicyError(path, "(yaml)", f"invalid YAML: {_one_line(str(exc))}")]
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        return None, [
            PolicyError(path, "(top level)", f"expected a mapping with tenant:, got {got}")
        ]
    problems = []
    if "tenant" not in data:
        problems.append(
            PolicyError(path, "tenant", f"required field is missing (tenant: {path.stem})")
        )
    elif data["tenant"] != path.stem:
        problems.append(
            PolicyError(
                path,
                "tenant",
                f"must equal the file name {path.stem!r}, got {shown(data['tenant'])}",
            )
        )
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        problems += _field_errors(path, exc)
    if problems:
        one_per_field: dict[str, PolicyError] = {}
        for problem in problems:
            one_per_field.setdefault(problem.field, problem)
        return None, list(one_per_field.values())
    policy._source = str(path)
    try:
        policy._tokenizers = _load_tokenizers(path, policy)
    except PolicyError as exc:
        return None, [exc]
    return policy, []


def _load_tokenizers(path: Path, policy: Policy) -> dict[str, Tokenizer]:
    """Every tokenizer the file names, read now (policy load runs at start and in a worker
    thread on reload), so a request never reads a tokenizer file."""
    loaded: dict[str, Tokenizer] = {}
    for key, limits in policy.models.items():
        spec = limits.tokenizer
        if spec is None or spec == PROVIDER_TOKENIZER:
            continue  # counted by the provider, over the o200k_base estimate
        try:
            if spec.startswith("tiktoken:"):
                loaded[key] = TiktokenVocabulary(get_encoding(spec.removeprefix("tiktoken:")))
            else:
                loaded[key] = load_native(spec, path.parent)
        except (TokenizerError, RuntimeError) as exc:  # RuntimeError: VocabularyError
            raise PolicyError(path, f"models.{key}.tokenizer", str(exc)) from None
    return loaded


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _field_errors(path: Path, exc: ValidationError) -> list[PolicyError]:
    errors = exc.errors(include_url=False)
    # A misspelt field is also a missing one: name the misspelling first, it says what to fix.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    return [
        PolicyError(path, _dotted(e["loc"]) or "(top level)", _problem(e, e["loc"])) for e in errors
    ]


def _dotted(loc: tuple[int | str, ...]) -> str:
    """("memory", "pin_patterns", 0) -> "memory.pin_patterns[0]"."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part != "[key]":
            text += f".{part}" if text else str(part)
    return text


def _problem(error: Any, loc: tuple[int | str, ...]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return _unknown_field_problem(loc)
    if kind == "missing":
        return "required field is missing"
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind in ("value_error", "assertion_error"):
        return message
    return f"{message} (got {shown(error.get('input'))})"


def _unknown_field_problem(loc: tuple[int | str, ...]) -> str:
    allowed = _allowed_fields(loc[:-1])
    problem = "unknown field"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        problem += f"; did you mean {close[0]!r}?"
    return f"{problem} (allowed: {', '.join(allowed)})" if allowed else problem


def _allowed_fields(loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the model found by walking `loc` down from Policy."""
    annotation: Any = Policy
    for part in loc:
        annotation = _child_annotation(annotation, part)
    model = _model_in(annotation)
    return list(model.model_fields) if model else []


def _child_annotation(annotation: Any, part: int | str) -> Any:
    model = _model_in(annotation)
    if model is not None:
        info = model.model_fields.get(str(part))
        return info.annotation if info else None
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is dict and len(args) == 2:
        return args[1]
    if origin is list and args:
        return args[0]
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None


# -- the registry ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Loaded:
    """One file's last good policy and what it looked like when read."""

    policy: Policy
    mtime_ns: int
    size: int
    digest: str
    read_at: float  # wall clock of the read, for the racy-stat check


@dataclass(frozen=True)
class _Snapshot:
    """Everything a request reads, swapped as one object so it never sees half a reload."""

    files: dict[Path, _Loaded] = field(default_factory=dict)
    by_tenant: dict[str, Policy] = field(default_factory=dict)
    by_key: dict[str, Policy] = field(default_factory=dict)
    # digests of contents that failed, so an unchanged bad file is not reported every pass
    failed: dict[Path, str] = field(default_factory=dict)


# A file whose mtime is this close to when it was read may have been rewritten within the
# same filesystem timestamp tick, so its unchanged stat proves nothing (git's "racy" rule).
RACY_SECONDS = 2.0


class PolicyRegistry:
    """All tenant policies of one directory, hot-reloaded."""

    def __init__(self, directory: Path, snapshot: _Snapshot) -> None:
        self.directory = directory
        self._snapshot = snapshot
        self._reloading = threading.Lock()  # reload() may run in a worker thread

    @classmethod
    def load(cls, directory: Path) -> PolicyRegistry:
        """Every *.yaml / *.yml in `directory`; the first problem raises PolicyError."""
        snapshot, errors = _load_directory(directory)
        if errors:
            raise errors[0]
        return cls(directory, snapshot)

    def resolve(self, token: str | None) -> Policy | None:
        """The tenant listing sha256(token); else default.yaml if it allows unknown keys."""
        snapshot = self._snapshot
        if token:
            policy = snapshot.by_key.get(hash_key(token))
            if policy is not None:
                return policy
        default = snapshot.by_tenant.get(DEFAULT_TENANT)
        return default if default is not None and default.allow_unknown_keys else None

    def get(self, tenant: str) -> Policy | None:
        return self._snapshot.by_tenant.get(tenant)

    def tenants(self) -> list[str]:
        return sorted(self._snapshot.by_tenant)

    def reload(self) -> list[PolicyError]:
        """Re-read changed, new and removed files; errors are logged and returned, never raised.

        A file that fails keeps its last good policy; the same bad content is reported once.
        """
        with self._reloading:
            return self._reload()

    def _reload(self) -> list[PolicyError]:
        old = self._snapshot
        try:
            paths = _policy_paths(self.directory)
        except PolicyError as exc:
            _log_errors([exc])
            return [exc]
        files: dict[Path, _Loaded] = {}
        failed: dict[Path, str] = {}
        errors: list[PolicyError] = []
        for path in paths:
            loaded, error, digest = _reloaded(path, old.files.get(path), old.failed.get(path))
            if loaded is not None:
                files[path] = loaded
            if digest is not None:
                failed[path] = digest
            if error is not None:
                errors.append(error)
        snapshot, conflicts = _snapshot_of(files, old.files)
        for conflict in conflicts:  # report a clash once, like a parse error
            failed[Path(conflict.file)] = files[Path(conflict.file)].digest
        self._snapshot = _Snapshot(snapshot.files, snapshot.by_tenant, snapshot.by_key, failed)
        errors += conflicts
        _log_changes(old, self._snapshot)
        _log_errors(errors, self._snapshot.files)
        return errors

    async def watch(self, interval: float, clock: Clock = SYSTEM_CLOCK) -> None:
        """Reload every `interval` seconds until cancelled (a task in the app's cleanup_ctx)."""
        await every("policy_reload", interval, lambda: asyncio.to_thread(self.reload), clock)


def check_directory(directory: Path) -> tuple[list[str], list[PolicyError]]:
    """The tenants a directory defines and every problem in it: every field of every file
    (what `threadkeeper policy check` reports, so CI shows them all at once)."""
    files: dict[Path, _Loaded] = {}
    errors: list[PolicyError] = []
    for path in _policy_paths(directory):
        try:
            raw = _read_text(path)
        except PolicyError as exc:
            errors.append(exc)
            continue
        policy, problems = policy_problems(path, raw)
        errors += problems
        if policy is not None:
            digest = hashlib.sha256(raw.encode("utf-8")).hexdigest()
            files[path] = _restamped(policy, path.stat(), digest)
    snapshot, conflicts = _snapshot_of(files, {})
    return sorted(snapshot.by_tenant), errors + conflicts


def _load_directory(directory: Path) -> tuple[_Snapshot, list[PolicyError]]:
    files: dict[Path, _Loaded] = {}
    errors: list[PolicyError] = []
    for path in _policy_paths(directory):
        loaded, error, _ = _reloaded(path, None, None)
        if error is not None:
            errors.append(error)
        elif loaded is not None:
            files[path] = loaded
    snapshot, conflicts = _snapshot_of(files, {})
    return snapshot, errors + conflicts


def _policy_paths(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise PolicyError(directory, "(directory)", "policies directory does not exist")
    return sorted(
        path
        for path in directory.iterdir()
        if path.suffix in POLICY_SUFFIXES and not path.name.startswith(".") and path.is_file()
    )


def _reloaded(
    path: Path, previous: _Loaded | None, failed_digest: str | None
) -> tuple[_Loaded | None, PolicyError | None, str | None]:
    """(policy to keep, new error to report, digest of still-failing content) for one file."""
    try:
        stat = path.stat()
        if previous is not None and failed_digest is None and _unchanged(previous, stat):
            return previous, None, None
        raw = _read_text(path)
    except FileNotFoundError:  # removed since the directory was listed
        return None, None, None
    except PolicyError as exc:
        return previous, exc, None
    digest = hashlib.sha256(raw.encode("utf-8")).hexdigest()
    if previous is not None and digest == previous.digest:
        return _restamped(previous.policy, stat, digest), None, None
    if digest == failed_digest:
        return previous, None, digest
    try:
        policy = policy_from_text(path, raw)
    except PolicyError as exc:
        return previous, exc, digest
    return _restamped(policy, stat, digest), None, None


def _restamped(policy: Policy, stat: Any, digest: str) -> _Loaded:
    return _Loaded(policy, stat.st_mtime_ns, stat.st_size, digest, time.time())


def _unchanged(previous: _Loaded, stat: Any) -> bool:
    racy = stat.st_mtime_ns / 1e9 >= previous.read_at - RACY_SECONDS
    return not racy and (stat.st_mtime_ns, stat.st_size) == (previous.mtime_ns, previous.size)


def _snapshot_of(
    files: dict[Path, _Loaded], last_good: Mapping[Path, _Loaded]
) -> tuple[_Snapshot, list[PolicyError]]:
    """Index the files by tenant and key hash.

    A key (or tenant name) someone already holds stays theirs: files that kept their last
    good policy go first, then edited files, then new ones, and a key its holder still
    lists is reserved for it whatever the order. The file that claims it is the one
    rejected, so the holder is never dropped by another file's edit.
    """
    kept = [path for path in files if _same_policy(files[path], last_good.get(path))]
    edited = [path for path in files if path not in kept and path in last_good]
    ordered = kept + edited + [path for path in files if path not in last_good]
    held = _held_keys(files, last_good)
    accepted: dict[Path, _Loaded] = {}
    by_tenant: dict[str, Policy] = {}
    by_key: dict[str, Policy] = {}
    errors: list[PolicyError] = []
    for path in ordered:
        for candidate in _candidates(files[path], last_good.get(path)):
            error = _conflict(path, candidate.policy, by_tenant, by_key, held)
            if error is None:
                accepted[path] = candidate
                by_tenant[candidate.policy.tenant] = candidate.policy
                by_key.update(dict.fromkeys(candidate.policy.api_keys, candidate.policy))
                break
            if candidate is files[path]:
                errors.append(error)
    return _Snapshot(accepted, by_tenant, by_key), errors


def _held_keys(
    files: Mapping[Path, _Loaded], last_good: Mapping[Path, _Loaded]
) -> dict[str, Policy]:
    """Keys a tenant held before this reload and its file still lists: only it may list
    them now."""
    held: dict[str, Policy] = {}
    for path, previous in last_good.items():
        current = files.get(path)
        if current is None or current.policy.tenant != previous.policy.tenant:
            continue
        for key in set(previous.policy.api_keys) & set(current.policy.api_keys):
            held[key] = previous.policy
    return held


def _same_policy(loaded: _Loaded, previous: _Loaded | None) -> bool:
    return previous is not None and previous.policy is loaded.policy


def _candidates(new: _Loaded, previous: _Loaded | None) -> list[_Loaded]:
    return [new] if previous is None or _same_policy(new, previous) else [new, previous]


def _conflict(
    path: Path,
    policy: Policy,
    by_tenant: Mapping[str, Policy],
    by_key: Mapping[str, Policy],
    held: Mapping[str, Policy],
) -> PolicyError | None:
    if policy.tenant in by_tenant:
        other = by_tenant[policy.tenant].source
        return PolicyError(path, "tenant", f"tenant {policy.tenant!r} is also defined by {other}")
    for index, key in enumerate(policy.api_keys):
        owner = by_key.get(key) or held.get(key)
        if owner is not None and owner.tenant != policy.tenant:
            return PolicyError(
                path,
                f"api_keys[{index}]",
                f"key already belongs to tenant {owner.tenant!r} ({owner.source})",
            )
    return None


def _log_changes(old: _Snapshot, new: _Snapshot) -> None:
    for tenant, policy in new.by_tenant.items():
        if old.by_tenant.get(tenant) is not policy:
            log.info("policy loaded", tenant=tenant, file=policy.source)
    for tenant in old.by_tenant.keys() - new.by_tenant.keys():
        log.info("policy removed", tenant=tenant)


def _log_errors(errors: list[PolicyError], in_force: Mapping[Path, _Loaded] | None = None) -> None:
    """`in_force`: the files serving after the reload; a rejected file not among them
    (a new file) has no last good policy, and the log says so."""
    for error in errors:
        kept = in_force is None or Path(error.file) in in_force
        log.error(
            "policy rejected; last good policy stays in force"
            if kept
            else "policy rejected; file not loaded",
            file=error.file,
            field=error.field,
            problem=error.problem,
        )
