"""Hostile clients against every inbound surface: guessed and well-known keys, sessions
kept past logout, unauthenticated operational endpoints, another key's idempotency
keys, cross-site requests in keyless mode, forged actors and oversized ids. Each case
is a real gateway on a free port; the clients are the official ``openai`` SDK where it
applies and ``httpx`` for what the SDK cannot send (forms, cookies, raw headers).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ncap.auth import hash_key
from ncap.config import parse_config
from ncap.errors import ConfigError
from tests.support import gateway

DOCS = Path(__file__).parents[2] / "docs"


# --- well-known keys ---


def _documented_example() -> dict[str, Any]:
    """The configuration example of docs/configuration.md, as a mapping."""
    text = (DOCS / "configuration.md").read_text()
    section = text.split("## Example: an OpenAI-compatible route", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    raw = yaml.safe_load(block.group(1))
    assert isinstance(raw, dict)
    return raw


@pytest.mark.parametrize("weak", ["", "test", "test2", "password", "changeme", "sk-test"])
def test_the_hash_of_a_well_known_string_is_refused_at_load(weak: str) -> None:
    text = yaml.safe_dump(
        {"keys": [{"hash": hash_key(weak), "workload": "default"}], "workloads": {"default": {}}}
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(text + "models: {}\nroutes: {}\n", source="ncap.yaml")
    (problem,) = refused.value.problems
    assert problem.startswith("ncap.yaml: keys.0.hash (line 2):")
    assert "well-known string" in problem and "ncap keys create" in problem


def test_the_documented_example_lets_no_key_in(tmp_path: Path) -> None:
    """Loaded as written (but with stores of the test's own and bound by the test), the
    example answers no key at all: its hashes are placeholders no key hashes to."""
    raw = _documented_example()
    raw["stores"] = {
        "ledger": f"sqlite:///{tmp_path}/ledger.db",
        "budgets": f"sqlite:///{tmp_path}/budgets.db",
    }
    config = parse_config(yaml.safe_dump(raw))
    assert config.keys  # keys required: nothing keyless either
    with gateway(config) as gw:
        for key in ("test", "test2", "password", "sha256:" + "0" * 64):
            r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401, (key, r.text)
