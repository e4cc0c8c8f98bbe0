"""Every module under proxy/ imports, so a syntax or import error anywhere fails fast."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import proxy


def all_modules() -> list[str]:
    names = [proxy.__name__]
    for info in pkgutil.walk_packages(proxy.__path__, prefix=f"{proxy.__name__}."):
        names.append(info.name)
    return sorted(names)


def test_the_walk_finds_the_core() -> None:
    assert {"proxy.core.items", "proxy.core.tokens"} <= set(all_modules())


@pytest.mark.parametrize("name", [n for n in all_modules() if n != "proxy.__main__"])
def test_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_main_module_imports_and_runs_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `python -m proxy` runs the CLI on import; --help makes that run harmless.
    monkeypatch.setattr("sys.argv", ["threadkeeper", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module("proxy.__main__")
    assert exit_info.value.code == 0
    assert "threadkeeper" in capsys.readouterr().out
