"""The translator for one schema pair: OpenAI Chat Completions ↔ Anthropic Messages.

Its four parts are one module each: ``anthropic_request`` (request out),
``anthropic_response`` (response in), ``anthropic_stream`` (stream chunk in) and
``anthropic_errors`` (error in → the facts the failure table reads). This class is what
the registry (``providers.kinds.translator_for``) hands an Anthropic route's adapter.

A whole answer is named ``chatcmpl-`` + the message's id; a stream ``chatcmpl-`` + the
response head's ``request-id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ncap.providers.anthropic_errors import anthropic_failure
from ncap.providers.anthropic_request import UPSTREAM, Shape, to_anthropic_request
from ncap.providers.anthropic_response import decode_message, to_chat_completion
from ncap.providers.anthropic_stream import AnthropicStream
from ncap.providers.base import AttemptFailed, RequestKind
from ncap.providers.openai_side import chat_request, summarize
from ncap.providers.translate import Answer, Reply, Sent

__all__ = ["AnthropicTranslator"]

_encode = msgspec.json.Encoder().encode


class AnthropicTranslator:
    """OpenAI ↔ Anthropic; stateless (one instance serves every Anthropic route)."""

    def request(self, body: Mapping[str, Any], kind: RequestKind, *, model: str) -> Sent[Shape]:
        out, shape = to_anthropic_request(chat_request(body, kind, UPSTREAM), model=model)
        return Sent(_encode(out), shape)

    def response(self, payload: bytes, reply: Reply, shape: Shape) -> Answer:
        try:
            msg = decode_message(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise AttemptFailed(
                "protocol", 200, provider_request_id=reply.request_id, detail=str(exc)
            ) from exc
        completion = to_chat_completion(
            msg,
            completion_id=f"chatcmpl-{msg.id}",
            created=reply.created,
            model=reply.model,
            shape=shape,
        )
        rid = reply.request_id or reply.scrub_id(msg.id)
        return Answer(_encode(completion), summarize(completion), rid)

    def stream(self, reply: Reply, shape: Shape) -> AnthropicStream:
        return AnthropicStream(
            completion_id=f"chatcmpl-{reply.request_id or reply.spare_id()}",
            created=reply.created,
            model=reply.model,
            shape=shape,
            provider_request_id=reply.request_id,
        )

    def error(self, status: int, headers: Mapping[str, str], payload: bytes) -> AttemptFailed:
        return anthropic_failure(status, headers, payload)
