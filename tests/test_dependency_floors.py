"""The runtime dependencies' floors clear the advisories published against them, and
the environment the tests run in satisfies the floors (a resolve at the lower bound
lands on a version without them). The advisory list itself is checked by `make audit`
(network); this test pins what it found."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
# package -> the first version past its last known advisory
PAST_ADVISORIES = {
    "aiohttp": "3.14.3",  # GHSA-cq5v-8q36-5273; 3.14.0-3.14.2 and 3.12.14 fixes before it
    "jinja2": "3.1.6",  # CVE-2025-27516
}


def _requirements(group: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    raw = project["dependencies"] if group is None else project["optional-dependencies"][group]
    reqs = (Requirement(r) for r in raw)
    return {r.name.lower(): r for r in reqs}


@pytest.mark.parametrize(("name", "fixed"), PAST_ADVISORIES.items())
def test_the_floor_is_past_the_advisories(name: str, fixed: str) -> None:
    req = _requirements()[name]
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors and min(floors) >= Version(fixed), f"{req}: must not admit < {fixed}"


@pytest.mark.parametrize("name", sorted(PAST_ADVISORIES))
def test_the_installed_version_meets_the_floor(name: str) -> None:
    req = _requirements()[name]
    assert req.specifier.contains(version(name), prereleases=True), (name, version(name))


def test_the_audit_tool_is_a_dev_dependency() -> None:
    assert "pip-audit" in _requirements("dev")
