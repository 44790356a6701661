from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ncap.testing.fake_upstream import FakeState
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ServerThread, fake_upstream, gateway
from tests.support import gateway_config as make_config


@pytest.fixture(autouse=True)
def _route_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)


@pytest.fixture(scope="session")
def fake() -> Iterator[tuple[str, FakeState]]:
    with fake_upstream() as running:
        yield running


@pytest.fixture
def fake_state(fake: tuple[str, FakeState]) -> FakeState:
    fake[1].reset()
    return fake[1]


@pytest.fixture
def gw(fake: tuple[str, FakeState], tmp_path: Path) -> Iterator[ServerThread]:
    """The gateway in front of the shared fake upstream, with fresh stores."""
    fake[1].reset()
    with gateway(make_config(fake[0], tmp_path)) as server:
        yield server
