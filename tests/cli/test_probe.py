"""``ncap probe`` against fakes that honour n, ignore it, refuse it and omit stream usage:
each records the right contract into the config file, and the
gateway, started on the file as written, then acts on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from typer.testing import CliRunner

from ncap import __version__
from ncap.cli.main import app
from ncap.config import load_config
from ncap.testing.fake_gemini import create_gemini_app
from ncap.testing.fake_upstream import FakeState
from tests.support import ServerThread, fake_upstream, gateway

# route id -> the fake's fault profile for that route (sent as a route header)
ROUTES = {
    "honours": "none",
    "ignores": "ignore_candidates",
    "refuses": "refuse_candidates",
    "no-usage": "stream_no_usage",
}
GEMINI_KEY_ENV = "NCAP_TEST_PROBE_GEMINI_KEY"


def _config_text(openai_url: str, gemini_url: str, tmp: Path) -> str:
    routes = "\n".join(
        f"""  {rid}:
    provider: openai
    base_url: {openai_url}
    upstream_model: fake-model
    retries: 0
    headers: {{x-fake-fault: {profile}}}
    contract:
      max_age: 30d   # the operator's, kept by the probe"""
        for rid, profile in ROUTES.items()
    )
    models = "\n".join(f"  m-{rid}: [{rid}]" for rid in [*ROUTES, "gem"])
    return f"""# written by hand; the probe keeps this comment
stores:
  ledger: sqlite:///{tmp}/ledger.db
  budgets: sqlite:///{tmp}/budgets.db
workloads:
  default: {{max_candidates: 4, output_ceiling: 64}}
models:
{models}
routes:
{routes}
  gem:
    provider: gemini
    base_url: {gemini_url}
    upstream_model: gemini-3-pro-preview
    api_key_env: {GEMINI_KEY_ENV}
    retries: 0
    headers: {{x-fake-fault: refuse_candidates}}
"""


@pytest.fixture
def upstreams() -> Iterator[tuple[str, FakeState, str]]:
    gemini = ServerThread(lambda: create_gemini_app(api_key="gk")).start()
    try:
        with fake_upstream() as (url, state):
            yield url, state, gemini.url + "/v1beta"
    finally:
        gemini.stop()


def _probe(path: Path, route: str) -> Any:
    return CliRunner().invoke(app, ["probe", route, "--config", str(path)])


def test_probe_records_each_contract_and_the_gateway_acts_on_it(
    upstreams: tuple[str, FakeState, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GEMINI_KEY_ENV, "gk")
    openai_url, state, gemini_url = upstreams
    path = tmp_path / "ncap.yaml"
    path.write_text(_config_text(openai_url, gemini_url, tmp_path))
    for rid in [*ROUTES, "gem"]:
        result = _probe(path, rid)
        assert result.exit_code == 0, result.output
        assert f"probe of route {rid}" in result.output
    # two candidate probes per route, and a long prompt twice (OpenAI caches prompts)
    assert state.by_endpoint["chat.completions"] == 4 * len(ROUTES)

    text = path.read_text()
    assert text.startswith("# written by hand; the probe keeps this comment")
    raw = yaml.safe_load(text)["routes"]
    contracts = {rid: raw[rid]["contract"] for rid in raw}
    assert contracts["honours"]["candidates"] == "native"
    assert contracts["honours"]["max_candidates"] == 2
    assert contracts["honours"]["stream_usage"] == "include_usage"
    assert contracts["ignores"]["candidates"] == "unsupported"
    assert contracts["refuses"]["candidates"] == "unsupported"
    assert contracts["refuses"]["max_candidates"] == 1
    assert contracts["refuses"]["stream_usage"] == "include_usage"  # streamed with n=1
    assert contracts["no-usage"]["candidates"] == "native"
    assert contracts["no-usage"]["stream_usage"] == "none"
    assert contracts["gem"]["candidates"] == "unsupported"
    assert contracts["gem"]["stream_usage"] == "include_usage"
    assert contracts["gem"]["fingerprint"] == {
        "provider": "gemini",
        "upstream_model": "gemini-3-pro-preview",
        "gateway_version": __version__,
    }
    for rid in ROUTES:
        assert contracts[rid]["prompt_cache"] is False  # this fake caches nothing
        assert contracts[rid]["max_age"] == "30d"
        assert contracts[rid]["verified_at"]
        assert contracts[rid]["fingerprint"]["provider"] == "openai"

    config = load_config(path)
    with gateway(config) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        ok = client.chat.completions.create(
            model="m-honours", messages=[{"role": "user", "content": "hi"}], n=2
        )
        assert len(ok.choices) == 2
        ok = client.chat.completions.create(
            model="m-no-usage", messages=[{"role": "user", "content": "hi"}], n=2
        )
        assert len(ok.choices) == 2
        for rid in ("ignores", "refuses", "gem"):
            before = state.requests
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model=f"m-{rid}", messages=[{"role": "user", "content": "hi"}], n=2
                )
            body = info.value.body
            assert isinstance(body, dict)
            assert (body["code"], body["param"]) == ("route_does_not_support_candidates", "n")
            assert state.requests == before  # refused before dispatch
        one = client.chat.completions.create(
            model="m-ignores", messages=[{"role": "user", "content": "hi"}]
        )
        assert len(one.choices) == 1


def test_probe_never_sends_to_an_unconfigured_route(
    upstreams: tuple[str, FakeState, str], tmp_path: Path
) -> None:
    openai_url, state, gemini_url = upstreams
    path = tmp_path / "ncap.yaml"
    path.write_text(_config_text(openai_url, gemini_url, tmp_path))
    before = path.read_text()
    result = _probe(path, "nowhere")
    assert result.exit_code == 2
    assert "not configured" in result.output
    assert state.requests == 0
    assert path.read_text() == before


def test_inconclusive_probe_writes_nothing(
    upstreams: tuple[str, FakeState, str], tmp_path: Path
) -> None:
    openai_url, _, gemini_url = upstreams
    path = tmp_path / "ncap.yaml"
    text = _config_text(openai_url, gemini_url, tmp_path).replace(
        "x-fake-fault: none", "x-fake-fault: error_500"
    )
    path.write_text(text)
    result = _probe(path, "honours")
    assert result.exit_code == 1
    assert "inconclusive" in result.output
    assert path.read_text() == text


def test_probe_without_a_config_file_only_prints(
    upstreams: tuple[str, FakeState, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./ncap.yaml: the embedded default
    result = CliRunner().invoke(app, ["probe", "nowhere"])
    assert result.exit_code == 2
    assert "local-smollm2" in result.output
    assert list(tmp_path.iterdir()) == []
