"""YAML for operator files (policies, config), and how error messages quote values.

    data = load_yaml(text)     # yaml.YAMLError on bad YAML, on any anchor or alias
    f"expected a number, got {shown(value)}"   # at most SHOWN_MAX_CHARS characters

Aliases are refused while composing, before anything is expanded: a 404-byte "billion
laughs" file would otherwise build 10^7 leaves (seconds of CPU, hundreds of MB) and a
message quoting it would be a 72 MB log line. Operator files never need aliases.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent, CollectionStartEvent, ScalarEvent
from yaml.nodes import Node

SHOWN_MAX_CHARS = 80

_repr = reprlib.Repr()
_repr.maxlevel = 2
_repr.maxstring = SHOWN_MAX_CHARS
_repr.maxother = SHOWN_MAX_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 4


class NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses anchors (`&a`) and aliases (`*a`) with a ComposerError
    naming them and their line."""

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        mark: Any = event.start_mark
        if isinstance(event, AliasEvent):
            raise ComposerError(
                None,
                None,
                f"found alias *{event.anchor}: YAML anchors and aliases are not allowed here",
                mark,
            )
        if isinstance(event, (ScalarEvent, CollectionStartEvent)) and event.anchor is not None:
            raise ComposerError(
                None,
                None,
                f"found anchor &{event.anchor}: YAML anchors and aliases are not allowed here",
                mark,
            )
        return super().compose_node(parent, index)  # type: ignore[no-any-return]


def load_yaml(text: str) -> Any:
    """One YAML document with the safe tag set and no anchors or aliases; a value Python
    cannot build (an integer over 4,300 digits) is a yaml.YAMLError too."""
    try:
        return yaml.load(text, Loader=NoAliasLoader)
    except ValueError as exc:
        raise yaml.YAMLError(f"a value cannot be read: {exc}") from None


def shown(value: Any) -> str:
    """repr(value) for an error message, bounded in length and in the work it does."""
    try:
        text = _repr.repr(value)
    except Exception:  # e.g. an int above Python's 4,300-digit str() limit
        text = f"<{type(value).__name__}>"
    if len(text) > SHOWN_MAX_CHARS:
        text = text[: SHOWN_MAX_CHARS - 3] + "..."
    return text
