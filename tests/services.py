"""The real PostgreSQL and Redis for tests: a fresh schema, database or key prefix each.

Servers: ``NCAP_TEST_POSTGRES`` (default ``postgresql://postgres@127.0.0.1:5432/test``)
and ``NCAP_TEST_REDIS`` (default ``redis://127.0.0.1:6379/0``). Other test runs share
them, so every test works in its own namespace and removes it afterwards.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import redis.asyncio as aioredis

PG_URL = os.environ.get("NCAP_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("NCAP_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _require(url: str, name: str) -> None:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=2).close()
    except OSError:
        if os.environ.get("NCAP_TEST_SERVICES") == "skip":
            pytest.skip(f"{name} is not answering at {parts.hostname}:{parts.port}")
        pytest.fail(f"{name} is not answering at {parts.hostname}:{parts.port} (.ci/run starts it)")


def unique(kind: str) -> str:
    return f"ncap_{kind}_{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def pg_schema(url: str = PG_URL) -> AsyncIterator[str]:
    """A ledger URL on a schema of its own, dropped afterwards."""
    _require(url, "PostgreSQL")
    schema = unique("t")
    try:
        yield f"{url}?schema={schema}"
    finally:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


@asynccontextmanager
async def pg_database(url: str = PG_URL) -> AsyncIterator[str]:
    """A URL on a database of its own (created empty, dropped afterwards)."""
    _require(url, "PostgreSQL")
    name = unique("db")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urlsplit(url)
    try:
        yield urlunsplit(parts._replace(path="/" + name))
    finally:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@asynccontextmanager
async def redis_prefix(url: str = REDIS_URL) -> AsyncIterator[str]:
    """A budgets URL with a key prefix of its own; its keys are deleted afterwards."""
    _require(url, "Redis")
    prefix = unique("t")
    try:
        yield f"{url}?prefix={prefix}"
    finally:
        client = aioredis.Redis.from_url(url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
