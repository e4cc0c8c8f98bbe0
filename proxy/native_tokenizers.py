"""Model-native tokenizers named by a policy's `tokenizer:` field, loaded at the edge.

    tokenizer = load_native("hf:/models/Qwen2.5-7B-Instruct", base=Path("policies"))
    TokenCounter("Qwen/Qwen2.5-7B-Instruct", tokenizer).text("hello")

`hf:<path>` reads a Hugging Face `tokenizer.json` (or a model directory holding one) with
the `tokenizers` library, and the chat template beside it (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`), rendered in jinja2's sandbox to measure what
the template adds per message, per prompt and for tools. `mistral:<version>` takes one of
the tokenizers `mistral-common` ships as package data and measures its chat format the
same way with mistral-common's own encoder. Nothing is ever downloaded: a path that does
not exist or a version that is not shipped is a `TokenizerError`, which policy loading
turns into an error naming the file and the field.

A Mistral API model name whose policy entry names no tokenizer (`mistral-large-2407`,
`open-mistral-nemo`, `codestral-latest`...) counts with the tokenizer mistral-common maps
its release to (`mistral_default`): an explicit `tokenizer:` always wins.

The core (proxy/core/tokens.py) gets a `NativeTokenizer`: a name that identifies the
tokenizer's content (so cached and stored counts never mix tokenizers), a counting
function and the measured costs.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from proxy.core.tokens import (
    DEFAULT_TEMPLATE_COST,
    NativeTokenizer,
    TemplateCost,
    measure_template,
)

log = structlog.get_logger(__name__)

HF_PREFIX = "hf:"
MISTRAL_PREFIX = "mistral:"

# mistral-common's shipped tokenizers by the version a policy names (MistralTokenizer.vN).
MISTRAL_VERSIONS: Mapping[str, tuple[str, Mapping[str, bool]]] = {
    "v1": ("v1", {}),
    "v2": ("v2", {}),
    "v3": ("v3", {}),
    "v3-tekken": ("v3", {"is_tekken": True}),
    "v7": ("v7", {}),
}


class TokenizerError(ValueError):
    """A `tokenizer:` value names nothing usable; str() says what to fix."""


_loaded: dict[tuple[str, ...], NativeTokenizer] = {}
_loaded_lock = threading.Lock()


def load_native(spec: str, base: Path) -> NativeTokenizer:
    """The tokenizer `spec` names (`hf:<path>` relative to `base`, or `mistral:<version>`),
    built once per process and content (a policy reload that changed nothing else reuses
    it; an edited tokenizer file is read again)."""
    if spec.startswith(HF_PREFIX):
        return _hf(_hf_paths(spec.removeprefix(HF_PREFIX), base))
    if spec.startswith(MISTRAL_PREFIX):
        return _mistral(spec.removeprefix(MISTRAL_PREFIX))
    raise TokenizerError(f"not a native tokenizer: {spec!r}")


def _cached(key: tuple[str, ...], build: Callable[[], NativeTokenizer]) -> NativeTokenizer:
    with _loaded_lock:
        found = _loaded.get(key)
    if found is not None:
        return found
    made = build()
    with _loaded_lock:
        return _loaded.setdefault(key, made)


# -- hf: -------------------------------------------------------------------------------------


def _hf_paths(given: str, base: Path) -> tuple[Path, Path]:
    """(tokenizer.json, the directory its template files sit in)."""
    if not given.strip():
        raise TokenizerError("hf: needs a path to tokenizer.json or a model directory")
    path = Path(given).expanduser()
    if not path.is_absolute():
        path = base / path
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{path} does not exist (hf: takes a tokenizer.json or a model directory holding"
            " one, relative to the policy file; nothing is downloaded)"
        )
    return path, path.parent


def _hf(paths: tuple[Path, Path]) -> NativeTokenizer:
    tokenizer_file, directory = paths
    try:
        stamp = tuple(
            f"{p}:{p.stat().st_mtime_ns}:{p.stat().st_size}"
            for p in (
                tokenizer_file,
                directory / "tokenizer_config.json",
                directory / "chat_template.jinja",
            )
            if p.is_file()
        )
    except OSError as exc:
        raise TokenizerError(f"cannot read {tokenizer_file}: {exc}") from None
    return _cached(("hf", *stamp), lambda: _build_hf(tokenizer_file, directory))


def _build_hf(tokenizer_file: Path, directory: Path) -> NativeTokenizer:
    from tokenizers import Tokenizer as HfTokenizer

    try:
        contents = tokenizer_file.read_bytes()
        tokenizer = HfTokenizer.from_str(contents.decode("utf-8"))
    except Exception as exc:  # OSError, UnicodeDecodeError, or tokenizers' bare Exception
        raise TokenizerError(f"{tokenizer_file} is not a tokenizers file: {exc}") from None
    # A file saved for training may truncate or pad: a count must see the whole text.
    tokenizer.no_truncation()
    tokenizer.no_padding()

    def count(text: str) -> int:
        return len(tokenizer.encode(_encodable(text), add_special_tokens=False).ids)

    template, config = _chat_template(directory)
    digest = hashlib.sha256(contents)
    digest.update((template or "").encode("utf-8", "surrogatepass"))
    name = f"hf:{digest.hexdigest()[:16]}"
    if template is None:
        log.info("tokenizer_without_chat_template", file=str(tokenizer_file))
        return NativeTokenizer(name, count, DEFAULT_TEMPLATE_COST)
    return NativeTokenizer(name, count, _template_cost(template, config, count, tokenizer_file))


def _chat_template(directory: Path) -> tuple[str | None, Mapping[str, Any]]:
    """The template and the config it reads (bos_token...): chat_template.jinja wins over
    tokenizer_config.json, as in transformers."""
    config: Mapping[str, Any] = {}
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise TokenizerError(f"{config_file} is not valid JSON: {exc}") from None
        config = loaded if isinstance(loaded, dict) else {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), config
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), config


def _template_cost(
    template: str, config: Mapping[str, Any], count: Callable[[str], int], source: Path
) -> TemplateCost:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    # The environment transformers' apply_chat_template renders with.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    special = {key: _token_text(config.get(key)) for key in SPECIAL_TOKENS}
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template of {source} does not parse: {exc}") from None

    def render_count(
        messages: Sequence[Mapping[str, Any]], generation: bool, tools: Sequence[Mapping[str, Any]]
    ) -> int:
        text = compiled.render(
            messages=list(messages),
            add_generation_prompt=generation,
            tools=list(tools) or None,
            **special,
        )
        return count(text)

    try:
        return measure_template(render_count, count)
    except Exception as exc:  # a template may raise on anything; the count must still work
        log.warning("chat_template_not_measured", file=str(source), error=str(exc))
        return DEFAULT_TEMPLATE_COST


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str:
    """tokenizer_config.json spells a special token as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _encodable(text: str) -> str:
    """Lone surrogates cannot cross into Rust or C++; each counts as one replacement."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


# -- mistral: --------------------------------------------------------------------------------


def _mistral(version: str) -> NativeTokenizer:
    if version not in MISTRAL_VERSIONS:
        known = ", ".join(MISTRAL_VERSIONS)
        raise TokenizerError(f"unknown mistral version {version!r} (shipped: {known})")
    return _cached(("mistral", version), lambda: _build_mistral(version))


def _build_mistral(version: str) -> NativeTokenizer:
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    method, options = MISTRAL_VERSIONS[version]
    try:
        mistral = getattr(MistralTokenizer, method)(**options)
    except Exception as exc:  # e.g. sentencepiece missing for the non-tekken versions
        raise TokenizerError(f"mistral-common cannot load {version}: {exc}") from None
    return _mistral_native(version, mistral)


def _mistral_native(version: str, mistral: Any) -> NativeTokenizer:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    text_tokenizer = mistral.instruct_tokenizer.tokenizer

    def count(text: str) -> int:
        return len(text_tokenizer.encode(_encodable(text), bos=False, eos=False))

    def render_count(
        messages: Sequence[Mapping[str, Any]], _generation: bool, tools: Sequence[Mapping[str, Any]]
    ) -> int:
        # mistral-common always ends a prompt ready for the answer: no generation flag.
        request: Any = ChatCompletionRequest.model_validate(
            {"messages": list(messages), "tools": list(tools) or None}
        )
        return len(mistral.encode_chat_completion(request).tokens)

    return NativeTokenizer(f"mistral:{version}", count, measure_template(render_count, count))


# -- Mistral model names ---------------------------------------------------------------------

# The API's model families (mistral-common's table names releases of these). A cheap test
# first: the table itself is behind a heavy import, off the event loop.
MISTRAL_FAMILIES = (
    "mistral-",
    "open-mistral-",
    "open-mixtral-",
    "mixtral-",
    "ministral-",
    "pixtral-",
    "codestral-",
)
# A release's date (mistral-large-2407) or the API's alias for the newest one (-latest).
_RELEASE_SUFFIX = re.compile(r"-(?:(\d{4})|latest)$")
_MAX_DEFAULTS = 1024  # model names come from clients: a bounded map
_defaults: dict[str, NativeTokenizer | None] = {}


def _api_name(model: str) -> str:
    return model.rsplit("/", 1)[-1].lower()  # a provider prefix (mistralai/...) aside


def is_mistral_name(model: str) -> bool:
    """Whether `model` looks like a Mistral API model name (`mistral_default` then tells)."""
    return _api_name(model).startswith(MISTRAL_FAMILIES)


def mistral_default_known(model: str) -> tuple[bool, NativeTokenizer | None]:
    """(True, `mistral_default(model)`) when that is a dictionary lookup; (False, None)
    while it would still import or load something."""
    with _loaded_lock:
        if model in _defaults:
            return True, _defaults[model]
    return False, None


def mistral_default(model: str) -> NativeTokenizer | None:
    """The tokenizer mistral-common maps a Mistral API model name to, as the
    `mistral:<version>` a policy could name; None for a name it does not know (the model
    keeps the estimate and its calibration) or a tokenizer it cannot load (logged).
    Imports and loads on first use: not on the event loop."""
    found, native = mistral_default_known(model)
    if found:
        return native
    release = mistral_release(model)
    version = _release_version(release) if release is not None else None
    native = _mistral(version) if version is not None else None
    with _loaded_lock:
        if len(_defaults) >= _MAX_DEFAULTS:
            _defaults.clear()
        _defaults[model] = native
    return native


def mistral_release(model: str) -> str | None:
    """The release in mistral-common's table that `model` names: the release itself
    (`mistral-large-2407`), or, for a family's alias (`mistral-large-latest`,
    `mistral-large`) or a release the table does not list (`mistral-large-2501`), the
    family's latest listed release at or before that date (else its first). None: not a
    family the table knows (`open-mistral-7b`, or a Hugging Face repository name such as
    `Mistral-7B-Instruct-v0.3`, which a policy names with `hf:` or `mistral:<version>`)."""
    try:
        from mistral_common.tokens.tokenizers.mistral import MODEL_NAME_TO_TOKENIZER_CLS
    except ImportError:  # a mistral-common without the table
        return None
    name = _api_name(model)
    if name in MODEL_NAME_TO_TOKENIZER_CLS:
        return name
    match = _RELEASE_SUFFIX.search(name)
    family = name[: match.start()] if match else name
    date = match.group(1) if match and match.group(1) else "9999"
    dated = sorted(
        (when, release)
        for release in MODEL_NAME_TO_TOKENIZER_CLS
        for stem, _, when in [release.rpartition("-")]
        if stem == family and when.isdigit()
    )
    earlier = [release for when, release in dated if when <= date]
    if earlier:
        return earlier[-1]
    return dated[0][1] if dated else None


_versions: dict[str, str | None] = {}  # release -> MISTRAL_VERSIONS key (a fixed table)


def _release_version(release: str) -> str | None:
    """The MISTRAL_VERSIONS key of the tokenizer the table builds for `release` (built
    once; its loaded tokenizer is kept for that version)."""
    if release in _versions:
        return _versions[release]
    from mistral_common.tokens.tokenizers.mistral import MODEL_NAME_TO_TOKENIZER_CLS
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    version: str | None
    try:
        mistral = MODEL_NAME_TO_TOKENIZER_CLS[release]()
    except Exception as exc:  # sentencepiece missing, an entry that no longer loads
        log.warning("mistral_default_unavailable", release=release, error=str(exc))
        version = None
    else:
        text_tokenizer = mistral.instruct_tokenizer.tokenizer
        version = text_tokenizer.version.value
        if isinstance(text_tokenizer, Tekkenizer):
            version = f"{version}-tekken"
        if version in MISTRAL_VERSIONS:
            _cached(("mistral", version), lambda: _mistral_native(str(version), mistral))
        else:
            log.warning("mistral_default_unavailable", release=release, version=version)
            version = None
    _versions[release] = version
    return version
