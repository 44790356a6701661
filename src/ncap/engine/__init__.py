"""The local llama.cpp engine: one prefill per request, n batched decode loops.

``Engine`` loads the model and runs a scheduler thread that owns the llama context
(continuous batching across requests); ``GenerationParams`` is its input, built from a
request body by ``chat_params``/``completion_params``; ``ncap.engine.wire`` turns results
into OpenAI wire shapes. llama-cpp-python is imported only when an engine is loaded.
"""

from ncap.engine.engine import Engine, EngineSettings, RequestStream, collect
from ncap.engine.events import (
    ChoiceDelta,
    ChoiceResult,
    Completion,
    Event,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RequestStarted,
    TokenInfo,
    TopToken,
)
from ncap.engine.params import (
    GenerationParams,
    JsonGrammar,
    LegacyRequest,
    chat_params,
    completion_params,
    include_usage,
)
from ncap.engine.scheduler import EngineStats
from ncap.engine.wire import (
    ChatChunks,
    TextChunks,
    best_of,
    chat_chunk_stream,
    chat_completion,
    new_id,
    summarize,
    text_chunk_stream,
    text_completion,
    usage,
)

__all__ = [
    "ChatChunks",
    "ChoiceDelta",
    "ChoiceResult",
    "Completion",
    "Engine",
    "EngineSettings",
    "EngineStats",
    "Event",
    "GenerationParams",
    "JsonGrammar",
    "LegacyRequest",
    "RequestCancelled",
    "RequestDone",
    "RequestFailed",
    "RequestStarted",
    "RequestStream",
    "TextChunks",
    "TokenInfo",
    "TopToken",
    "best_of",
    "chat_chunk_stream",
    "chat_completion",
    "chat_params",
    "collect",
    "completion_params",
    "include_usage",
    "new_id",
    "summarize",
    "text_chunk_stream",
    "text_completion",
    "usage",
]
