"""Limits on a validated request that its wire struct does not state (the
config's ``limits``, docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Sized

from ncap.errors import InvalidValue

__all__ = ["check_message_count"]


def check_message_count(messages: Sized, limit: int) -> None:
    """Refuse more than ``limit`` messages: the schema bounds only their shape, and a
    list of a million one-byte messages costs the gateway far more than its bytes."""
    if len(messages) > limit:
        raise InvalidValue(
            f"Too many messages: {len(messages)}; this gateway accepts at most {limit}.",
            param="messages",
        )
