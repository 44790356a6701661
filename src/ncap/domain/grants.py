"""The candidate-count exceptions and API keys in force, as one swappable snapshot.

The config's entries are the base; the admin API adds entries and revokes entries
(its own or the config's). The policy and the key check read ``Grants`` on every
request instead of the frozen config, so an admin change applies to the next request
without a restart. A change replaces the whole snapshot (one attribute assignment),
so a reader never sees half of one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from ncap.config import Config, ExceptionGrant, KeyEntry

__all__ = ["GrantChanges", "Grants", "key_id"]

T = TypeVar("T")


def key_id(entry: KeyEntry) -> str:
    """A key's public name: its hash prefix, as ``ncap keys list`` prints it."""
    return entry.hash[:19]


@dataclass(frozen=True, slots=True)
class GrantChanges:
    """What the admin store holds: entries it created, ids it revoked."""

    exceptions: tuple[ExceptionGrant, ...] = ()
    keys: tuple[KeyEntry, ...] = ()
    revoked_exceptions: frozenset[str] = frozenset()
    revoked_keys: frozenset[str] = frozenset()
    # the latest dashboard sign-out: every session signed in before it has ended
    sessions_ended_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    exceptions: tuple[ExceptionGrant, ...]
    keys: tuple[KeyEntry, ...]
    keys_required: bool
    sessions_ended_at: datetime | None = None


class Grants:
    """The config's exceptions and keys merged with the admin store's changes."""

    def __init__(self, config: Config, changes: GrantChanges | None = None) -> None:
        self._config = config
        self._now = _merge(config, changes or GrantChanges())

    @classmethod
    def from_config(cls, config: Config) -> Grants:
        return cls(config)

    @property
    def exceptions(self) -> tuple[ExceptionGrant, ...]:
        return self._now.exceptions

    @property
    def keys(self) -> tuple[KeyEntry, ...]:
        return self._now.keys

    @property
    def keys_required(self) -> bool:
        """Once any key exists (config or admin API), every request needs one: revoking
        the last key must not open the gateway to keyless requests."""
        return self._now.keys_required

    @property
    def sessions_ended_at(self) -> datetime | None:
        """The latest dashboard sign-out (any gateway's): older sessions are over."""
        return self._now.sessions_ended_at

    def exception(self, exception_id: str | None) -> ExceptionGrant | None:
        if exception_id is None:
            return None  # no grant has no id (the common request engages none)
        return next((e for e in self._now.exceptions if e.id == exception_id), None)

    def key(self, kid: str) -> KeyEntry | None:
        return next((k for k in self._now.keys if key_id(k) == kid or k.label == kid), None)

    def apply(self, changes: GrantChanges) -> None:
        """Swap in the config merged with ``changes`` (the admin store's whole state)."""
        self._now = _merge(self._config, changes)


def _merge(config: Config, changes: GrantChanges) -> _Snapshot:
    exceptions = _unique(
        (*config.exceptions, *changes.exceptions), lambda e: e.id, changes.revoked_exceptions
    )
    keys = _unique((*config.keys, *changes.keys), key_id, changes.revoked_keys)
    required = bool(config.keys or changes.keys or changes.revoked_keys)
    return _Snapshot(tuple(exceptions), tuple(keys), required, changes.sessions_ended_at)


def _unique(entries: Iterable[T], ident: Callable[[T], str], revoked: frozenset[str]) -> list[T]:
    """Entries in order, the first of each id kept, revoked ids dropped."""
    seen: set[str] = set()
    out: list[T] = []
    for entry in entries:
        name = ident(entry)
        if name in seen or name in revoked:
            continue
        seen.add(name)
        out.append(entry)
    return out
