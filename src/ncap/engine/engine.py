"""The engine facade: load once, prepare requests, run them from asyncio.

``Engine.load`` blocks (model load, a second or two): async callers run it in a thread.
``prepare`` renders the chat template, tokenizes and checks limits in the caller's
thread (through ``asyncio.to_thread``), so errors such as a context overflow are raised
before a stream opens. Events come back from the scheduler thread through
``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ncap.engine.chat_template import ChatTemplate
from ncap.engine.events import (
    ChoiceDelta,
    ChoiceResult,
    Completion,
    Event,
    RequestCancelled,
    RequestDone,
    RequestFailed,
)
from ncap.engine.library import default_model_path, load_library
from ncap.engine.model import LlamaModel
from ncap.engine.params import GenerationParams
from ncap.engine.sampling import SamplerChain, base_seed, choice_seed, compile_grammar
from ncap.engine.scheduler import (
    EngineStats,
    Job,
    PreparedRequest,
    Scheduler,
    SchedulerSettings,
)
from ncap.engine.tools import tool_grammar
from ncap.engine.weights import resolve_weights
from ncap.errors import ContextLengthExceeded, InvalidValue

__all__ = ["Engine", "EngineSettings", "RequestStream", "collect"]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    model_path: str | None = None
    n_ctx: int = 8192
    max_sequences: int = 32
    max_queue: int = 64
    threads: int | None = None
    prefill_chunk: int = 256
    prefix_cache_tokens: int = 0
    # "auto": Q8_0 for the bundled model, the file as it is for model_path (weights.py)
    weights: str = "auto"

    def scheduler(self) -> SchedulerSettings:
        return SchedulerSettings(
            n_ctx=self.n_ctx,
            max_sequences=self.max_sequences,
            max_queue=self.max_queue,
            threads=self.threads or os.cpu_count() or 1,
            prefill_chunk=self.prefill_chunk,
            prefix_cache_tokens=self.prefix_cache_tokens,
        )


class RequestStream:
    """The events of one running request, as an async iterator of event lists.

    ``started`` is set once the scheduler admitted the request (or failed it): time
    before that is queueing, time after it the engine's work on it. ``cancel`` frees
    the request's sequences and waits until the scheduler confirms it.
    """

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.started = asyncio.Event()
        self.done = False
        self.finished: RequestDone | None = None  # the last event, once it arrived
        self.cancelled: RequestCancelled | None = None  # what a cancel freed
        self._loop = asyncio.get_running_loop()
        self._cancel: Callable[[], bool] | None = None

    def sink(self, events: list[Event]) -> bool:
        """Called on the scheduler thread; False once the caller's loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._put, events)
        except RuntimeError:
            return False
        return True

    def bind(self, cancel: Callable[[], bool]) -> None:
        """How to cancel the submitted request (True: it was still queued)."""
        self._cancel = cancel

    def _put(self, events: list[Event]) -> None:
        self.started.set()  # any event at all means the request left the queue
        self.queue.put_nowait(events)

    def __aiter__(self) -> AsyncIterator[list[Event]]:
        return self._events()

    async def _events(self) -> AsyncIterator[list[Event]]:
        while not self.done:
            events = await self.queue.get()
            for event in events:
                if isinstance(event, RequestFailed):
                    self.done = True
                    raise event.error
                if isinstance(event, RequestDone):
                    self.done = True
                    self.finished = event
            yield events

    async def cancel(self) -> RequestCancelled:
        """Cancel the request and wait until its sequences are freed (at most the step
        running now); what it had used by then (nothing while it was queued)."""
        zero = RequestCancelled(0, (0,) * self.prepared.n)
        if self.done or self._cancel is None:
            return self.cancelled or zero
        if self._cancel():  # still queued: gone at once
            self.done, self.cancelled = True, zero
            return zero
        while not self.done:
            for event in await self.queue.get():
                if isinstance(event, RequestCancelled):
                    self.cancelled = event
                elif isinstance(event, RequestDone):  # it finished before the cancel
                    self.finished = event
                    self.cancelled = RequestCancelled(
                        event.prompt_tokens, event.choice_tokens, event.cached_tokens
                    )
                elif isinstance(event, RequestFailed):
                    self.cancelled = zero
                else:
                    continue
                self.done = True
        return self.cancelled or zero


class Engine:
    """One model and one scheduler: the local ``provider: local`` backend."""

    def __init__(self, model: LlamaModel, scheduler: Scheduler, settings: EngineSettings) -> None:
        self.model = model
        self.settings = settings
        self._scheduler = scheduler
        self._template = ChatTemplate(
            model.chat_template, bos_token=model.bos_text, eos_token=model.eos_text
        )

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        """Load the library (checking its build), the model and the scheduler; blocking."""
        lib = load_library()
        source = default_model_path(settings.model_path)
        path = resolve_weights(
            lib,
            source,
            settings.weights,
            bundled=not settings.model_path,
            threads=settings.scheduler().threads,
        )
        model = LlamaModel(lib, path)
        try:
            scheduler = Scheduler(model, settings.scheduler())
        except BaseException:
            model.close()
            raise
        return cls(model, scheduler, settings)

    @property
    def model_file(self) -> Path:
        return self.model.path

    def stats(self) -> EngineStats:
        return self._scheduler.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt (benchmarks start cold; the next request pays)."""
        self._scheduler.drop_prefix_cache()

    def close(self) -> None:
        self._scheduler.close()
        self.model.close()

    # --- preparing ---

    def prompt_tokens(self, params: GenerationParams) -> list[int]:
        """The prompt as the model sees it: the chat template rendered, or the raw prompt."""
        if params.messages is not None:
            return self.model.tokenize(self._template.render(params.messages, params.tools))
        return self.model.tokenize(params.prompt or "", add_special=self.model.add_bos)

    def prepare(self, params: GenerationParams) -> PreparedRequest:
        """Tokenize and check a request against the engine's limits (blocking, no context)."""
        tokens = self.prompt_tokens(params)
        max_new = self._max_new(params, len(tokens))
        self._check(params)
        grammar = compile_grammar(params.json) if params.json is not None else None
        if params.tools is not None:
            grammar = tool_grammar(params.tools)
        if grammar is not None:
            self._check_grammar(params, grammar)
        base = base_seed(params.seed)
        seeds = tuple(choice_seed(base, i) for i in range(params.n))
        return PreparedRequest(tuple(tokens), params, max_new, seeds, grammar)

    def _max_new(self, params: GenerationParams, prompt: int) -> int:
        n_ctx = self.settings.n_ctx
        wanted = params.max_tokens
        if prompt + (wanted or 1) > n_ctx:
            asked = f"{prompt} in the messages" + (
                f", {wanted} in the completion" if wanted else ""
            )
            raise ContextLengthExceeded(
                f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                f"{prompt + (wanted or 0)} tokens ({asked}). Please reduce the length of the "
                "messages or completion.",
                param="messages",
            )
        return wanted if wanted is not None else n_ctx - prompt

    def _check(self, params: GenerationParams) -> None:
        limit = self.settings.max_sequences
        if not 1 <= params.n <= limit:
            raise InvalidValue(
                f"the local engine runs at most {limit} sequences per request", param="n"
            )
        if any(not 0 <= t < self.model.n_vocab for t in params.logit_bias):
            raise InvalidValue(
                "logit_bias names a token id outside the vocabulary", param="logit_bias"
            )
        if not 0 <= params.top_logprobs <= 20:
            raise InvalidValue("top_logprobs must be between 0 and 20", param="top_logprobs")

    def _check_grammar(self, params: GenerationParams, grammar: str) -> None:
        """Parse the grammar once here so a bad one is a 400, not a failed stream."""
        m = self.model
        chain = SamplerChain.build(
            m.lib, m.vocab, m.n_vocab, replace(params, logit_bias={}), seed=0, grammar=grammar
        )
        chain.close()

    # --- running (asyncio) ---

    @asynccontextmanager
    async def open(self, params: GenerationParams) -> AsyncIterator[RequestStream]:
        """Prepare and submit a request; leaving the block early cancels it."""
        prepared = await asyncio.to_thread(self.prepare, params)
        stream = RequestStream(prepared)
        job: Job = self._scheduler.submit(prepared, stream.sink)
        stream.bind(lambda: self._scheduler.cancel(job))
        try:
            yield stream
        finally:
            if not stream.done:
                self._scheduler.cancel(job)

    async def run(self, params: GenerationParams) -> Completion:
        """Run a request to the end and gather its choices."""
        async with self.open(params) as stream:
            return await collect(stream)

    def time_budget(self, prepared: PreparedRequest) -> float:
        """Seconds this request may take once admitted, from its size and the engine's
        measured speed: its prompt, then ``max_new`` steps as if every sequence the
        engine holds were busy beside it, times a margin, plus a floor. A machine that
        got slower measured slower, and the budget grew with it."""
        prefill_s, decode_s = self._scheduler.speed.now()
        prefill = len(prepared.tokens) * prefill_s
        rows = max(self.settings.max_sequences, prepared.n)
        decode = prepared.max_new * rows * decode_s
        return _BUDGET_MARGIN * (prefill + decode) + _BUDGET_FLOOR_S


# the derived budget: three times the estimate, and never under half a minute
_BUDGET_MARGIN = 3.0
_BUDGET_FLOOR_S = 30.0


async def collect(stream: RequestStream) -> Completion:
    """Gather a request's choices from its stream, to the end."""
    params = stream.prepared.params
    choices = [ChoiceResult(i) for i in range(params.n)]
    if params.logprobs:
        for c in choices:
            c.logprobs = []
    async for events in stream:
        done = _apply(choices, events)
        if done is not None:
            return _completion(choices, done)
    raise AssertionError("the engine ended a request without RequestDone")


def _apply(choices: list[ChoiceResult], events: list[Event]) -> RequestDone | None:
    done = None
    for event in events:
        if isinstance(event, ChoiceDelta):
            choice = choices[event.index]
            choice.text += event.text
            if event.logprobs is not None and choice.logprobs is not None:
                choice.logprobs.extend(event.logprobs)
            choice.tool_calls.extend(event.tool_calls)
            if event.finish_reason is not None:
                choice.finish_reason = event.finish_reason
        elif isinstance(event, RequestDone):
            done = event
    return done


def _completion(choices: list[ChoiceResult], done: RequestDone) -> Completion:
    for choice, tokens, mean in zip(choices, done.choice_tokens, done.mean_logprobs, strict=True):
        choice.tokens = tokens
        choice.mean_logprob = mean
    return Completion(choices, done.prompt_tokens, done.completion_tokens, done.cached_tokens)
