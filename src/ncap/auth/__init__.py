"""API keys: how a client's key is stored and compared (a leaf: no web framework)."""

from ncap.auth.keys import hash_key

__all__ = ["hash_key"]
