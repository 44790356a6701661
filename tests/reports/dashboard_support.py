"""A gateway over a generated ledger whose busiest workload is named like a script."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from ncap.config import parse_config
from ncap.http.app import create_app
from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config
from tests.support import ServerThread

CANARY = '<script>window.__canary = 1</script>"&'
WORKLOAD_KEY = "ncap-workload-key-not-admin"


@dataclass
class Dashboard:
    server: ServerThread
    admin_key: str

    @property
    def url(self) -> str:
        return self.server.url + "/dashboard"


@contextmanager
def dashboard_gateway(tmp: Path, rows: int = 4000) -> Iterator[Dashboard]:
    ledger = tmp / "ledger.db"
    # rows over the days up to the end of today: the default 24 h window holds a day of
    # them at any hour (ending at the current hour, late in the UTC day it held minutes)
    end = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    spec = LedgerSpec(
        rows=rows, seed=5, end=end + timedelta(days=1), rename={"support-draft": CANARY}
    )
    generate_ledger(ledger, spec)
    raw = synthetic_config(spec, ledger)
    raw["routes"].pop("local-smollm2")  # no model to load: the dashboard only reads
    raw["models"].pop("smollm2")
    env = f"NCAP_TEST_ADMIN_{uuid.uuid4().hex[:8].upper()}"
    digest = hashlib.sha256(WORKLOAD_KEY.encode()).hexdigest()
    raw["server"] = {"admin_key_env": env}
    raw["keys"] = [{"hash": f"sha256:{digest}", "workload": CANARY}]
    config = parse_config(yaml.safe_dump(raw))
    admin_key = "ncap-admin-" + uuid.uuid4().hex
    os.environ[env] = admin_key
    try:
        server = ServerThread(lambda: create_app(config, instance_id="dash")).start()
    finally:
        del os.environ[env]  # read once by create_app
    try:
        yield Dashboard(server, admin_key)
    finally:
        server.stop()
