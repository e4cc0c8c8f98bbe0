"""bench/RESULTS.md: each benchmark owns one "## <title>" section and replaces only it.

Benches write it only when asked (`--write`); tests pass a path of their own.
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(title: str, section: str, path: Path = RESULTS) -> None:
    """Replace the section headed `## {title}` (or append it), leaving the others alone."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    heading = f"## {title}\n"  # the whole title: "## A" is not "## A (after)"
    start = text.find(heading)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + (text[end:] if end != -1 else "")
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
