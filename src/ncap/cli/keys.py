"""``ncap keys create|list|revoke``: client API keys, stored as SHA-256 hashes in the file.

The file is edited as a round trip (ruamel.yaml): comments, key order, quoting and
timestamps stay as the operator wrote them; only the ``keys`` list changes. The
result is validated *as it will be* before it is written, so the first key of a file
that is only valid with keys (no ``default`` workload) can be created, and a change
that would break the file is refused with the reason. A folder with no file gets one
that writes only ``keys``: by the rule of docs/configuration.md (a file that writes
none of ``workloads``/``models``/``routes`` keeps the embedded demo) the quick start
keeps working, now with a key.
"""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from ncap.config import Config, parse_config
from ncap.domain.grants import GrantChanges, key_id
from ncap.errors import ConfigError

if TYPE_CHECKING:
    from ncap.stores.ports import AdminStore

__all__ = ["keys_app"]

keys_app = typer.Typer(no_args_is_help=True, help="Client API keys (only their hashes are stored).")
err = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML config to edit (default: ./ncap.yaml)"),
]

_NEW_FILE_HEADER = (
    "ncap configuration, written by `ncap keys create`.\n"
    "It writes no workloads/models/routes, so those are the embedded default's\n"
    "(the local smollm2 demo); see docs/configuration.md, 'Which file is read'.\n"
)


def _yaml(mapping: int = 2, offset: int = 2) -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap a long line the operator wrote
    y.indent(mapping=mapping, sequence=mapping + offset, offset=offset)
    return y


def _indent(text: str) -> tuple[int, int]:
    """The file's own indentation (nested mapping indent, dash offset under its key), so
    a rewrite keeps its style and the columns of its comments."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    depth = [len(ln) - len(ln.lstrip(" ")) for ln in lines]
    nested = [
        d for ln, d in zip(lines, depth, strict=True) if d and not ln.lstrip().startswith("-")
    ]
    mapping = min(nested, default=2)
    offset = 2
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("- ") and i and lines[i - 1].rstrip().endswith(":"):
            offset = max(depth[i] - depth[i - 1], 0)
            break
    return mapping, offset


def _read(path: Path) -> Any:
    if not path.exists():
        doc = CommentedMap()
        doc.yaml_set_start_comment(_NEW_FILE_HEADER)
        return doc
    try:
        text = path.read_text()
        doc = _yaml(*_indent(text)).load(text)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except Exception as exc:  # ruamel's parser errors share no public base class
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if doc is None:
        return CommentedMap()
    if not isinstance(doc, CommentedMap):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return doc


def _dump(doc: Any, style: tuple[int, int]) -> str:
    buf = io.StringIO()
    _yaml(*style).dump(doc, buf)
    return buf.getvalue()


def _write_checked(path: Path, doc: Any) -> Config:
    """Validate the new text, then replace the file atomically (mode kept)."""
    text = _dump(doc, _indent(path.read_text()) if path.exists() else (2, 2))
    try:
        config = parse_config(text, source=str(path))
    except ConfigError as exc:
        note = f"{path} was not changed: with this change it would not be valid"
        raise ConfigError(note, [note, *exc.problems]) from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o7777)
    os.replace(tmp, path)
    return config


def _keys(doc: Any) -> Any:
    keys = doc.get("keys")
    if keys is None:
        keys = doc["keys"] = CommentedSeq()
    if not isinstance(keys, list):
        raise ConfigError("keys: must be a list")
    return keys


@keys_app.command("create")
def create(
    workload: Annotated[str, typer.Option(help="Workload whose policy the key's requests use")],
    environment: Annotated[str, typer.Option(help="Environment label (ledger column)")] = (
        "production"
    ),
    label: Annotated[
        str | None, typer.Option(help="A name for the key (for `keys list` / `keys revoke`)")
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Print a new API key once; store only its SHA-256 hash in the config file."""
    from ncap.auth import hash_key

    path = config or Path("ncap.yaml")
    doc = _read(path)
    keys = _keys(doc)
    if label is not None and any(_get(k, "label") == label for k in keys):
        raise ConfigError(f"{path}: a key labelled {label!r} exists; choose another label")
    key = "ncap-" + secrets.token_urlsafe(32)
    entry = CommentedMap()
    entry["hash"] = hash_key(key)
    entry["workload"] = workload
    entry["environment"] = environment
    if label is not None:
        entry["label"] = label
    entry["created"] = datetime.now(UTC).replace(microsecond=0).isoformat()
    keys.append(entry)
    _write_checked(path, doc)
    err.print(f"stored the key's hash in {path}; the key is shown once:", highlight=False)
    typer.echo(key)


@keys_app.command("list")
def list_keys(config: ConfigOpt = None) -> None:
    """The keys in force: the file's and the admin API's (in the config's ledger), less
    those revoked through the admin API: label, workload, environment, hash prefix (the
    admin API's key id), creation date, source."""
    path = config or Path("ncap.yaml")
    keys = _keys(_read(path)) if path.exists() else []
    changes = _admin_changes(path)
    rows = [
        (
            str(_get(k, "label") or ""),
            str(_get(k, "workload") or ""),
            str(_get(k, "environment") or "production"),
            str(_get(k, "hash") or "")[:19],
            str(_get(k, "created") or ""),
            "config",
        )
        for k in keys
        if str(_get(k, "hash") or "")[:19] not in changes.revoked_keys
    ]
    rows += [
        (
            k.label or "",
            k.workload,
            k.environment,
            key_id(k),
            k.created.isoformat() if k.created else "",
            "admin",
        )
        for k in changes.keys
    ]
    header = ("label", "workload", "environment", "hash", "created", "source")
    if sys.stdout.isatty():
        table = Table(*header)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    else:
        for row in (header, *rows):
            typer.echo("\t".join(row))
    err.print(f"{len(rows)} key(s) in {path}", highlight=False)


@keys_app.command("revoke")
def revoke(
    key: Annotated[str, typer.Argument(help="The key's label, or a prefix of its hash")],
    config: ConfigOpt = None,
) -> None:
    """Remove one key from the file (requests with it get 401 once the gateway restarts),
    or revoke one the admin API made (in the ledger's admin tables: running gateways
    apply it within ``stores.admin_refresh_s``, as a revocation through the API)."""
    path = config or Path("ncap.yaml")
    if not path.exists():
        raise ConfigError(f"{path}: no such file (pass --config FILE)")
    doc = _read(path)
    keys = _keys(doc)
    matches = [i for i, k in enumerate(keys) if _matches(k, key)]
    if not matches:
        _revoke_admin_key(path, key)
        return
    if len(matches) > 1:
        raise ConfigError(f"{path}: {len(matches)} keys match {key!r}; give a longer prefix")
    removed = keys.pop(matches[0])
    _write_checked(path, doc)
    name = _get(removed, "label") or str(_get(removed, "hash"))[:19]
    err.print(
        f"revoked {name} (workload {_get(removed, 'workload')}); restart the gateway to apply",
        highlight=False,
    )


def _ledger_url(path: Path) -> str | None:
    """The config's ledger URL, when the config can be read."""
    if not path.exists():
        return None
    try:
        return parse_config(path.read_text(), source=str(path)).stores.ledger
    except ConfigError:
        return None  # `keys list` of a file being repaired still lists its keys


def _existing_admin(path: Path) -> AdminStore | None:
    """The admin tables beside the config's ledger, when it has them (a ``memory://``
    ledger keeps the admin API's changes in the gateway only)."""
    url = _ledger_url(path)
    from ncap.stores import existing_admin

    return existing_admin(url) if url is not None else None


def _admin_changes(path: Path) -> GrantChanges:
    """What the admin API created and revoked, from the config's ledger (nothing when
    the ledger has no admin tables or cannot be reached: said on stderr)."""
    if _ledger_url(path) is None:
        return GrantChanges()

    async def read() -> GrantChanges:
        store = _existing_admin(path)
        if store is None:
            return GrantChanges()
        try:
            return await store.changes()
        finally:
            await store.close()

    try:
        return asyncio.run(read())
    except Exception as exc:  # a store that is down: the file's keys are still listed
        err.print(f"admin-made keys not read ({type(exc).__name__}: {exc})", highlight=False)
        return GrantChanges()


def _revoke_admin_key(path: Path, wanted: str) -> None:
    changes = _admin_changes(path)
    found = [k for k in changes.keys if _matches(k.model_dump(), wanted)]
    if not found:
        raise ConfigError(
            f"{path}: no key labelled {wanted!r} or with a hash starting so"
            " (in the file or among the admin API's keys)"
        )
    if len(found) > 1:
        raise ConfigError(f"{len(found)} admin-made keys match {wanted!r}; give a longer prefix")
    from ncap.stores.ports import AdminChange

    entry = found[0]

    async def record() -> None:
        store = _existing_admin(path)
        assert store is not None  # keys were read from it
        try:
            change = AdminChange("ncap keys revoke", "revoke", "key", key_id(entry))
            await store.record(change, datetime.now(UTC))
        finally:
            await store.close()

    asyncio.run(record())
    err.print(
        f"revoked {entry.label or key_id(entry)} (workload {entry.workload}, made through the "
        "admin API); running gateways apply it within stores.admin_refresh_s",
        highlight=False,
    )


def _get(entry: Any, name: str) -> Any:
    return entry.get(name) if isinstance(entry, dict) else None


def _matches(entry: Any, wanted: str) -> bool:
    digest = str(_get(entry, "hash") or "")
    prefix = wanted if wanted.startswith("sha256:") else "sha256:" + wanted
    return _get(entry, "label") == wanted or (len(wanted) >= 6 and digest.startswith(prefix))
