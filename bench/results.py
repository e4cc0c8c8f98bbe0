"""bench/RESULTS.md: each benchmark owns one "## <title>" section and replaces only it."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(title: str, section: str) -> None:
    """Replace the section headed `## {title}` (or append it), leaving the others alone."""
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    heading = f"## {title}"
    start = text.find(heading)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + (text[end:] if end != -1 else "")
    RESULTS.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
