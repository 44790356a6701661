"""Write a probed contract record into the config file, as a round trip.

``ncap probe ROUTE`` writes ``routes.<ROUTE>.contract`` of the file the gateway reads
(docs/decisions/probe-writes-contract-into-config.md): the policy already takes
contracts from there, so there is one source of truth, and the change shows up in review
like any other config change.
The file is edited with ruamel.yaml's round-trip mode, so comments, key order, quoting
and flow style stay as the operator wrote them; only the contract's probed keys change
(``max_age`` and unknown siblings are kept). The new text is validated before it
replaces the file, atomically and with the file's mode kept, so a failed write leaves
the old file whole.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from ncap.config import Config, Contract, parse_config
from ncap.errors import ConfigError

__all__ = ["contract_fields", "write_contract_record"]

# the keys the probe decides, in Contract's order (max_age stays the operator's)
_PROBED = (
    "candidates",
    "max_candidates",
    "output_cap",
    "stream_usage",
    "prompt_cache",
    "verified_at",
    "fingerprint",
)


def _yaml() -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long line the operator wrote
    return y


def contract_fields(contract: Contract) -> dict[str, Any]:
    """The probed keys as YAML-ready values: ``verified_at`` as an ISO-8601 UTC string,
    the fingerprint without unset parts."""
    out: dict[str, Any] = {}
    for key in _PROBED:
        value = getattr(contract, key)
        if key == "verified_at" and value is not None:
            value = value.isoformat().replace("+00:00", "Z")
        elif key == "fingerprint" and value is not None:
            value = {k: v for k, v in value.model_dump().items() if v is not None}
        if value is not None:
            out[key] = value
    return out


def write_contract_record(path: Path, route_id: str, contract: Contract) -> Config:
    """Set ``routes.<route_id>.contract`` in ``path``; returns the config as now written.

    Raises ``ConfigError`` (and leaves the file untouched) when the file cannot be read,
    the route is not configured there, or the result would not validate."""
    doc = _read(path)
    routes = doc.get("routes")
    route = routes.get(route_id) if isinstance(routes, dict) else None
    if not isinstance(route, dict):
        raise ConfigError(f"{path}: route {route_id!r} is not configured in this file")
    current = route.get("contract")
    if not isinstance(current, CommentedMap):
        current = CommentedMap(current or {})
        route["contract"] = current
    for key, value in contract_fields(contract).items():
        _set(current, key, value)
    return _write_checked(path, doc)


def _set(mapping: CommentedMap, key: str, value: Any) -> None:
    """Replace a value in place (its comment stays), a nested map key by key; a new key
    goes where Contract's field order puts it."""
    existing = mapping.get(key)
    if isinstance(value, dict) and isinstance(existing, CommentedMap):
        for name in [k for k in existing if k not in value]:
            del existing[name]
        for name, item in value.items():
            existing[name] = item
    elif key in mapping:
        mapping[key] = value
    else:
        mapping.insert(_position(mapping, key), key, value)


def _position(mapping: CommentedMap, key: str) -> int:
    """After the last present key that comes before ``key`` in Contract's order."""
    order = list(Contract.model_fields)
    before = set(order[: order.index(key)])
    keys = list(mapping)
    return max((i + 1 for i, k in enumerate(keys) if k in before), default=0)


def _read(path: Path) -> CommentedMap:
    try:
        doc = _yaml().load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except Exception as exc:  # ruamel's parser errors share no public base class
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(doc, CommentedMap):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return doc


def _write_checked(path: Path, doc: CommentedMap) -> Config:
    buf = io.StringIO()
    _yaml().dump(doc, buf)
    text = buf.getvalue()
    config = parse_config(text, source=str(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)
    return config
