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


FAULTS = ("error_500", "server_error_400", "reset_mid_stream", "malformed_json", "timeout=5")


def fault_alias(fault: str) -> str:
    """The model alias whose route has the fake upstream inject ``fault``."""
    return "fault-" + fault.partition("=")[0]


def hardened_config(upstream: str, tmp: Path) -> object:
    base = gateway_config(upstream, tmp).model_dump(mode="json")["routes"]["fake"]
    routes = {
        fault_alias(f): {**base, "headers": {"x-fake-fault": f}, "timeout_s": 1, "retries": 1}
        for f in FAULTS
    }
    return gateway_config(
        upstream,
        tmp,
        routes=routes,
        models={MODEL: ["fake"], **{fault_alias(f): [fault_alias(f)] for f in FAULTS}},
        keys=[{"hash": hash_key(CLIENT_KEY), "workload": "default"}],
        server={
            "ramp": {"requests_per_second": 100000, "burst": 100000},
            "max_in_flight": 4096,
            # these suites send many wrong admin keys on purpose, from one address
            "admin_auth_failures_per_minute": 100000,
        },
        workloads={"default": {"max_candidates": 4, "output_ceiling": 256, "max_concurrency": 512}},
    )


@pytest.fixture(scope="module")
def hgw(
    fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    fake[1].reset()
    mp = pytest.MonkeyPatch()
    mp.setenv("NCAP_ADMIN_KEY", ADMIN_KEY)
    mp.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with gateway(hardened_config(fake[0], tmp_path_factory.mktemp("hardening"))) as server:  # type: ignore[arg-type]
        yield server
    mp.undo()
