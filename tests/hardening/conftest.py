"""One gateway with a client key, in front of the shared fake upstream, for the hardening
suites (fuzz, malformed HTTP, security). Endpoints are listed once in ``ENDPOINTS``:
adding ``/v1/completions`` or the admin API to every suite is one line there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ncap.auth import hash_key
from ncap.testing.fake_upstream import FakeState
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ServerThread, gateway, gateway_config

CLIENT_KEY = "sk-ncap-client-key-hardening"
ADMIN_KEY = "sk-ncap-admin-key-hardening"
MODEL = "fake-model"


def hardened_config(upstream: str, tmp: Path) -> object:
    return gateway_config(
        upstream,
        tmp,
        keys=[{"hash": hash_key(CLIENT_KEY), "workload": "default"}],
        server={"ramp": {"requests_per_second": 100000, "burst": 100000}, "max_in_flight": 4096},
        workloads={"default": {"max_candidates": 4, "output_ceiling": 256, "max_concurrency": 512}},
    )


@pytest.fixture(scope="module")
def hgw(fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    fake[1].reset()
    mp = pytest.MonkeyPatch()
    mp.setenv("NCAP_ADMIN_KEY", ADMIN_KEY)
    mp.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with gateway(hardened_config(fake[0], tmp_path_factory.mktemp("hardening"))) as server:  # type: ignore[arg-type]
        yield server
    mp.undo()
