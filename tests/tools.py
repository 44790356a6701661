"""External tools some tests drive (``promtool``, ``focus-validator``): skipped on a
developer machine without them, a failure in CI (``CI=true``), where
``scripts/setup.sh`` and ``.ci/run`` install them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

__all__ = ["REPO", "require_tool"]

REPO = Path(__file__).resolve().parent.parent


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_tool(name: str, *candidates: Path) -> Path:
    """The tool's path: an existing candidate, else ``name`` on ``PATH``."""
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    reason = f"{name} is not installed (scripts/setup.sh, .ci/run install it)"
    if _in_ci():
        pytest.fail(f"{reason}; CI=true: a missing tool is a failure", pytrace=False)
    pytest.skip(reason)
