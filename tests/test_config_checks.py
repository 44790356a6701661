"""What an existing file means (one rule), cross-references at their real line
in the first run, did-you-mean, stale-contract warnings, the resolved form."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ncap.cli.main import app
from ncap.config import default_config, parse_config, resolved, warnings_for
from ncap.errors import ConfigError

BROKEN = """\
server:
  port: 99999
workloads:
  support:
    max_candidate: 2
    models: [approved-standrd]
models:
  approved-standard: [primary-chat, secundary-chat]
routes:
  primary-chat: {provider: openai, base_url: 'https://api.example.com/v1'}
  secondary-chat: {provider: openai, base_url: 'http://vllm:8000/v1'}
keys:
  - hash: "sha256:0000000000000000000000000000000000000000000000000000000000000000"
    workload: suport
"""


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="ncap.yaml")
    return info.value.problems


def test_field_and_reference_errors_in_one_run_at_their_lines() -> None:
    assert _problems(BROKEN) == [
        "ncap.yaml: server.port (line 2): Input should be less than or equal to 65535",
        "ncap.yaml: workloads.support.max_candidate (line 5): unknown field 'max_candidate' "
        "(did you mean 'max_candidates'?)",
        "ncap.yaml: workloads.support.models.0 (line 6): unknown model alias "
        "'approved-standrd' (did you mean 'approved-standard'?)",
        "ncap.yaml: models.approved-standard.1 (line 8): unknown route 'secundary-chat' "
        "(did you mean 'secondary-chat'?)",
        "ncap.yaml: keys.0.workload (line 14): unknown workload 'suport' (did you mean 'support'?)",
    ]


def test_a_misspelt_nested_key_gets_a_suggestion() -> None:
    text = "routes:\n  r:\n    provider: local\n    contract: {candidate: native}\n"
    (problem,) = _problems(text + "models: {m: [r]}\n")
    assert problem == (
        "ncap.yaml: routes.r.contract.candidate (line 4): unknown field 'candidate' "
        "(did you mean 'candidates'?)"
    )


def test_keyless_config_without_a_default_workload_says_how_to_fix_it() -> None:
    (problem,) = _problems("workloads: {eval: {}}\nmodels: {}\nroutes: {}\n")
    assert problem.startswith("ncap.yaml: workloads (line 1): without keys every request")
    assert "add a `default` workload or create a key" in problem


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only a comment\n",
        "keys: []\n",
        "server: {port: 9000}\nlimits: {max_body_bytes: 8192}\n",
    ],
)
def test_a_file_without_workloads_models_routes_keeps_the_demo(text: str) -> None:
    config = parse_config(text)
    demo = default_config()
    assert (config.workloads, config.models, config.routes) == (
        demo.workloads,
        demo.models,
        demo.routes,
    )
    assert config.workloads["default"].max_candidates == 4


def test_a_file_writing_any_of_the_three_defines_all_three() -> None:
    config = parse_config("workloads: {default: {max_candidates: 2}}\n")
    assert config.models == {} and config.routes == {}
    assert config.workloads["default"].max_candidates == 2


STALE = """\
models: {{chat: [old, fresh, undated]}}
routes:
  old:
    provider: openai
    base_url: https://api.example.com/v1
    contract:
      candidates: native
      verified_at: {old}
      max_age: 30d
  fresh:
    provider: openai
    base_url: https://api.example.com/v1
    contract: {{candidates: native, verified_at: {fresh}, max_age: 30d}}
  undated:
    provider: openai
    base_url: https://api.example.com/v1
    contract: {{candidates: native, max_age: 30d}}
"""


def test_check_config_warns_about_contracts_already_stale(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    text = STALE.format(
        old=(now - timedelta(days=45)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        fresh=(now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    config = parse_config(text)
    found = warnings_for(config, text, "ncap.yaml", now)
    assert len(found) == 2
    assert found[0].startswith(
        "ncap.yaml: routes.old.contract.verified_at (line 8): the contract went stale on "
    )
    assert "route_contract_stale" in found[0]
    assert found[1].startswith(
        "ncap.yaml: routes.undated.contract.max_age (line 17): max_age "
        "is set but verified_at is not"
    )
    path = tmp_path / "ncap.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["check-config", str(path)])
    assert result.exit_code == 0  # a warning, not an error
    assert result.stderr.count("warning") == 2


def test_resolved_config_shows_each_route_only_its_providers_fields() -> None:
    text = (
        "models: {a: [remote], b: [engine]}\n"
        "routes:\n  remote: {provider: openai, base_url: 'http://x'}\n"
        "  engine: {provider: local}\n"
    )
    out = resolved(parse_config(text))
    assert "n_ctx" not in out["routes"]["remote"] and "model_path" not in out["routes"]["remote"]
    assert "weights" not in out["routes"]["remote"]
    assert "prefix_cache_tokens" not in out["routes"]["remote"]
    assert out["routes"]["engine"]["prefix_cache_tokens"] == 4096
    assert out["routes"]["engine"]["weights"] == "auto"
    assert out["routes"]["remote"]["base_url"] == "http://x"
    assert out["routes"]["engine"]["n_ctx"] == 8192 and "base_url" not in out["routes"]["engine"]
    assert parse_config(yaml.safe_dump(out)) == parse_config(text)  # still a valid config


def test_serve_prints_the_same_warnings_at_start_up(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    old = (datetime.now(UTC) - timedelta(days=45)).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = STALE.format(old=old, fresh=old)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "ncap.yaml"
    path.write_text(
        f"stores: {{ledger: 'sqlite:///{tmp_path}/l.db', budgets: 'memory://'}}\n" + text
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ncap.cli.main",
            "serve",
            "--config",
            str(path),
            "--port",
            str(port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening" in line:
                break
        assert any("routes.old.contract.verified_at" in ln and "stale" in ln for ln in lines)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("route", "problem"),
    [
        ("{provider: local, base_url: 'http://x'}", "routes.r.base_url (line 3): unknown field"),
        ("{provider: openai, base_url: 'http://x', n_ctx: 4096}", "routes.r.n_ctx (line 3)"),
        ("{provider: anthropic, upstream_model: c, api_version: v}", "routes.r.api_version"),
        ("{provider: opena, base_url: 'http://x'}", "unknown provider 'opena' (did you mean"),
        ("{base_url: 'http://x'}", "provider is required (one of: openai, azure, anthropic"),
        (
            "{provider: azure, base_url: 'http://x'}",
            "upstream_model is required for provider azure",
        ),
    ],
)
def test_each_route_kind_has_only_its_own_fields(route: str, problem: str) -> None:
    """Route config is one model per provider kind: a local route has no ``base_url``,
    an HTTP route no ``n_ctx``; the place is the one written (no kind level)."""
    with pytest.raises(ConfigError) as info:
        parse_config(f"models: {{m: [r]}}\nroutes:\n  r: {route}\n")
    shown = "\n".join(info.value.problems)
    assert problem in shown, shown
    assert ".local." not in shown and ".openai." not in shown
