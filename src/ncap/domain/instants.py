"""ISO text of UTC instants, formatted once per second (or minute) rather than per call.

Every request formats the instants it records: the budget windows' keys (minute, day,
month), a ledger row's timestamp, a hold's creation time. ``datetime.isoformat`` builds
the whole text each time, offset included; within one second only the microseconds
differ. Each function here keeps the last key it formatted and its text (one tuple,
replaced whole, so a reader on another thread never pairs one key with another's
text) and formats again only when the second (or minute) changes. The text is exactly
what ``isoformat`` gives.
"""

from __future__ import annotations

from datetime import datetime

__all__ = ["bucket_keys", "iso_second"]

_Key = tuple[int, ...]

_last_second: tuple[_Key, str] = ((), "")
_last_minute: tuple[_Key, tuple[str, str, str]] = ((), ("", "", ""))


def iso_second(utc: datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SS`` of a UTC instant: its ``isoformat()`` up to the seconds
    (no fraction, no offset)."""
    global _last_second
    key = (utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second)
    last = _last_second
    if last[0] == key:
        return last[1]
    text = utc.replace(microsecond=0, tzinfo=None).isoformat()
    _last_second = (key, text)
    return text


def bucket_keys(utc: datetime) -> tuple[str, str, str]:
    """The budget windows' keys of a UTC instant: ``YYYY-MM-DDTHH:MM`` (minute),
    ``YYYY-MM-DD`` (day) and ``YYYY-MM`` (month), prefixes of its ``isoformat()``."""
    global _last_minute
    key = (utc.year, utc.month, utc.day, utc.hour, utc.minute)
    last = _last_minute
    if last[0] == key:
        return last[1]
    iso = utc.replace(second=0, microsecond=0, tzinfo=None).isoformat()
    keys = (iso[:16], iso[:10], iso[:7])
    _last_minute = (key, keys)
    return keys
