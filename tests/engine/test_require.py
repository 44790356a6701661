"""A missing engine skips its tests on a developer machine and fails them in CI."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tests.engine import _require


def _no_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake_import(name: str, *args: Any) -> Any:
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real(name, *args)

    monkeypatch.setattr(_require.importlib, "import_module", fake_import)


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_missing_engine_fails_in_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _no_llama(monkeypatch)
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="CI=true: a missing engine is a failure"):
        _require.require_engine()


@pytest.mark.parametrize("value", [None, "", "false"])
def test_missing_engine_skips_elsewhere(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    _no_llama(monkeypatch)
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match=r"No module named .llama_cpp."):
        _require.require_engine()


def test_missing_model_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    real = _require.default_model_path
    monkeypatch.setattr(_require, "default_model_path", lambda: real("/nonexistent.gguf"))
    monkeypatch.setattr(_require.importlib, "import_module", lambda name, *a: object())
    with pytest.raises(pytest.fail.Exception, match="model file not found"):
        _require.require_engine()
