"""Cache-aware trimming (SPEC section 5): sticky cuts repeat the previous prefix."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from cache import run


def test_sticky_cuts_keep_most_of_the_previous_prefix() -> None:
    sticky, minimal = run(120, sticky=True), run(120, sticky=False)
    assert statistics.mean(sticky) > 0.85
    assert statistics.mean(sticky) > statistics.mean(minimal) + 0.2
