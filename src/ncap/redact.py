"""What an upstream says back is untrusted: it may echo the route's own credential
("Incorrect API key provided: Bearer sk-…") or put anything in a request id. Two
guards, used wherever upstream text is relayed to a client or stored:

- ``Redactor``: a route's secrets (its credential and every value of its configured
  headers) replaced by ``[redacted]`` in any text, plus anything shaped like a bearer
  token; the text is also bounded in length and stripped of control characters. An
  answer's bytes (whole, or each streamed event) get the secrets replaced too.
- ``bounded_id``: an upstream's request id as the ledger keeps it, at most
  ``MAX_ID_LENGTH`` characters of a plain alphabet; anything else is not an id and is
  dropped (None) rather than stored or relayed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MAX_ID_LENGTH", "REDACTED", "Redactor", "bounded_id"]

REDACTED = "[redacted]"
MAX_ID_LENGTH = 128
# the characters real upstream ids use (req_…, chatcmpl-…, base64url response ids)
_ID = re.compile(rf"[A-Za-z0-9._:/+=\-]{{1,{MAX_ID_LENGTH}}}")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[^\s\"',;]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# shorter header values are not credentials ("true", "v1") and redacting them would
# mangle every message that happens to contain them
MIN_SECRET_LENGTH = 8


def bounded_id(value: str | None) -> str | None:
    """``value`` if it is a plausible id (short, plain characters), else None."""
    if value is None or _ID.fullmatch(value) is None:
        return None
    return value


def _nothing(value: str) -> None:
    return None


class Redactor:
    """One route's secrets, scrubbed from upstream text before it goes anywhere."""

    def __init__(self, secrets: Iterable[str], *, max_length: int = 2048) -> None:
        found = {s.strip() for s in secrets}
        for s in list(found):  # "Bearer KEY": the key alone is the secret too
            scheme, _, rest = s.partition(" ")
            if scheme.lower() in ("bearer", "basic") and rest:
                found.add(rest.strip())
        # longest first: a secret that contains another is replaced whole
        self._secrets = sorted((s for s in found if len(s) >= MIN_SECRET_LENGTH), key=len)[::-1]
        self._raw = [s.encode() for s in self._secrets]
        # whether an id holds any secret, in one search (checked on every answer)
        self._any_secret = (
            re.compile("|".join(map(re.escape, self._secrets))).search
            if self._secrets
            else _nothing
        )
        self._max_length = max_length

    def text(self, value: str) -> str:
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
        value = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", value)
        value = _CONTROL.sub(" ", value)
        if len(value) > self._max_length:
            value = value[: self._max_length] + "…"
        return value

    def bytes(self, data: bytes) -> bytes:
        """An answer's bytes with the secrets replaced (the same object when it holds
        none: the common case costs one substring search per secret)."""
        for secret in self._raw:
            if secret in data:
                data = data.replace(secret, REDACTED.encode())
        return data

    def optional(self, value: str | None) -> str | None:
        return None if value is None else self.text(value)

    def request_id(self, value: str | None) -> str | None:
        """An id that names a secret is no id: dropped, like any implausible one."""
        value = bounded_id(value)
        if value is None or self._any_secret(value):
            return None
        return value
