"""check-config, keys create and serve's refusal to run unauthenticated off loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from typer.testing import CliRunner

from ncap.auth import hash_key
from ncap.cli.main import app
from ncap.config import parse_config
from ncap.testing.fake_upstream import FakeState
from tests.support import gateway, gateway_config

BAD = """\
server:
  port: 99999
workloads:
  default:
    max_candidates: 0
    greedy_candidates: sometimes
models:
  approved: [missing-route]
routes:
  r1:
    provider: openai
    contract:
      max_age: soon
  r2:
    provider: openai
"""


def test_check_config_lists_every_problem_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    result = CliRunner().invoke(app, ["check-config", str(path)])
    assert result.exit_code == 2
    out = result.output
    for where, line in [
        ("server.port", 2),
        ("workloads.default.max_candidates", 5),
        ("workloads.default.greedy_candidates", 6),
        ("routes.r1.contract.max_age", 13),
    ]:
        assert f"{where} (line {line})" in out, out
    # a section's problem points at its name (line 14), not at its first field
    assert "routes.r2 (line 14): base_url is required" in out


def test_check_config_prints_the_resolved_config(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("workloads: {default: {max_candidates: 2}}\n")
    result = CliRunner().invoke(app, ["check-config", str(path)])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["workloads"]["default"]["max_candidates"] == 2
    assert resolved["workloads"]["default"]["output_ceiling"] == 1024  # defaults filled in
    assert resolved["limits"]["max_candidates_absolute"] == 16


def test_keys_create_stores_only_the_hash(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    config = gateway_config(fake[0], tmp_path)
    raw = config.model_dump(mode="json", exclude_none=True)
    raw["workloads"]["support"] = {"max_candidates": 1}
    path = tmp_path / "ncap.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(
        app, ["keys", "create", "--workload", "support", "--config", str(path)]
    )
    assert result.exit_code == 0, result.output
    key = result.stdout.strip().splitlines()[-1]
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    loaded = parse_config(text)
    assert [(k.workload, k.environment) for k in loaded.keys] == [("support", "production")]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    with gateway(loaded) as gw:
        url = gw.url + "/v1/chat/completions"
        anonymous = httpx.post(url, json=body, timeout=10)
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=10)
        good = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        too_many = httpx.post(
            url, json={**body, "n": 2}, headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
    assert anonymous.status_code == wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert good.status_code == 200
    # the key maps to workload `support`, whose maximum is 1
    assert too_many.json()["error"]["code"] == "candidate_count_exceeds_policy"


def test_serve_refuses_non_loopback_without_keys(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ncap.cli.main", "serve", "--host", "0.0.0.0", "--port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "refusing to start" in result.stderr
