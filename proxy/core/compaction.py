"""OpenAI's compaction served for any provider (SPEC 1; issue 10, item 5).

A compaction stands for the items of a conversation before it, except the user's own
messages (kept verbatim beside it) and instructions. OpenAI's `encrypted_content` is
opaque; threadkeeper's is its own authenticated encryption of the structured summary:

    blob = "tkc1." + base64url(nonce || AES-256-GCM(summary JSON, associated data = tenant))

The tenant is the associated data, so a blob of one tenant does not open for another;
any changed byte fails the tag. The nonce is derived from the plaintext (HMAC under a
subkey), so the same summary of the same tenant always gives the same bytes and the same
item id: a client that checks the id, and the provider's prompt cache, see no change.
Equal blobs reveal equal summaries, which is what a stable id promises anyway.

The sealed summary is {"format": "memory", "state": memory.to_json(state)} (`summary_of`),
whether the deterministic extractor wrote the state or the LLM summarizer did (its
guarded `Written.state` is the same form; proxy/server/compaction.py asks for it with a
`Plan`: what the summary is written of and the state it follows).

Everything here is pure: the key comes from the edge (proxy/server/compaction.py).

>>> key = CompactionKey(bytes(32))
>>> blob = key.seal("acme", {"format": "memory", "state": {"count": 1}})
>>> key.open("acme", blob)["state"]
{'count': 1}
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from proxy.core import memory
from proxy.core.items import (
    Item,
    JsonDict,
    canonical_bytes,
    content_digest,
    is_pending_approval,
    pending_approvals,
)
from proxy.core.llm_summary import WHOLE
from proxy.core.memory import SUMMARY_MARKER, is_summary, summary_item
from proxy.core.tokens import TokenCounter

BLOB_PREFIX = "tkc1."
KEY_BYTES = 32
NONCE_BYTES = 12
# The longest encrypted_content OpenAI's spec accepts (CompactionSummaryItemParam).
MAX_BLOB_CHARS = 20_971_520
# Room the summary of one compaction gets (the digest keeps the most important first).
SUMMARY_TOKENS = 2000
MEMORY_FORMAT = "memory"


class CompactionError(ValueError):
    """An encrypted_content this tenant cannot open: str() says why, for the client's 400."""


class CompactionKey:
    """The proxy's compaction key: one 32-byte secret, three subkeys derived from it
    (encryption, nonce, item id), so none of them is used for two purposes."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a compaction key is {KEY_BYTES} bytes, not {len(secret)}")
        self._aead = AESGCM(_subkey(secret, b"encrypt"))
        self._nonce_key = _subkey(secret, b"nonce")
        self._id_key = _subkey(secret, b"item-id")

    def seal(self, tenant: str, summary: JsonDict) -> str:
        """The encrypted_content of `summary` for `tenant` (the same bytes every time)."""
        plain = canonical_bytes(summary)
        nonce = _mac(self._nonce_key, tenant, plain)[:NONCE_BYTES]
        sealed = self._aead.encrypt(nonce, plain, tenant.encode("utf-8", "surrogatepass"))
        return BLOB_PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def open(self, tenant: str, blob: Any) -> JsonDict:
        """The summary sealed in `blob` for `tenant`; CompactionError when it is not one."""
        if not isinstance(blob, str):
            raise CompactionError("encrypted_content must be a string.")
        if not blob.startswith(BLOB_PREFIX):
            raise CompactionError(
                "This compaction was not created by this proxy (its encrypted_content is "
                "not threadkeeper's); compact the conversation again through the proxy."
            )
        if len(blob) > MAX_BLOB_CHARS:
            raise CompactionError("encrypted_content is too long.")
        data = _strict_b64decode(blob[len(BLOB_PREFIX) :])
        nonce, sealed = data[:NONCE_BYTES], data[NONCE_BYTES:]
        try:
            plain = self._aead.decrypt(nonce, sealed, tenant.encode("utf-8", "surrogatepass"))
        except (InvalidTag, ValueError):
            raise CompactionError(
                "encrypted_content could not be verified: it was changed, or it belongs to "
                "another organization or key."
            ) from None
        summary = json.loads(plain)
        if not isinstance(summary, dict) or not isinstance(summary.get("format"), str):
            raise CompactionError("encrypted_content holds no compaction summary.")
        return summary

    def item_id(self, tenant: str, summary: JsonDict) -> str:
        """The compaction item's id: derived from the tenant and the summary (stable)."""
        return "cmp_" + _mac(self._id_key, tenant, canonical_bytes(summary)).hex()[:40]

    def item(self, tenant: str, summary: JsonDict) -> JsonDict:
        """The compaction item OpenAI's clients receive and send back."""
        return {
            "id": self.item_id(tenant, summary),
            "type": "compaction",
            "encrypted_content": self.seal(tenant, summary),
        }


def _strict_b64decode(text: str) -> bytes:
    """The bytes `text` encodes, when it is exactly what `seal` writes for them: the
    URL-safe alphabet, canonical padding and zero pad bits, nothing before or after.
    Lenient decoding takes `blob + "===="`, spaces, newlines or "+/" for the same bytes,
    so one summary would have many accepted spellings (issue 20, item 9)."""
    try:
        raw = text.encode("ascii")
        data = base64.b64decode(raw, altchars=b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise CompactionError("encrypted_content is not valid base64.") from None
    if base64.urlsafe_b64encode(data) != raw:
        raise CompactionError("encrypted_content is not valid base64.")
    return data


def _subkey(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"threadkeeper-compaction\x00" + purpose, hashlib.sha256).digest()


def _mac(key: bytes, tenant: str, data: bytes) -> bytes:
    message = tenant.encode("utf-8", "surrogatepass") + b"\x00" + data
    return hmac.new(key, message, hashlib.sha256).digest()


# -- the summary ---------------------------------------------------------------------------


def compaction_summary(
    items: Sequence[Item], previous: JsonDict | None = None, earlier: Sequence[Item] = ()
) -> JsonDict:
    """The deterministic structured summary a compaction seals: the memory state
    (proxy/core/memory.py) of `items`, on top of the `previous` compaction's and of
    `earlier` summaries read back from their text (a compaction a stored chain holds
    expanded). `render_summary` writes the text the provider reads. The state is whole
    (nothing is dropped to fit): the budget applies when rendering."""
    return summary_of(memory.extract(items, base_state(previous, earlier)))


def summary_of(state: memory.MemoryState) -> JsonDict:
    """The one shape a compaction seals, whoever wrote the state (the deterministic
    extractor, or the LLM summarizer through proxy/core/llm_summary.py, whose `Written.
    state` is the same `memory.to_json` form): {"format": "memory", "state": ...}."""
    return {"format": MEMORY_FORMAT, "state": json.loads(memory.to_json(state))}


def base_state(
    previous: JsonDict | None, earlier: Sequence[Item] = ()
) -> memory.MemoryState | None:
    """The state a compaction's items follow: the `previous` compaction's, with the
    `earlier` summaries (parsed back from their text) merged in; None when neither."""
    state = memory.from_json(previous["state"]) if previous is not None else None
    for summary in earlier:
        parsed = memory.parse(summary.text())
        state = parsed if state is None else memory.merge(state, parsed)
    return state


@dataclass(frozen=True)
class Plan:
    """A compaction at `end` before its summary is written: the indexes it covers, the
    items its summary is written of (the covered ones that are not summaries), and the
    state they follow (`previous` and the summaries among the covered items)."""

    end: int
    gone: tuple[int, ...]
    items: tuple[Item, ...]
    base: memory.MemoryState | None

    def summary(self, written: Mapping[str, Any] | None = None) -> JsonDict:
        """What this compaction seals: `written`, a state the LLM summarizer wrote (its
        guarded `Written.state`), when it reads as one; else the deterministic state."""
        if written is not None:
            try:
                return summary_of(memory.from_json(written))
            except (ValueError, TypeError):
                pass
        return summary_of(memory.extract(self.items, self.base))

    def previous_item(self, counter: TokenCounter) -> Item | None:
        """The base state as the summary the LLM is asked to carry forward (whole)."""
        if self.base is None:
            return None
        return summary_message(memory.render(self.base, counter, WHOLE))

    def digest(self, max_tokens: int) -> str:
        """The key of an LLM summary of this plan: what it is written of, what it
        follows, and its limit (a domain of its own: never a projection chunk's key)."""
        base = memory.to_json(self.base) if self.base is not None else None
        return content_digest(
            {
                "compaction": [item.digest for item in self.items],
                "base": base,
                "max_tokens": max_tokens,
            }
        )


def plan_compaction(
    items: Sequence[Item], end: int, counter: TokenCounter, previous: JsonDict | None
) -> Plan | None:
    """What a compaction of `items` before `end` stands for, after `previous` (the
    compaction those items follow, whose rendered text, when it is among them, is not
    read back a second time); None when nothing there can be compacted."""
    gone = covered(items, end)
    if not gone:
        return None
    held = render_summary(previous, counter) if previous is not None else None
    summaries = [items[i] for i in gone if is_summary(items[i])]
    earlier = [item for item in summaries if item.text() != held]
    rest = tuple(items[i] for i in gone if not is_summary(items[i]))
    return Plan(end, tuple(gone), rest, base_state(previous, earlier))


def render_summary(
    summary: Mapping[str, Any], counter: TokenCounter, max_tokens: int = SUMMARY_TOKENS
) -> str:
    """The text the provider receives for a compaction (a developer message)."""
    if summary.get("format") != MEMORY_FORMAT:
        raise CompactionError(f"Unknown compaction summary format {summary.get('format')!r}.")
    try:
        state = memory.from_json(summary.get("state"))  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise CompactionError("The compaction's summary is malformed.") from None
    return memory.render(state, counter, max_tokens)


def covers(summary: Mapping[str, Any]) -> int | None:
    """How many items a compaction stands for (its state's count)."""
    state = summary.get("state")
    count = state.get("count") if isinstance(state, Mapping) else None
    return count if isinstance(count, int) else None


def summary_message(text: str) -> Item:
    """A compaction as the provider reads it: a developer message (an instruction, so the
    projection pins it, SPEC 5)."""
    if not text.startswith(SUMMARY_MARKER):
        text = f"{SUMMARY_MARKER}\n{text}"
    return summary_item("responses", text)


# -- where a compaction stands -------------------------------------------------------------


def covered(items: Sequence[Item], end: int) -> list[int]:
    """Indexes before `end` that a compaction placed at `end` stands for: everything but
    the user's messages, instructions and pending MCP approval requests (a summary this
    module rendered is covered: the new summary includes it). A call and its output stay together: a pair that `end`
    splits is kept whole, with the reasoning item just before the call (the provider
    wants the two together)."""
    later_outputs = {i.output_for for i in items[end:] if i.output_for is not None}
    later_calls = {c for i in items[end:] for c in i.call_ids}
    pending = pending_approvals(items)
    found: list[int] = []
    for index, item in enumerate(items[:end]):
        if item.is_user_message or (item.is_instruction and not is_summary(item)):
            continue
        if is_pending_approval(item, pending):  # a pending action stays verbatim (SPEC 5)
            continue
        if later_outputs.intersection(item.call_ids) or item.output_for in later_calls:
            if found and found[-1] == index - 1 and items[index - 1].kind == "reasoning":
                found.pop()
            continue
        found.append(index)
    return found


def replaced(items: Sequence[Item], end: int, summary: Item) -> list[tuple[int, Item]]:
    """`items` with what a compaction at `end` covers replaced by `summary`, which takes
    the place of the last covered item; pairs (source index, item) so a caller can keep
    parallel rows (a stored window's) in step. Unchanged when nothing is covered."""
    gone = covered(items, end)
    if not gone:
        return list(enumerate(items))
    last, dropped = gone[-1], set(gone)
    return [
        (index, summary if index == last else item)
        for index, item in enumerate(items)
        if index not in dropped or index == last
    ]


def last_compaction(items: Sequence[Item]) -> int | None:
    """Index of the last compaction item: the one that stands for what precedes it."""
    for index in range(len(items) - 1, -1, -1):
        if items[index].kind == "compaction":
            return index
    return None


def current_turn_start(items: Sequence[Item]) -> int:
    """Where the current turn starts: the last user message (SPEC 5), else the end."""
    for index in range(len(items) - 1, -1, -1):
        if items[index].is_user_message:
            return index
    return len(items)


def compacted_output(items: Sequence[Item], compaction: JsonDict) -> list[JsonDict]:
    """`POST /responses/compact`'s `output`: every user message (and pending MCP approval
    request, which the compaction does not stand for), then the one compaction item
    (OpenAI's CompactResource). A message keeps its fields and words; a string
    content becomes one input_text part, as OpenAI returns it."""
    pending = pending_approvals(items)
    kept = [
        user_message(item.raw) if item.is_user_message else item.raw
        for item in items
        if item.is_user_message or is_pending_approval(item, pending)
    ]
    return [*kept, compaction]


def user_message(raw: JsonDict) -> JsonDict:
    content = raw.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    return {"type": "message", **raw, "content": content}
