"""``ncap keys create|list|revoke`` keep the operator's file as written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ncap.cli.main import app
from ncap.config import load_config, parse_config
from ncap.http.app import hash_key

COMMENTED = """\
# production gateway: owned by the platform team
server:
  host: 127.0.0.1   # loopback until the keys are in
stores:
  ledger: 'sqlite:///ledger.db'
workloads:
  support:
    max_candidates: 2   # raised in the Q4 review
exceptions:
  - id: eval-q4
    workload: support
    owner: finops@example.com
    max_candidates: 4
    expires: 2099-12-31T00:00:00Z    # written without fractions, must stay so
models: {}
routes: {}
"""


def _create(path: Path, *args: str) -> str:
    result = CliRunner().invoke(app, ["keys", "create", *args, "--config", str(path)])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_create_keeps_comments_order_and_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "ncap.yaml"
    path.write_text(COMMENTED)
    # the file is not valid yet (no keys and no `default` workload): the first key makes it so
    key = _create(path, "--workload", "support", "--label", "support-app")
    text = path.read_text()
    assert text.startswith(COMMENTED.split("models:")[0])  # everything above untouched
    assert "# raised in the Q4 review" in text and "# loopback until the keys are in" in text
    assert "expires: 2099-12-31T00:00:00Z    # written without fractions" in text
    config = parse_config(text)
    (entry,) = config.keys
    assert entry.hash == hash_key(key) and entry.workload == "support"
    assert entry.label == "support-app" and entry.created is not None
    second = _create(path, "--workload", "support", "--environment", "staging")
    assert len(parse_config(path.read_text()).keys) == 2 and second != key
    assert "# production gateway: owned by the platform team" in path.read_text()


def test_a_fresh_folder_keeps_the_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    key = _create(Path("ncap.yaml"), "--workload", "default")
    config = load_config(None)  # what `ncap serve` in this folder now runs
    assert config.models == {"smollm2": ["local-smollm2"]}
    assert config.workloads["default"].max_candidates == 4  # README's n=4 quick start
    assert [k.hash for k in config.keys] == [hash_key(key)]
    assert "embedded default" in Path("ncap.yaml").read_text()  # says why in a comment


def test_refusals_leave_the_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "ncap.yaml"
    path.write_text(COMMENTED)
    before = path.read_text()
    result = CliRunner().invoke(
        app, ["keys", "create", "--workload", "suport", "--config", str(path)]
    )
    assert result.exit_code == 2 and path.read_text() == before
    assert "was not changed" in result.stderr
    assert "keys.0.workload (line 19): unknown workload 'suport' (did you mean 'support'?)" in (
        " ".join(result.stderr.split())
    )
    _create(path, "--workload", "support", "--label", "app")
    duplicate = CliRunner().invoke(
        app, ["keys", "create", "--workload", "support", "--label", "app", "--config", str(path)]
    )
    assert duplicate.exit_code != 0
    assert len(parse_config(path.read_text()).keys) == 1


def test_list_and_revoke(tmp_path: Path) -> None:
    path = tmp_path / "ncap.yaml"
    path.write_text(COMMENTED + "\n# trailing note\n")
    _create(path, "--workload", "support", "--label", "app-one")
    key_two = _create(path, "--workload", "support", "--label", "app-two")
    listed = CliRunner().invoke(app, ["keys", "list", "--config", str(path)])
    assert listed.exit_code == 0
    lines = listed.stdout.splitlines()
    header = ["label", "workload", "environment", "hash", "created", "source"]
    assert lines[0].split("\t") == header
    assert [line.split("\t")[0] for line in lines[1:]] == ["app-one", "app-two"]
    assert key_two not in listed.stdout  # only a hash prefix is shown
    revoked = CliRunner().invoke(app, ["keys", "revoke", "app-one", "--config", str(path)])
    assert revoked.exit_code == 0, revoked.output
    config = parse_config(path.read_text())
    assert [k.label for k in config.keys] == ["app-two"]
    assert "# raised in the Q4 review" in path.read_text()
    by_hash = hash_key(key_two).removeprefix("sha256:")[:10]
    # the last key: the file would be invalid without it (no `default` workload)
    last = CliRunner().invoke(app, ["keys", "revoke", by_hash, "--config", str(path)])
    assert last.exit_code != 0
    assert [k.label for k in parse_config(path.read_text()).keys] == ["app-two"]
