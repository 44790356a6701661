"""``ncap probe`` on an Anthropic route: the provider has no ``n``, so the probe sends
one candidate and records ``candidates: emulate``; a long prompt sent twice comes back
cached, so it records ``prompt_cache: true``; the gateway started on the file as
written then serves n=4 by a cache-primed fan-out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from typer.testing import CliRunner

from ncap import __version__
from ncap.cli.main import app
from ncap.config import load_config
from ncap.testing.fake_anthropic import ANTHROPIC_STATE, AnthropicFakeState, create_anthropic_app
from tests.support import ServerThread, gateway

KEY_ENV = "NCAP_TEST_PROBE_ANTHROPIC_KEY"


@pytest.fixture
def fake() -> Iterator[tuple[str, AnthropicFakeState]]:
    server = ServerThread(lambda: create_anthropic_app(api_key="ak")).start()
    try:
        assert server.app is not None
        yield server.url + "/v1", server.app[ANTHROPIC_STATE]
    finally:
        server.stop()


def test_probe_records_emulate_and_caching(
    fake: tuple[str, AnthropicFakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "ak")
    url, state = fake
    path = tmp_path / "ncap.yaml"
    path.write_text(
        f"""stores:
  ledger: sqlite:///{tmp_path}/ledger.db
  budgets: sqlite:///{tmp_path}/budgets.db
workloads:
  default: {{max_candidates: 4, output_ceiling: 64}}
models:
  claude: [claude]
routes:
  claude:
    provider: anthropic
    base_url: {url}
    upstream_model: claude-fake
    api_key_env: {KEY_ENV}
    retries: 0
    contract:
      max_age: 30d
"""
    )
    result = CliRunner().invoke(app, ["probe", "claude", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "fan-out" in result.output
    sent = [body for body in state.stats()["recent_bodies"]]
    assert len(sent) == 4 and all("n" not in b for b in sent)
    assert state.prompt_cache.writes == 1 and state.prompt_cache.reads == 1

    contract = yaml.safe_load(path.read_text())["routes"]["claude"]["contract"]
    assert contract["candidates"] == "emulate"
    assert contract["max_candidates"] == 8
    assert contract["output_cap"] == "per_candidate"
    assert contract["stream_usage"] == "include_usage"
    assert contract["prompt_cache"] is True
    assert contract["max_age"] == "30d"
    assert contract["fingerprint"] == {
        "provider": "anthropic",
        "upstream_model": "claude-fake",
        "gateway_version": __version__,
    }

    state.reset()
    with gateway(load_config(path)) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="claude", messages=[{"role": "user", "content": "hi"}], n=4
        )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert state.requests == 4  # four Messages requests: the fan-out
