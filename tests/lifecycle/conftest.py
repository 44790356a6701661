from __future__ import annotations

import socket
from typing import Any, NoReturn

import pytest


@pytest.fixture(autouse=True)
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifecycle tests run without the network: any connect is a test failure."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError("a lifecycle test tried to open a socket")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
