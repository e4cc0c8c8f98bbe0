"""The policy reference (docs/policy.md), generated from the policy JSON Schema, which is
generated from the pydantic models that validate policy files: the reference cannot drift
from what the loader accepts (tests/test_docs.py compares the file with this output).

    threadkeeper policy schema --markdown > docs/policy.md
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from proxy.policy import policy_schema

INTRO = """\
# Policy reference

One YAML file per tenant in the policies directory, named `<tenant>.yaml`. Every field
but `tenant` is optional. `threadkeeper policy check DIR` validates a directory the way
`serve` does and lists every problem as file, field and problem. `threadkeeper policy
schema` prints the JSON Schema, for editors that validate YAML as you type: with the YAML
language server, put `# yaml-language-server: $schema=policy.schema.json` at the top of a
policy file.

**Token counting** (`models.<name>.tokenizer`). OpenAI model names count exactly with
their tiktoken encoding; any other name counts with `o200k_base`, an estimate that can be
10-40% off for Llama, Qwen or Mistral models once their vocabulary and chat template are
counted. Name the model's own tokenizer to count what its provider counts:
`hf:<dir>` reads `tokenizer.json` from a model directory on disk (what vLLM and SGLang
serve from; a relative path is relative to the policy file) and measures its chat
template's cost per message, per prompt and for tools by rendering it (jinja2, sandboxed;
`chat_template.jinja`, else `tokenizer_config.json`). Without a template, or with one
that cannot render a plain conversation, the cost is 5 tokens per message, 5 per prompt
and 10 for a request's tools. `mistral:<version>` (v1, v2, v3, v3-tekken, v7) uses the
tokenizers `mistral-common` ships. `tiktoken:<encoding>` (o200k_base, cl100k_base) names
an OpenAI encoding for any model name. Nothing is downloaded: a missing path or an
unknown version refuses the file at load. `provider` asks the provider itself: vLLM's
and SGLang's `POST /tokenize` for Chat items, `POST /v1/responses/input_tokens` for
Responses items, each item once (cached by content digest), waiting at most
`upstream.count_timeout_seconds` per turn; a provider without the endpoint (404, or an
answer that is not a count) is never asked again, and the calibrated estimate counts
what it cannot tell.

This page is generated from that schema (`threadkeeper policy schema --markdown`).
`<name>` stands for a key you choose (a model name, a tool name); `[]` for the items of a
list.

| field | type | default | allowed | what it does |
|---|---|---|---|---|
"""


def policy_reference() -> str:
    schema = policy_schema()
    rows = [_row(path, field) for path, field in _fields(schema, schema, "")]
    return INTRO + "".join(rows)


def _fields(
    node: Mapping[str, Any], schema: Mapping[str, Any], prefix: str
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for name, field in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        resolved = _resolve(field, schema)
        target = _object_of(resolved, schema)
        if target is not None and "properties" in target:
            yield path, {**resolved, "type": "object"}
            yield from _fields(target, schema, f"{path}.")
            continue
        values = resolved.get("additionalProperties")
        if isinstance(values, Mapping):
            yield path, resolved
            inner = _resolve(values, schema)
            if "properties" in inner:
                yield from _fields(inner, schema, f"{path}.<name>.")
            continue
        yield path, resolved


def _resolve(field: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = field.get("$ref")
    if isinstance(ref, str):
        target = schema["$defs"][ref.rsplit("/", 1)[-1]]
        return {**target, **{k: v for k, v in field.items() if k != "$ref"}}
    return field


def _object_of(field: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object schema a field holds, also when it may be null (anyOf [obj, null])."""
    if "properties" in field:
        return field
    for option in field.get("anyOf", ()):
        resolved = _resolve(option, schema)
        if "properties" in resolved:
            return resolved
    return None


def _row(path: str, field: Mapping[str, Any]) -> str:
    cells = (
        f"`{path}`",
        _type(field),
        _default(field),
        _allowed(field),
        " ".join(str(field.get("description", "")).split()),
    )
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n"


def _type(field: Mapping[str, Any]) -> str:
    if "anyOf" in field:
        return " or ".join(_type(option) for option in field["anyOf"])
    if "$ref" in field:  # a nested model, e.g. an optional section (anyOf [model, null])
        return "object"
    kind = field.get("type", "")
    if kind == "array":
        return f"list of {_type(field.get('items', {})) or 'values'}"
    if kind == "object" and isinstance(field.get("additionalProperties"), Mapping):
        return "map"
    return str(kind) if kind else ("object" if "properties" in field else "")


def _default(field: Mapping[str, Any]) -> str:
    if "default" not in field:
        return ""
    return f"`{json.dumps(field['default'], ensure_ascii=False)}`"


def _allowed(field: Mapping[str, Any]) -> str:
    parts = []
    if "enum" in field:
        parts.append(" or ".join(f"`{value}`" for value in field["enum"]))
    for key, sign in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
    ):
        if key in field:
            parts.append(f"{sign} {field[key]}")
    if "pattern" in field:
        parts.append(f"matches `{field['pattern']}`")
    for option in field.get("anyOf", ()):
        allowed = _allowed(option)
        if allowed:
            parts.append(allowed)
    return ", ".join(parts)
