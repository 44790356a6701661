"""Whether the real engine can run here: skip its tests on a developer machine without
it, but fail them in CI (``CI=true``), where a broken install must not pass as a green
run of skips."""

from __future__ import annotations

import importlib
import os

import pytest

from ncap.engine.library import default_model_path
from ncap.errors import NcapError

__all__ = ["in_ci", "require_engine"]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_engine() -> None:
    """Call at module level: ``llama_cpp`` must import and the bundled model must exist."""
    try:
        importlib.import_module("llama_cpp")
        default_model_path()
    except (ImportError, NcapError) as exc:
        reason = f"the local engine is unavailable: {exc}"
        if in_ci():
            pytest.fail(f"{reason} (CI=true: a missing engine is a failure)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
