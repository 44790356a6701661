"""``ncap keys list|revoke`` and the admin API manage one set of keys: the CLI lists the
keys the API made (with their API id) and not those the API revoked, and revokes an
API-made key in the ledger's admin tables, which a running gateway applies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from typer.testing import CliRunner

from ncap.auth import hash_key
from ncap.cli.main import app
from ncap.testing.fake_upstream import FakeState
from tests.support import gateway, gateway_config

ADMIN_ENV = "NCAP_TEST_ADMIN_KEY_CLI"
ADMIN_KEY = "admin-secret-for-the-keys-cli"
CONFIG_KEY = "ncap-config-key-for-tests"
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def _rows(path: Path) -> dict[str, list[str]]:
    listed = CliRunner().invoke(app, ["keys", "list", "--config", str(path)])
    assert listed.exit_code == 0, listed.output
    lines = [line.split("\t") for line in listed.stdout.splitlines()]
    assert lines[0] == ["label", "workload", "environment", "hash", "created", "source"]
    return {row[0]: row for row in lines[1:]}


def test_keys_cli_sees_the_admin_apis_keys_and_revocations(
    fake: tuple[str, FakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake[1].reset()
    monkeypatch.setenv(ADMIN_ENV, ADMIN_KEY)
    config = gateway_config(
        fake[0],
        tmp_path,
        server={"admin_key_env": ADMIN_ENV},
        stores={"admin_refresh_s": 0.2},
        keys=[{"hash": hash_key(CONFIG_KEY), "workload": "default", "label": "from-file"}],
    )
    path = tmp_path / "ncap.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    with gateway(config) as gw:
        admin = httpx.Client(
            base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        )
        made = admin.post("/admin/keys", json={"workload": "default", "label": "from-api"})
        assert made.status_code == 201, made.text
        api_key, api_id = made.json()["key"], made.json()["id"]
        rows = _rows(path)
        assert rows["from-api"][3] == api_id and rows["from-api"][5] == "admin"
        assert rows["from-file"][5] == "config"

        revoked = CliRunner().invoke(app, ["keys", "revoke", "from-api", "--config", str(path)])
        assert revoked.exit_code == 0, revoked.output
        assert "from-api" not in _rows(path)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key, max_retries=0)
        deadline = time.monotonic() + 10
        while True:  # the gateway re-reads the admin tables every admin_refresh_s
            try:
                client.chat.completions.create(model="fake-model", messages=MESSAGES)
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "the CLI's revocation never applied"
            time.sleep(0.1)

        # a file key revoked through the API gets 401 and is no longer listed
        file_id = rows["from-file"][3]
        assert admin.delete(f"/admin/keys/{file_id}").status_code == 200
        assert "from-file" not in _rows(path)
