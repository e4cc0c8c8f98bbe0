"""The guard on an LLM summary: what must be kept is in it, word for word.

A summarizer model paraphrases, merges and forgets; the deterministic extractor
(proxy/core/memory.py, `must_keep`) knows the strings that must survive a cut: ids,
amounts, the user's constraint sentences, current preferences, pending calls, decisions.
The guard appends every one the summary lacks, verbatim, under one title, so a summary
that passed the guard holds each of them (checked as exact substrings).

>>> guarded("Refund approved.", ("order #1234", "Refund approved."))
('Refund approved.\\nKept verbatim (the summary had left them out):\\n- order #1234', ('order #1234',))
"""

from __future__ import annotations

from collections.abc import Sequence

GUARD_TITLE = "Kept verbatim (the summary had left them out):"


def missing(text: str, must_keep: Sequence[str]) -> tuple[str, ...]:
    """The must-keep strings `text` does not contain, in their order, each once."""
    return tuple(s for s in dict.fromkeys(must_keep) if s and s not in text)


def guarded(text: str, must_keep: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """`text` with the missing must-keep strings appended, and which were missing."""
    absent = missing(text, must_keep)
    if not absent:
        return text, ()
    lines = [text.rstrip("\n"), GUARD_TITLE, *(f"- {s}" for s in absent)]
    return "\n".join(lines), absent
