"""The one way a client's API key is hashed, shared by the server (to check a key) and
the CLI (to issue one), so neither imports the other."""

from __future__ import annotations

import hashlib

__all__ = ["hash_key"]


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()
