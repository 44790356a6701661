"""The translator for one schema pair: OpenAI Chat Completions ↔ Gemini generateContent.

Its four parts are one module each: ``gemini_request`` (request out), ``gemini_response``
(response in), ``gemini_stream`` (stream chunk in) and ``gemini_errors`` (error in →
the facts the failure table reads). This class is what the registry
(``providers.kinds.translator_for``) hands a Gemini route's adapter.

Ids: a whole answer is named by Gemini's ``responseId`` (else the response head's
``x-request-id``), a stream by its first event's ``responseId``; the OpenAI id is
``chatcmpl-`` and that id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from ncap.providers.base import AttemptFailed, RequestKind
from ncap.providers.gemini_errors import GeminiError, as_attempt_failed, gemini_failure
from ncap.providers.gemini_request import UPSTREAM, to_gemini_request
from ncap.providers.gemini_response import decode_response, to_chat_completion
from ncap.providers.gemini_stream import GeminiStream, response_id
from ncap.providers.openai_side import chat_request, summarize
from ncap.providers.translate import Answer, Reply, Sent

__all__ = ["GeminiTranslator"]

_encode = msgspec.json.Encoder().encode
_SKIP_SIGNATURE = "skip_thought_signature_validator"
_GEMINI_3 = re.compile(r"^gemini-3")


class GeminiTranslator:
    """OpenAI ↔ Gemini; stateless (one instance serves every Gemini route)."""

    def request(self, body: Mapping[str, Any], kind: RequestKind, *, model: str) -> Sent[None]:
        """The Gemini body (the model goes in the URL). Gemini 3 models refuse a replayed
        function call without a thought signature: those get Google's documented
        sentinel."""
        req = chat_request(body, kind, UPSTREAM)
        replay = _SKIP_SIGNATURE if _GEMINI_3.match(model) else None
        return Sent(_encode(to_gemini_request(req, replay_signature=replay)), None)

    def response(self, payload: bytes, reply: Reply, shape: None) -> Answer:
        try:
            resp = decode_response(payload)
            rid = reply.scrub_id(resp.response_id or reply.headers.get("x-request-id"))
            completion = to_chat_completion(
                resp,
                completion_id=f"chatcmpl-{rid or reply.spare_id()}",
                created=reply.created,
                model=reply.model,  # as the stream names it, so both read the same
                provider_request_id=rid,
            )
        except GeminiError as exc:
            raise as_attempt_failed(exc) from exc
        return Answer(_encode(completion), summarize(completion), rid)

    def stream(self, reply: Reply, shape: None) -> GeminiStream:
        rid = reply.scrub_id(response_id(reply.first_event))
        return GeminiStream(
            completion_id=f"chatcmpl-{rid or reply.spare_id()}",
            created=reply.created,
            model=reply.model,
            provider_request_id=rid,
        )

    def error(self, status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
        return gemini_failure(status, headers, payload)
