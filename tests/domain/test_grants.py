"""The exceptions and keys in force (``ncap.domain.grants``): the config's entries merged
with the admin store's, looked up by id or label, swapped whole by ``apply``. Found by
mutation testing (docs/mutation.md): no fast test reached ``key``, ``apply`` or
``key_id``; the admin API's HTTP tests did."""

from __future__ import annotations

from typing import Any

from ncap.config import Config, ExceptionGrant, KeyEntry
from ncap.domain.grants import GrantChanges, Grants, key_id

A = "sha256:" + "a" * 24 + "b" * 40  # id: "sha256:aaaaaaaaaaaa"
C = "sha256:" + "c" * 64


def _key(hash_: str, label: str | None = None) -> KeyEntry:
    return KeyEntry(hash=hash_, workload="w", label=label)


def _grant(id_: str, maximum: int = 4) -> ExceptionGrant:
    return ExceptionGrant(
        id=id_, workload="w", owner="o", max_candidates=maximum, expires="2030-01-01T00:00:00Z"
    )


def _config(**kw: Any) -> Config:
    return Config.model_validate(
        {"workloads": {"w": {}, "default": {}}, "models": {}, "routes": {}} | kw
    )


def test_a_keys_id_is_its_hash_prefix() -> None:
    assert key_id(_key(A)) == "sha256:aaaaaaaaaaaa"
    assert len(key_id(_key(A))) == 19


def test_a_key_is_found_by_its_id_or_its_label() -> None:
    grants = Grants(_config(keys=[_key(A, "ci").model_dump()]), GrantChanges(keys=(_key(C),)))
    assert grants.key("sha256:aaaaaaaaaaaa") == _key(A, "ci")
    assert grants.key("ci") == _key(A, "ci")
    assert grants.key("sha256:cccccccccccc") == _key(C)
    assert grants.key(A) is None  # the whole hash is not an id
    assert grants.key("sha256:aaaaaaaaaaa") is None  # nor a shorter prefix
    assert grants.key("nobody") is None


def test_apply_swaps_in_the_config_merged_with_the_whole_change_set() -> None:
    config = _config(exceptions=[_grant("base").model_dump(mode="json")])
    grants = Grants.from_config(config)
    assert [e.id for e in grants.exceptions] == ["base"]
    assert grants.keys == () and grants.keys_required is False
    grants.apply(GrantChanges(exceptions=(_grant("added"),), keys=(_key(C),)))
    assert [e.id for e in grants.exceptions] == ["base", "added"]
    assert grants.exception("added") == _grant("added")
    assert grants.key("sha256:cccccccccccc") == _key(C)
    assert grants.keys_required is True
    # the next change set replaces the previous one, not adds to it
    grants.apply(GrantChanges(revoked_exceptions=frozenset({"base"})))
    assert grants.exceptions == () and grants.exception("added") is None
    assert grants.key("sha256:cccccccccccc") is None
    assert grants.keys_required is False


def test_revoking_the_last_key_still_requires_keys() -> None:
    grants = Grants(_config(keys=[_key(A).model_dump()]))
    grants.apply(GrantChanges(revoked_keys=frozenset({"sha256:aaaaaaaaaaaa"})))
    assert grants.keys == ()
    assert grants.keys_required is True


def test_the_first_entry_of_an_id_wins() -> None:
    config = _config(exceptions=[_grant("x", 4).model_dump(mode="json")])
    grants = Grants(config, GrantChanges(exceptions=(_grant("x", 8), _grant("y", 2))))
    assert [(e.id, e.max_candidates) for e in grants.exceptions] == [("x", 4), ("y", 2)]
    assert grants.exception(None) is None


def test_keys_are_required_once_any_exists_anywhere() -> None:
    assert Grants(_config(keys=[_key(A).model_dump()])).keys_required is True
    assert Grants(_config(), GrantChanges(keys=(_key(C),))).keys_required is True
    assert Grants(_config(), GrantChanges(revoked_keys=frozenset({"x"}))).keys_required is True
    assert Grants(_config()).keys_required is False
