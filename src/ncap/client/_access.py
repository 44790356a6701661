"""Reading a field the same way from SDK objects and from plain dicts.

The helpers accept the ``openai`` SDK's pydantic models, anything else with
attributes, and decoded JSON, so one code path serves every caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["field_of", "plain"]


def field_of(obj: Any, name: str) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` otherwise; None when absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def plain(obj: Any) -> Any:
    """A JSON-like copy: SDK models through ``model_dump``, mappings as dicts."""
    if isinstance(obj, Mapping):
        return {key: plain(value) for key, value in obj.items()}
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(exclude_unset=True)
    return obj
