"""The command line: serve refuses bad policies; count and project on JSON files."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from proxy.cli import main
from tests.core.test_tokens import JARGON_MESSAGES as COOKBOOK_MESSAGES


def test_serve_refuses_to_start_on_a_bad_policy(tmp_path: Path) -> None:
    (tmp_path / "acme.yaml").write_text("tenant: acme\nmemory: {keep_recent_turns: many}\n")
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--policies", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "acme.yaml" in result.stderr
    assert "memory.keep_recent_turns" in result.stderr


def test_count_reproduces_the_cookbook(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(COOKBOOK_MESSAGES))
    assert main(["count", str(path), "--model", "gpt-4o"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 124
    assert main(["count", str(path), "--model", "gpt-4"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 129


def test_project_prints_the_budget_breakdown(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(30):
        messages += [
            {"role": "user", "content": f"question {turn} " + "detail " * 50},
            {"role": "assistant", "content": f"answer {turn} " + "words " * 50},
        ]
    messages.append({"role": "user", "content": "final question"})
    path = tmp_path / "long.json"
    path.write_text(json.dumps(messages))
    assert (
        main(["project", str(path), "--window", "2500", "--output", "300", "--margin", "50"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["window"] == 2500
    assert report["history_before"] > report["history_after"]
    assert report["prompt_tokens"] <= 2500 - 300 - 50


def test_demo_runs_offline_and_checks_what_it_sent() -> None:
    # The README's run command as it is (8 turns, a 3,000-token window): the proxy against
    # the scripted provider, driven by the SDK. Compressing the tool results (SPEC 5 step 1)
    # is not enough for the last turns, so the demo shows a summary too.
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == list(range(1, 9))
    assert all(int(row[3]) <= 3000 for row in rows)  # tokens sent never above the window
    assert "every tool call went out with its result" in result.stdout
    # It ends with what the model saw on the last turn: the token bar and the summary.
    bar, legend = result.stdout.split("What the model saw on the last turn")[1].splitlines()[1:3]
    assert bar.startswith("[#") and bar.endswith("]") and "S" in bar
    sizes = {name: int(size) for name, size in re.findall(r"\S ([a-z ]+?) (\d+)", legend)}
    sent = sum(sizes[n] for n in ("pinned", "tools", "summary", "history", "current"))
    assert sent == int(rows[-1][3]), "the bar's sent segments sum to the prompt tokens"
    assert sent + sizes["output reserve"] + sizes["margin"] + sizes["free"] == 3000
    summary = result.stdout.split("The summary that stands for the dropped turns:\n")[1]
    assert summary.startswith("[threadkeeper summary of earlier conversation]")
    # Its store was temporary: no command that reads it is suggested (issue 20 item 12).
    assert "threadkeeper threads" not in result.stdout


def test_serve_passes_the_metrics_token_flag(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen = []
    monkeypatch.setattr("proxy.server.app.run", seen.append)
    monkeypatch.delenv("THREADKEEPER_METRICS_TOKEN", raising=False)
    assert main(["serve", "--metrics-token", "m-token", "--policies", "policies"]) in (0, None)
    assert seen[0].metrics_token == "m-token"


def test_serve_passes_the_operator_token_flag(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen = []
    monkeypatch.setattr("proxy.server.app.run", seen.append)
    monkeypatch.delenv("THREADKEEPER_OPERATOR_TOKEN", raising=False)
    assert main(["serve", "--operator-token", "op-token", "--policies", "policies"]) in (0, None)
    assert seen[0].operator_token == "op-token"


def test_serve_passes_the_workers_flag(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen = []
    monkeypatch.setattr("proxy.server.app.run", seen.append)
    monkeypatch.delenv("THREADKEEPER_WORKERS", raising=False)
    assert main(["serve", "--workers", "1", "--policies", "policies"]) == 0
    assert seen[0].workers == 1


def test_serve_runs_on_uvloop_when_importable_and_falls_back_silently(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import uvloop

    from proxy.server.app import event_loop_factory

    assert event_loop_factory() is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert event_loop_factory() is None


def _policy_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def test_policy_check_accepts_the_shipped_policies(capsys) -> None:  # type: ignore[no-untyped-def]
    example = Path(__file__).parent.parent / "policies"
    assert main(["policy", "check", str(example)]) == 0
    assert capsys.readouterr().out.startswith("ok: 1 tenant policies (default)")


def test_policy_check_lists_every_bad_file_with_field_and_problem(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    key = "a" * 64
    directory = _policy_dir(
        tmp_path,
        {
            "acme.yaml": "tenant: acme\nbudget: {target_fill: 1.5}\n",
            "beta.yaml": "tenant: beta\nmemory: {keep_recent_turn: 2}\n",
            "good.yaml": f"tenant: good\napi_keys: [{key}]\n",
            "twin.yaml": f"tenant: twin\napi_keys: [{key}]\n",
        },
    )
    assert main(["policy", "check", str(directory)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"{directory / 'acme.yaml'}: budget.target_fill: ")
    assert lines[1].startswith(f"{directory / 'beta.yaml'}: memory.keep_recent_turn: ")
    assert "twin.yaml" in lines[2] and "api_keys" in lines[2]


def test_policy_check_exits_2_on_a_missing_directory(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["policy", "check", str(tmp_path / "nowhere")]) == 2
    assert "policies directory does not exist" in capsys.readouterr().err


def test_policy_schema_validates_what_the_loader_accepts(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["policy", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    validator = jsonschema.Draft202012Validator(schema)
    example = Path(__file__).parent.parent / "policies" / "acme.yaml.example"
    validator.validate(yaml.safe_load(example.read_text()))
    errors = list(validator.iter_errors({"tenant": "acme", "budget": {"target_fill": "high"}}))
    assert [list(error.absolute_path) for error in errors] == [["budget", "target_fill"]]
    assert list(validator.iter_errors({"tenant": "acme", "memmory": {}}))


def test_demo_serve_keeps_the_inspector_running_on_a_printed_url_and_token(
    tmp_path: Path,
) -> None:
    command = [sys.executable, "-m", "proxy", "demo", "--serve", "--turns", "3", "--window", "3000"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as process:
        try:
            url = token = explain = None
            assert process.stdout is not None
            for line in process.stdout:  # bounded: the demo prints a few dozen lines
                if line.startswith("The inspector is at "):
                    url = line.split(" at ", 1)[1].strip()
                if line.startswith("Sign in with the operator token "):
                    token = line.rsplit(" ", 1)[1].strip()
                if line.strip().startswith("threadkeeper threads explain "):
                    explain = line.split()
                if line.startswith("(the demo thread is "):  # its last line before it waits
                    break
            assert url is not None and token is not None and explain is not None
            page = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert page.status_code == 200 and "demo-thread" in page.text
            assert httpx.get(url, timeout=30).status_code == 401
            # The command it suggests works as printed, from any directory (issue 20 item 12).
            shell = subprocess.run(
                [sys.executable, "-m", "proxy", *explain[1:]],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=tmp_path,
            )
            assert shell.returncode == 0, shell.stderr
            assert shell.stdout.startswith(f"request {explain[3]}  tenant default")
            assert list(tmp_path.iterdir()) == [], "no store was made in the directory"
        finally:
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0


READ_ONLY = [
    ["threads", "list"],
    ["threads", "show", "t1"],
    ["threads", "explain", "req_1"],
    ["threads", "export", "t1"],
    ["threads", "find", "resp_1"],
    ["ledger", "list"],
    ["ledger", "show", "tenant", "k", "--tenant", "acme"],
    ["compaction", "show", "tkc1.x", "--tenant", "acme"],
]


@pytest.mark.parametrize("argv", READ_ONLY, ids=lambda argv: " ".join(argv[:2]))
def test_read_only_commands_say_there_is_no_store_and_make_none(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    """Issue 20 item 12: they made ./threadkeeper.db and answered as from an empty store."""
    monkeypatch.chdir(tmp_path)
    for name in ("THREADKEEPER_STORE", "THREADKEEPER_CONFIG", "THREADKEEPER_COMPACTION_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("threadkeeper: there is no store at ./threadkeeper.db") and (
        err.count("\n") == 1
    ), err
    assert list(tmp_path.iterdir()) == []


def test_policy_check_lists_every_problem_of_every_field(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Issue 20 item 13: it showed the first problem of each file, one per run."""
    directory = _policy_dir(
        tmp_path,
        {
            "acme.yaml": "tenant: acme\nbudget: {target_fill: 1.5, reserve_output_tokens: -3}\n"
            "memory: {keep_recent_turn: 2, keep_recent_turns: many}\n",
            "beta.yaml": "tenant: gamma\nmemmory: {}\n",
        },
    )
    assert main(["policy", "check", str(directory)]) == 2
    fields = [line.split(": ")[1] for line in capsys.readouterr().err.splitlines()]
    assert sorted(fields[:4]) == [
        "budget.reserve_output_tokens",
        "budget.target_fill",
        "memory.keep_recent_turn",
        "memory.keep_recent_turns",
    ]
    assert fields[4:] == ["tenant", "memmory"]


def run_cli(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_count_and_project_read_stdin_and_say_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    """Issue 20 item 13: tracebacks on a missing file or bad JSON, and no `-`."""
    result = run_cli("count", "-", "--model", "gpt-4o", stdin=json.dumps(COOKBOOK_MESSAGES))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["prompt_tokens"] == 124
    result = run_cli("project", "-", "--window", "5000", stdin=json.dumps(COOKBOOK_MESSAGES))
    assert result.returncode == 0 and json.loads(result.stdout)["window"] == 5000

    missing = tmp_path / "nowhere.json"
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}')
    for argv, stdin, problem in (
        (["count", str(missing)], "", f"cannot read {missing}"),
        (["count", str(bad)], "", f"{bad}: not JSON"),
        (["project", "-", "--window", "900"], "[1, 2]", "stdin: Invalid type for 'messages[0]'"),
        (
            ["count", "-"],
            '{"messages": [{"role": "user", "content": {}}]}',
            "'messages[0].content'",
        ),
        (["count", "-"], "[" * 100_000, "stdin: not JSON (nested more than 128 levels deep)"),
    ):
        result = run_cli(*argv, stdin=stdin)
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr.startswith("threadkeeper: ") and problem in result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """Issue 20 item 13: `policy schema | head` ended in a BrokenPipeError traceback."""
    for argv in (["policy", "schema"], ["policy", "schema", "--markdown"]):
        with subprocess.Popen(
            [sys.executable, "-m", "proxy", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as process:
            assert process.stdout is not None and process.stderr is not None
            process.stdout.close()  # the reader is gone before anything is written
            err = process.stderr.read()
            assert process.wait(timeout=60) == 141
        assert err == b""
