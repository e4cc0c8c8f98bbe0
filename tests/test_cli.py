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
    assert main(["policy", "check", str(directory)]) == 1
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


def test_demo_serve_keeps_the_inspector_running_on_a_printed_url_and_token() -> None:
    command = [sys.executable, "-m", "proxy", "demo", "--serve", "--turns", "3", "--window", "3000"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as process:
        try:
            url = token = None
            assert process.stdout is not None
            for line in process.stdout:  # bounded: the demo prints a few dozen lines
                if line.startswith("The inspector is at "):
                    url = line.split(" at ", 1)[1].strip()
                if line.startswith("Sign in with the operator token "):
                    token = line.rsplit(" ", 1)[1].strip()
                    break
            assert url is not None and token is not None
            page = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert page.status_code == 200 and "demo-thread" in page.text
            assert httpx.get(url, timeout=30).status_code == 401
        finally:
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0
