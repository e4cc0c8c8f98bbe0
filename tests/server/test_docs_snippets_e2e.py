"""Every Python snippet of README.md and docs/*.md runs as pasted (issue 20 item 15),
against a real proxy in front of the fake provider: only the proxy URL and the
placeholder key are replaced. Snippets that make model requests are checked for what they
claim (a chain kept, a thread per id); the Agents SDK one exports no trace."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.server.state import STORE

from .conftest import TENANT_KEY, Proxy

REPO = Path(__file__).parent.parent.parent
DOCUMENTED_URL = "http://127.0.0.1:8080/v1"
PLACEHOLDER_KEY = re.compile(r'"<[^"<>]*key[^"<>]*>"')
SNIPPET_TIMEOUT = 120  # seconds: imports of the Agents SDK or LangChain included
# Run before a snippet: Agents SDK trace uploads are recorded in a file, never sent.
PRELUDE = """
import os, sys
try:
    from agents.tracing import processors
except ImportError:
    pass
else:
    def export(self, items, *_):
        with open(os.environ["TRACE_LOG"], "a") as log:
            log.write(f"{len(items)}\\n")
    processors.BackendSpanExporter.export = export
    processors.BackendSpanExporter._export_with_deadline = export
path = sys.argv[1]
exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class Snippet:
    where: str  # file:line
    code: str


def python_snippets() -> list[Snippet]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Snippet(f"{path.relative_to(REPO)}:{line}", match.group(1)))
    return found


SNIPPETS = python_snippets()


@dataclass(frozen=True)
class Ran:
    code: int
    output: str
    traces: int  # trace batches the Agents SDK tried to upload


async def run(snippet: str, proxy: Proxy, tmp_path: Path) -> Ran:
    assert DOCUMENTED_URL in snippet, "a snippet talks to the proxy at the documented URL"
    code = snippet.replace(DOCUMENTED_URL, proxy.base_url)
    code = PLACEHOLDER_KEY.sub(repr(TENANT_KEY).replace("'", '"'), code)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    traces = tmp_path / "traces.log"
    traces.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "THREADKEEPER"))}
    env["TRACE_LOG"] = str(traces)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PRELUDE,
        str(script),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=SNIPPET_TIMEOUT)
    assert process.returncode is not None
    lines = traces.read_text().split()
    return Ran(process.returncode, output.decode(errors="replace"), sum(map(int, lines)))


def test_the_docs_have_the_snippets_this_file_checks() -> None:
    where = [s.where.split(":")[0] for s in SNIPPETS]
    assert where.count("README.md") >= 1
    assert where.count("docs/integrations.md") >= 4  # Agents SDK, 3 LangChain
    assert not any("await " in s.code and "asyncio.run" not in s.code for s in SNIPPETS), (
        "top-level await does not run as pasted"
    )


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
async def test_every_python_snippet_runs_as_pasted(
    snippet: Snippet, proxy: Proxy, tmp_path: Path
) -> None:
    ran = await run(snippet.code, proxy, tmp_path)
    assert ran.code == 0, ran.output
    assert proxy.provider.model_requests, "the snippet went through the proxy"
    assert ran.traces == 0, "no trace left for OpenAI"
    store = proxy.app[STORE]  # type: ignore[index]
    sent = [r.json for r in proxy.provider.model_requests]
    if "from agents import" in snippet.code:
        # The follow-up chained on the first answer: the proxy sent the first question too.
        assert len(sent) == 2 and "Where is my order 4417?" in str(sent[1]["input"])
        assert "Refund it." in str(sent[1]["input"])
    if "extra_headers" in snippet.code:
        threads = {t.id: t for t in await store.list_threads("acme", limit=10)}
        assert set(threads) == {"ticket-4417", "ticket-5120"}
        assert threads["ticket-4417"].next_seq == 4  # two questions and two answers
        assert "Cancel order 5120." not in str(sent[-1]["messages"])  # threads kept apart
    elif "default_headers" in snippet.code:
        assert [t.id for t in await store.list_threads("acme", limit=10)] == ["ticket-4417"]
    if "use_previous_response_id=True" in snippet.code:
        # LangChain sent only the new message; the proxy rebuilt the whole history.
        assert "Where is my order 4417?" in str(sent[-1]["input"])


async def test_the_agents_snippet_would_upload_traces_without_its_switch(
    proxy: Proxy, tmp_path: Path
) -> None:
    """The check above can fail: with the documented switch removed, the SDK tries to
    upload its traces (recorded by the prelude, never sent)."""
    (snippet,) = [s for s in SNIPPETS if "from agents import" in s.code]
    assert "set_tracing_disabled(True)\n" in snippet.code
    ran = await run(snippet.code.replace("set_tracing_disabled(True)\n", ""), proxy, tmp_path)
    assert ran.code == 0, ran.output
    assert ran.traces > 0
