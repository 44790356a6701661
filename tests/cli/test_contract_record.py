"""The probe's writer: the contract record lands in the config file as a round trip
(comments, order, flow style, max_age kept), validated, atomically, never for a route
that is not configured."""

from __future__ import annotations

import os
import re
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ncap.cli.contract_record import write_contract_record
from ncap.config import Contract, Fingerprint, load_config
from ncap.errors import ConfigError

CONFIG = """\
# the operator's header comment
models:
  chat: [primary, backup]   # primary first
routes:
  primary:
    provider: openai
    base_url: http://127.0.0.1:9/v1
    upstream_model: gpt-4o-mini
    # contract kept by `ncap probe`
    contract:
      candidates: unsupported   # until probed
      max_age: 30d              # ours, not the probe's
  backup:
    provider: openai
    base_url: http://127.0.0.1:9/v1
    contract: {candidates: native, max_candidates: 4, output_cap: shared}
"""

PROBED = Contract(
    candidates="native",
    max_candidates=2,
    output_cap="per_candidate",
    stream_usage="include_usage",
    verified_at=datetime(2026, 12, 1, 9, 30, tzinfo=UTC),
    max_age="1d",  # ignored: max_age is the operator's
    fingerprint=Fingerprint(
        provider="openai", upstream_model="gpt-4o-mini", gateway_version="0.1.0"
    ),
)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "ncap.yaml"
    path.write_text(CONFIG)
    os.chmod(path, 0o640)
    return path


def test_record_is_written_and_read_back_by_the_gateway_loader(config_file: Path) -> None:
    config = write_contract_record(config_file, "primary", PROBED)
    reloaded = load_config(config_file).routes["primary"].contract
    assert reloaded == config.routes["primary"].contract
    assert reloaded == PROBED.model_copy(update={"max_age": "30d"})


def test_comments_order_and_the_other_route_survive(config_file: Path) -> None:
    write_contract_record(config_file, "primary", PROBED)
    text = config_file.read_text()
    for kept in (
        "# the operator's header comment",
        "chat: [primary, backup]   # primary first",
        "# contract kept by `ncap probe`",
        "max_age: 30d              # ours, not the probe's",
        "contract: {candidates: native, max_candidates: 4, output_cap: shared}",
    ):
        assert kept in text
    assert re.search(r"\n      candidates: native +# until probed\n", text)  # comment kept
    keys = re.findall(r"^      (\w+):", text.split("primary:")[1].split("backup:")[0], re.M)
    # new keys placed in Contract's order; operator-owned ones the file lacks stay absent
    assert keys == [k for k in Contract.model_fields if k != "error_responses"]
    assert (
        "verified_at: '2026-12-01T09:30:00Z'" in text or "verified_at: 2026-12-01T09:30:00Z" in text
    )
    assert text.index("provider: openai") < text.index("contract:")
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o640


def test_flow_style_contract_is_updated_in_place(config_file: Path) -> None:
    unsupported = PROBED.model_copy(update={"candidates": "unsupported", "max_candidates": 1})
    write_contract_record(config_file, "backup", unsupported)
    contract = load_config(config_file).routes["backup"].contract
    assert (contract.candidates, contract.max_candidates, contract.output_cap) == (
        "unsupported",
        1,
        "per_candidate",
    )
    assert "backup:" in config_file.read_text() and "primary first" in config_file.read_text()


def test_a_second_probe_replaces_the_fingerprint(config_file: Path) -> None:
    write_contract_record(config_file, "primary", PROBED)
    newer = PROBED.model_copy(
        update={"fingerprint": Fingerprint(provider="openai", upstream_model="gpt-4.1-mini")}
    )
    write_contract_record(config_file, "primary", newer)
    fingerprint = load_config(config_file).routes["primary"].contract.fingerprint
    assert fingerprint == Fingerprint(provider="openai", upstream_model="gpt-4.1-mini")


def test_unconfigured_route_is_refused_and_the_file_untouched(config_file: Path) -> None:
    with pytest.raises(ConfigError, match="'nowhere' is not configured"):
        write_contract_record(config_file, "nowhere", PROBED)
    assert config_file.read_text() == CONFIG


def test_a_record_that_would_not_validate_leaves_the_file_whole(config_file: Path) -> None:
    broken = PROBED.model_copy(update={"max_candidates": 0})  # model_copy does not validate
    with pytest.raises(ConfigError):
        write_contract_record(config_file, "primary", broken)
    assert config_file.read_text() == CONFIG
    assert [p.name for p in config_file.parent.iterdir()] == ["ncap.yaml"]


def test_unreadable_or_invalid_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        write_contract_record(tmp_path / "absent.yaml", "primary", PROBED)
    bad = tmp_path / "bad.yaml"
    bad.write_text("routes: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        write_contract_record(bad, "primary", PROBED)
